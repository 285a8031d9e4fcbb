"""The store core beyond single transitions: connection settings, foreign keys, snapshot
captures under a live writer, the write lock across processes, the invariant checker,
no-ledger mode, the mutation counter and the WAL's size. Persisted state is read through
connections of its own, never through the handle that wrote it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
from sqlalchemy import exc, insert

from rolloutdb.store import (
    FinishedGeneration,
    IllegalTransition,
    Reservation,
    Store,
    StoreBusyError,
    check_invariants,
    ledger,
    pools,
)
from rolloutdb.store.sqlite.database import JOURNAL_SIZE_LIMIT
from rolloutdb.store.live.schema import T


def _gen(n=3, reward=1.0, version=0):
    return FinishedGeneration(list(range(n)), [-0.5] * n, reward, [(version, n)])


def _published_group(store, seq, generations=2):
    (gid,) = store.reserve([Reservation(seq, 0, seq)], num_generations=generations, target_step=1)
    for attempt in store.dispatch([gid], policy_version=0):
        store.finish(attempt, _gen())
    store.seal([gid])
    store.enter_replay([gid])
    return gid


def _pragmas(conn, names):
    return {name: conn.exec_driver_sql(f"PRAGMA {name}").scalar() for name in names}


# ---------------------------------------------------------------- connections


def test_every_connection_carries_wal_foreign_keys_busy_timeout_and_journal_size_limit(tmp_path):
    names = ["journal_mode", "foreign_keys", "busy_timeout", "journal_size_limit", "wal_autocheckpoint"]
    with Store.create(tmp_path / "s.sqlite", busy_timeout_ms=1234) as store:
        with store.db.atomic() as writer:
            on_writer = _pragmas(writer, names)
        with store.read() as reader:
            on_reader = _pragmas(reader, names)
    for seen in (on_writer, on_reader):
        assert seen["journal_mode"] == "wal"
        assert seen["foreign_keys"] == 1
        assert seen["busy_timeout"] == 1234
        assert seen["journal_size_limit"] == JOURNAL_SIZE_LIMIT
    # The writer never checkpoints itself; the background checkpointer does.
    assert on_writer["wal_autocheckpoint"] == 0


def test_a_store_opened_again_keeps_the_busy_timeout_it_is_given(tmp_path):
    Store.create(tmp_path / "s.sqlite").close()
    with Store.open(tmp_path / "s.sqlite", busy_timeout_ms=321) as store:
        with store.db.atomic() as writer:
            assert writer.exec_driver_sql("PRAGMA busy_timeout").scalar() == 321


def test_a_store_opens_from_a_directory_with_a_hash_and_a_space_in_its_name(tmp_path):
    path = tmp_path / "run #3 copy" / "s.sqlite"
    Store.create(path).close()
    with Store.open(path) as store:
        with store.atomic() as tx:
            pools.push_spare(tx, [Reservation(0, 0, 0)])
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM spare_prompts").fetchone()[0] == 1


def test_opening_a_damaged_file_raises_not_a_store_and_leaves_it_alone(tmp_path):
    from rolloutdb.store import NotAStoreError

    good = tmp_path / "good.sqlite"
    Store.create(good).close()
    bad = tmp_path / "bad.sqlite"
    data = bytearray(good.read_bytes())
    data[100] ^= 0xFF  # page 1's b-tree page type: sqlite_master cannot be read
    bad.write_bytes(bytes(data))
    with pytest.raises(NotAStoreError, match="bad.sqlite"):
        Store.open(bad)
    assert bad.read_bytes() == bytes(data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.sqlite", "good.sqlite"]


def test_a_rollout_for_a_missing_group_is_refused_by_the_foreign_key(store, second_connection):
    before = store.mutation_counter
    with pytest.raises(exc.IntegrityError, match="FOREIGN KEY"):
        with store.atomic() as tx:
            tx.execute(
                insert(T["rollouts"]).values(
                    group_id=999, generation_index=0, attempt=0, state="running", policy_version=0, dispatched_at=0.0
                )
            )
    conn = second_connection(store.path)
    assert conn.execute("SELECT count(*) FROM rollouts").fetchone()[0] == 0
    assert store.mutation_counter == before


def test_a_manual_checkpoint_leaves_the_writer_usable(store, second_connection):
    with store.atomic() as tx:
        pools.push_spare(tx, [Reservation(0, 0, 0)])
    busy, frames, copied = store.db.checkpoint()
    assert busy == 0 and frames == copied
    # The checkpoint must not leave a transaction open on the writer connection.
    with store.atomic() as tx:
        pools.push_spare(tx, [Reservation(1, 0, 1)])
    assert second_connection(store.path).execute("SELECT count(*) FROM spare_prompts").fetchone()[0] == 2


# ---------------------------------------------------------------- captures under load


class _SpareWriter(threading.Thread):
    """Commits transactions that each add exactly one spare prompt and move the cursor
    past it, so in any consistent state: spares == cursor == base + mutation counter."""

    def __init__(self, store, start_seq):
        super().__init__(daemon=True)
        self.store = store
        self.seq = start_seq
        self.stop = threading.Event()
        self.error = None

    def run(self):
        try:
            while not self.stop.is_set():
                with self.store.atomic() as tx:
                    pools.push_spare(tx, [Reservation(self.seq, 0, self.seq)])
                    pools.advance_cursor(tx, self.seq + 1, 0)
                self.seq += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


@contextlib.contextmanager
def _writing(store, preload=20_000):
    # One big transaction first, so a capture has real pages to copy.
    with store.atomic() as tx:
        pools.push_spare(tx, [Reservation(s, 0, s) for s in range(preload)])
        pools.advance_cursor(tx, preload, 0)
    writer = _SpareWriter(store, preload)
    writer.start()
    try:
        yield writer
    finally:
        writer.stop.set()
        writer.join(10)
    assert writer.error is None, writer.error


def _wait_for_commits(store, at_least):
    target = store.mutation_counter + at_least
    deadline = time.monotonic() + 60
    while store.mutation_counter < target:
        assert time.monotonic() < deadline, f"the writer made fewer than {at_least} commits in 60 s"
        time.sleep(0.001)


def _snapshot_state(path):
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
        spares = conn.execute("SELECT count(*) FROM spare_prompts").fetchone()[0]
        cursor = conn.execute("SELECT next_seq FROM sampler_state").fetchone()[0]
        counter = conn.execute("SELECT mutation_counter FROM run_meta").fetchone()[0]
        conn.execute("BEGIN")
        report = check_invariants(conn)
    return integrity, spares, cursor, counter, report


def test_captures_taken_while_a_writer_commits_are_consistent(store, tmp_path):
    preload = 20_000
    counters = []
    with _writing(store, preload):
        for k in range(5):
            _wait_for_commits(store, 20)
            cap = store.capture(tmp_path / f"snap{k}.sqlite")
            integrity, spares, cursor, counter, report = _snapshot_state(cap.path)
            assert integrity == "ok"
            assert report.ok, report.problems
            # The preload was mutation 1, every later mutation added one spare.
            assert spares == cursor == preload + counter - 1
            assert counter == cap.mutation_counter
            assert cap.row_counts["spare_prompts"] == spares
            counters.append(counter)
    assert counters == sorted(counters) and len(set(counters)) == 5, "the writer kept committing between captures"
    assert not list(tmp_path.glob("snap*.sqlite-*")), "a snapshot file stands alone, without -wal or -shm"


def test_at_cut_sees_exactly_the_state_that_is_copied(store, tmp_path):
    def look(conn):
        counter = conn.execute("SELECT mutation_counter FROM run_meta").fetchone()[0]
        # Give the writer time to commit more while the cut is held open.
        _wait_for_commits(store, 10)
        return counter, conn.execute("SELECT count(*) FROM spare_prompts").fetchone()[0]

    with _writing(store):
        _wait_for_commits(store, 5)
        cap = store.capture(tmp_path / "snap.sqlite", at_cut=look)
        assert store.mutation_counter > cap.check_result[0]
    _integrity, spares, _cursor, counter, _report = _snapshot_state(cap.path)
    assert cap.check_result == (counter, spares)


def test_an_exception_in_at_cut_leaves_no_file(store, tmp_path):
    out = tmp_path / "out"
    out.mkdir()

    def refuse(_conn):
        raise RuntimeError("the trainer moved")

    with _writing(store, preload=100):
        with pytest.raises(RuntimeError, match="the trainer moved"):
            store.capture(out / "snap.sqlite", at_cut=refuse)
    assert os.listdir(out) == []


# ---------------------------------------------------------------- the write lock across processes

_HOLD_WRITE_LOCK = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("INSERT INTO spare_prompts VALUES (900, 0, 900, 0.0)")
print("holding", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
conn.close()
"""


def test_a_second_process_holding_the_write_lock_makes_atomic_raise_store_busy(tmp_path, second_connection):
    with Store.create(tmp_path / "s.sqlite", busy_timeout_ms=200) as store:
        before = store.mutation_counter
        child = subprocess.Popen(
            [sys.executable, "-c", _HOLD_WRITE_LOCK, str(store.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout.readline().strip() == "holding"
            with pytest.raises(StoreBusyError, match=r"another writer held the store for more than 200 ms.*second process"):
                with store.atomic() as tx:
                    pools.push_spare(tx, [Reservation(0, 0, 0)])
        finally:
            child.communicate("go\n", timeout=30)
        assert child.returncode == 0
        # The refused transaction left nothing behind and the writer works again.
        with store.atomic() as tx:
            pools.push_spare(tx, [Reservation(1, 0, 1)])
        rows = second_connection(store.path).execute("SELECT sample_seq FROM spare_prompts ORDER BY 1").fetchall()
        assert rows == [(1,), (900,)]
        assert store.mutation_counter == before + 1


# ---------------------------------------------------------------- invariants


def _violate_exactly_once(conn, gid):
    # The published group's prompt is also waiting in the spare pool: it would run twice.
    conn.execute("INSERT INTO spare_prompts SELECT 50, epoch, prompt_id, 0.0 FROM prompt_groups WHERE group_id = ?", (gid,))


def _violate_replay_xor_in_flight(conn, gid):
    # A group in the replay buffer gets a running attempt again.
    conn.execute(
        "INSERT INTO rollouts (group_id, generation_index, attempt, state, policy_version, dispatched_at) "
        "VALUES (?, 0, 1, 'running', 0, 0.0)",
        (gid,),
    )


def _violate_no_orphans(conn, _gid):
    conn.execute(
        "INSERT INTO samples (group_id, generation_index, prompt_id, num_tokens, token_ids, logprobs, reward, "
        "policy_version, version_token_counts, created_at) VALUES (4242, 0, 1, 0, x'', x'', 0.0, 0, '[]', 0.0)"
    )


def _violate_cursor_covers(conn, _gid):
    conn.execute("UPDATE sampler_state SET next_seq = 1")


@pytest.mark.parametrize(
    "violate, number, expected",
    [
        (_violate_exactly_once, 1, r"invariant 1: 1 prompts both in the ledger and in the spare pool: epoch 0 prompt 1"),
        (_violate_replay_xor_in_flight, 2, r"invariant 2: 1 groups in replay that still have a running attempt: group \d+"),
        (_violate_no_orphans, 3, r"invariant 3: 1 samples of no live group: sample \d+ \(group 4242\)"),
        (_violate_cursor_covers, 4, r"invariant 4: 2 ledger groups beyond the sampler cursor: group \d+ at sample_seq 1"),
    ],
    ids=["exactly_once", "replay_xor_in_flight", "no_orphan_payloads", "cursor_covers_groups"],
)
def test_each_invariant_broken_behind_the_stores_back_is_reported_with_its_number(store, violate, number, expected):
    _published_group(store, 0)
    gid = _published_group(store, 1)
    store.reserve([Reservation(2, 0, 2)], num_generations=1, target_step=2)
    assert store.check_invariants().ok
    with contextlib.closing(sqlite3.connect(store.path)) as conn:
        violate(conn, gid)
        conn.commit()
    report = store.check_invariants()
    assert not report.ok
    matching = [i for i, p in enumerate(report.problems) if re.match(expected, p)]
    assert matching, report.problems
    # The number is data beside each line, not something to parse back out of it.
    assert len(report.invariants) == len(report.problems)
    assert report.invariants[matching[0]] == number


def test_the_invariant_report_counts_groups_spares_replay_and_the_cursor(store):
    _published_group(store, 0)
    store.reserve([Reservation(1, 0, 1)], num_generations=1, target_step=2)
    with store.atomic() as tx:
        pools.push_spare(tx, [Reservation(2, 0, 2)])
        pools.advance_cursor(tx, 3, 0)
    counts = store.check_invariants().counts
    assert counts == {"published": 1, "reserved": 1, "spare": 1, "replay": 1, "cursor": 3}


# ---------------------------------------------------------------- no-ledger dispatch


def test_without_ledger_dispatch_samples_and_replay_need_no_ledger_rows(tmp_path, second_connection):
    with Store.create(tmp_path / "s.sqlite", ledger_dispatch=False, replay_capacity=4) as store:
        with store.atomic() as tx:
            pools.advance_cursor(tx, 2, 0)
            ledger.write_samples(tx, [(7, i, 70, _gen()) for i in range(2)] + [(8, 0, 80, _gen(5))])
            permits = ledger.insert_replay(tx, [(7, 0, 70, 1, 6), (8, 0, 80, 1, 5)])
        assert permits == [0, 1]
        assert store.check_invariants().ok
        conn = second_connection(store.path)
        assert conn.execute("SELECT count(*) FROM prompt_groups").fetchone()[0] == 0
        assert conn.execute("SELECT group_id, permit FROM replay_groups ORDER BY 1").fetchall() == [(7, 0), (8, 1)]

        with store.atomic() as tx:
            ledger.release_replay(tx, [7])
        assert store.check_invariants().ok
        assert conn.execute("SELECT group_id FROM replay_groups").fetchall() == [(8,)]
        assert conn.execute("SELECT DISTINCT group_id FROM samples").fetchall() == [(8,)]
        # The released permit is free for the next group.
        with store.atomic() as tx:
            assert ledger.insert_replay(tx, [(9, 0, 90, 2, 0)]) == [0]


# ---------------------------------------------------------------- the mutation counter


def _counter_seen_by_another_connection(path):
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute("SELECT mutation_counter FROM run_meta").fetchone()[0]


def test_the_mutation_counter_moves_on_every_committed_mutation_and_nothing_else(store):
    seen = [_counter_seen_by_another_connection(store.path)]

    def step(expect_move):
        now = _counter_seen_by_another_connection(store.path)
        assert (now > seen[-1]) == expect_move, f"counter went {seen[-1]} -> {now}"
        seen.append(now)

    (gid,) = store.reserve([Reservation(0, 0, 0)], num_generations=1, target_step=1)
    step(True)
    (attempt,) = store.dispatch([gid], policy_version=0)
    step(True)
    store.finish(attempt, _gen())
    step(True)
    with store.atomic() as tx:
        pools.set_shortfall(tx, 1, 3)
    step(True)

    with pytest.raises(RuntimeError):
        with store.atomic() as tx:
            pools.push_spare(tx, [Reservation(5, 0, 5)])
            raise RuntimeError("rolled back")
    step(False)
    with pytest.raises(IllegalTransition):
        store.enter_replay([gid])
    step(False)
    store.record_snapshot_attempt("skipped_unchanged", anchor="bootstrap")
    step(False)
    _ = store.mutation_counter, store.run_meta(), store.check_invariants()
    step(False)

    store.seal([gid])
    step(True)
    assert seen == sorted(seen)


# ---------------------------------------------------------------- the WAL's size


def _wal_checkpoint_sequence(wal) -> int:
    """The WAL header's checkpoint sequence number (bytes 12-15, big-endian): SQLite adds
    one each time the WAL restarts from its start (sqlite.org/fileformat.html, 4.1)."""
    with open(wal, "rb") as f:
        return int.from_bytes(f.read(16)[12:16], "big")


def test_the_wal_restarts_again_and_again_under_a_writer_that_never_pauses(store, second_connection):
    """Each transaction rewrites one 128 KiB random payload (about 33 new WAL frames). With
    no readers the checkpointer must let the WAL restart, or it grows with everything
    written (220 MB in 2 s, measured). How far it grows between restarts follows the disk:
    64-66 MiB on a quiet one, up to 131 MiB of 256 written while another process wrote
    and fsynced beside it (each checkpoint pass pays two fsyncs), so the test counts the
    restarts (the WAL header's checkpoint sequence) instead of bounding the size."""
    wal = store.path.with_name(store.path.name + "-wal")
    payload_bytes = 128 * 1024
    (gid,) = store.reserve([Reservation(0, 0, 0)], num_generations=1, target_step=1)
    (attempt,) = store.dispatch([gid], policy_version=0)
    written = largest = 0
    sequences = set()
    while written < 6 * JOURNAL_SIZE_LIMIT:
        with store.atomic() as tx:  # a running episode's state, saved again and again
            pools.put_episode(tx, attempt, turn=1, state={"x": os.urandom(payload_bytes // 2).hex()})
        written += payload_bytes
        largest = max(largest, wal.stat().st_size)
        sequences.add(_wal_checkpoint_sequence(wal))
    restarts = len(sequences) - 1
    assert restarts >= 2, f"the WAL restarted {restarts} time(s) in {written / 2**20:.0f} MiB of writes"
    assert largest < written / 2, f"WAL reached {largest / 2**20:.0f} MiB after {written / 2**20:.0f} MiB of writes"
    assert second_connection(store.path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_closing_the_store_interrupts_a_checkpoint_in_progress_and_leaves_the_main_file_whole(tmp_path, second_connection):
    """`close()` promises a file that is whole on its own: no checkpoint may write the main
    file after it returns. The store is closed while the background checkpointer copies a
    48 MiB WAL (the main file growing is the sign); then the checkpointer's thread is gone,
    no WAL is left, and a copy of the main file alone (what a user's `cp` after a clean
    stop takes) holds the last commit. Planted: a stop() that returns without waiting for
    the pass left a torn copy ("database disk image is malformed", once, on a bench)."""
    import shutil

    path = tmp_path / "s.sqlite"
    store = Store.create(path)
    (gid,) = store.reserve([Reservation(0, 0, 0)], num_generations=1, target_step=1)
    (attempt,) = store.dispatch([gid], policy_version=0)
    state = {"x": os.urandom(24 * 2**20).hex()}  # 48 MiB of text: about 12k WAL frames
    with store.atomic() as tx:
        key = pools.put_episode(tx, attempt, turn=1, state=state)
    before = path.stat().st_size
    deadline = time.monotonic() + 60  # a hang detector, not a speed test
    while path.stat().st_size == before and time.monotonic() < deadline:
        time.sleep(0.001)  # the checkpointer's pass has begun once the main file grows
    store.close()
    assert not [t for t in threading.enumerate() if t.name == f"rolloutdb-checkpointer:{path.name}"]
    assert not path.with_name(path.name + "-wal").exists()
    alone = tmp_path / "alone.sqlite"
    shutil.copyfile(path, alone)
    conn = second_connection(alone)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    (saved,) = conn.execute("SELECT state FROM env_episodes WHERE episode_key = ?", (key,)).fetchone()
    assert json.loads(saved) == state


@pytest.mark.filterwarnings("ignore:transaction already deassociated")  # the rollback after the close
def test_a_store_closed_inside_a_transaction_still_closes(tmp_path):
    """stop() waits for the checkpointer, and the checkpointer waits for the writer lock
    for its held pass (past WAL_RESTART_BYTES of WAL) and to shrink the WAL: a close()
    from inside a transaction (an error path, a signal handler) must not wait forever on
    a lock its own caller holds. A 40 MiB WAL makes the checkpointer want the lock while
    the transaction sleeps. Planted: the held pass taking the lock unconditionally hung."""
    path = tmp_path / "s.sqlite"
    store = Store.create(path)
    (gid,) = store.reserve([Reservation(0, 0, 0)], num_generations=1, target_step=1)
    (attempt,) = store.dispatch([gid], policy_version=0)
    with store.atomic() as tx:
        pools.put_episode(tx, attempt, turn=1, state={"x": os.urandom(20 * 2**20).hex()})
    outcome = []

    def close_inside_a_transaction():
        with contextlib.suppress(Exception):  # the transaction cannot commit on a closed store
            with store.atomic():
                time.sleep(1.5)  # the checkpointer copies the WAL, then waits for the lock
                store.close()
                outcome.append("closed")

    closer = threading.Thread(target=close_inside_a_transaction, daemon=True)
    closer.start()
    closer.join(timeout=60)  # a hang detector, not a speed test
    assert outcome == ["closed"] and not closer.is_alive()
    assert not [t for t in threading.enumerate() if t.name == f"rolloutdb-checkpointer:{path.name}"]
