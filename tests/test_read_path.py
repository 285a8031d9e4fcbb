"""The one read path: `Store.read()` is a read transaction (BEGIN DEFERRED, no write
lock). A reader neither waits for writers nor holds them up, and sees one state."""

from __future__ import annotations

import contextlib
import sqlite3
import threading

import pytest

from rolloutdb.store import Reservation, Store, pools


def _write_spare_on_another_connection(path, seq: int, timeout_s: float = 0.3) -> None:
    """A writer that is not the store's: another process would open the file like this."""
    with contextlib.closing(sqlite3.connect(path, timeout=timeout_s, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO spare_prompts (sample_seq, epoch, prompt_id, added_at) VALUES (?, 0, ?, 0)", (seq, seq))
        conn.execute("COMMIT")


def _spares(conn) -> int:
    return conn.exec_driver_sql("SELECT count(*) FROM spare_prompts").scalar()


def test_a_writer_on_another_connection_commits_while_a_store_read_is_open_and_the_reader_keeps_its_state(tmp_path):
    path = tmp_path / "s.sqlite"
    with Store.create(path) as store:
        with store.read() as conn:
            assert _spares(conn) == 0
            _write_spare_on_another_connection(path, 0)  # raises "database is locked" if the read held the lock
            _write_spare_on_another_connection(path, 1)
            assert _spares(conn) == 0  # one consistent state for the whole read
        with store.read() as conn:
            assert _spares(conn) == 2
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM spare_prompts").fetchone()[0] == 2


def test_a_write_transaction_makes_a_writer_on_another_connection_give_up_which_a_read_must_not(tmp_path):
    """The contrast that shows the test above can fail: the write lock does block."""
    path = tmp_path / "s.sqlite"
    with Store.create(path) as store:
        with store.atomic():
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                _write_spare_on_another_connection(path, 0, timeout_s=0.1)


def test_a_read_in_one_thread_does_not_hold_up_a_store_write_in_another(tmp_path):
    with Store.create(tmp_path / "s.sqlite") as store:
        reading, release = threading.Event(), threading.Event()
        seen: list[int] = []

        def reader() -> None:
            with store.read() as conn:
                seen.append(_spares(conn))
                reading.set()
                release.wait(10)
                seen.append(_spares(conn))

        t = threading.Thread(target=reader)
        t.start()
        try:
            assert reading.wait(10)
            done = threading.Event()
            writer = threading.Thread(target=lambda: (_push(store), done.set()))
            writer.start()
            assert done.wait(5), "the write waited for a read to end"
            writer.join(5)
        finally:
            release.set()
            t.join(10)
        assert seen == [0, 0]
        assert store.mutation_counter == 1


def _push(store: Store) -> None:
    with store.atomic() as tx:
        pools.push_spare(tx, [Reservation(0, 0, 0)])


def test_a_read_changes_nothing_and_a_nested_read_joins_the_outer_one(tmp_path):
    path = tmp_path / "s.sqlite"
    with Store.create(path) as store:
        _push(store)
        before = path.with_name("s.sqlite-wal").stat().st_size, store.mutation_counter
        with store.read() as outer:
            with store.read() as inner:
                assert inner is outer
                assert inner.exec_driver_sql("SELECT count(*) FROM spare_prompts").scalar_one() == 1
        assert (path.with_name("s.sqlite-wal").stat().st_size, store.mutation_counter) == before


def test_reads_are_timed_into_the_pump_share_and_their_connections_are_closed_with_the_store(tmp_path):
    store = Store.create(tmp_path / "s.sqlite")
    name = threading.current_thread().name
    count = store.tx_time.totals.get(name, [0])[0]
    with store.read() as conn:
        pools.get_shortfall(conn)
        reader = conn
    assert store.tx_time.totals[name][0] == count + 1
    store.close()
    assert reader.closed
    # The last connection to close removes the WAL: no reader connection was left open.
    assert not (tmp_path / "s.sqlite-wal").exists()
