"""Connections, pragmas and the one way to open a transaction.

Every write is one short transaction begun explicitly with ``BEGIN IMMEDIATE``. pysqlite
otherwise delays ``BEGIN`` until the first write, so two read-then-write transactions
could interleave and one of them would fail late with SQLITE_BUSY; taking the write lock
up front makes a transaction a clean *mutation* (a snapshot's read transaction is its
*cut*: the two words are kept apart). We follow the recipe of SQLAlchemy's
SQLite dialect: turn off pysqlite's own transaction handling (``isolation_level=None``)
and emit ``BEGIN`` from the engine's ``begin`` event.

The store has one writer connection, shared by the pumps under a lock (SQLite admits
one writer at a time anyway, and a long-lived connection skips a pool checkout per
transaction). Readers use their own connections (`read()`: pooled reader connections
for the pumps' reads; snapshot capture and inspection open their own); under WAL they see
one consistent state while the writer goes on, and take no write lock.

The writer never checkpoints the WAL itself (``wal_autocheckpoint=0``): measured here, the
writer's own auto-checkpoint right after a large snapshot stalled it 150-200 ms. A
background thread runs PASSIVE checkpoints instead, which never wait for the writer.
Under a writer that never pauses, though, a PASSIVE checkpoint never *completes* (frames
keep arriving while it copies), the WAL is never restarted and grows without bound
(measured: 220 MB in 2 s). So when the WAL holds more than a threshold of frames, the
checkpointer runs one more PASSIVE pass holding the writer lock: it only copies the frames written since
its previous pass, the checkpoint completes, and the writer's next commit restarts the
WAL from its start and truncates it to ``journal_size_limit``. How far the WAL grows
between restarts follows the disk: each pass that copies pays two fsyncs, so under a
writer of ~100 MB/s it peaked at 64-66 MiB on a quiet disk and at 100-131 MiB while
another process wrote and fsynced beside it (2026-12-04).

Two more stalls showed up beside a snapshot of 1M ledger rows and 1 GB of payload
(bench/bench_snapshot_latency.py). While the capture's read transaction pins the WAL it
grows (100-200 MB here); after it, (1) the held pass copied everything that arrived
during one long unheld pass (20 ms held), and (2) the writer's first commit after the
restart truncated the WAL back to the limit, and freeing 100 MB of file took 50 ms.
So the checkpointer catches up unheld until a pass copies few frames, holds the writer
only when no reader pins the WAL, and lowers the writer's ``journal_size_limit`` one step at a time
so that each restart frees at most `WAL_SHRINK_STEP`.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import URL, Connection, Engine, create_engine, event, exc
from sqlalchemy.pool import NullPool

from ..errors import NotAStoreError, StoreBusyError

BUSY_TIMEOUT_MS = 5000
JOURNAL_SIZE_LIMIT = 64 * 1024 * 1024  # without it the WAL file never shrinks
CHECKPOINT_INTERVAL_S = 0.25
# Past this WAL size the checkpointer briefly holds the writer to let the WAL restart.
WAL_RESTART_BYTES = JOURNAL_SIZE_LIMIT // 2
# Freeing a file's blocks costs several ms per step here (ext4 with online discard); a
# restart frees at most this much of the WAL file.
WAL_SHRINK_STEP = 8 * 1024 * 1024
# Unheld passes repeat (up to this many) while one still copies more than CATCH_UP_FRAMES,
# so the held pass copies only what a short pass left behind. (Counted in frames, not
# time: every pass that copies anything pays two fsyncs, about 4 ms each on these disks.)
CATCH_UP_PASSES = 4
CATCH_UP_FRAMES = 256


# Debian's libsqlite3 (and Pythons built on it, as here) is compiled with
# SQLITE_SECURE_DELETE: every freed page is overwritten with zeros, so each payload the
# store drops (a sealed sample's BLOBs, a trained group's samples, a finished attempt's
# chunks) is written a second time, as zeros, through the WAL and then the checkpoint.
# Rollout payloads are not secrets the file must scrub; OFF is SQLite's own default.
SECURE_DELETE = "OFF"


def _apply_pragmas(dbapi_conn: sqlite3.Connection, *, synchronous: str, writer: bool, busy_timeout_ms: int) -> None:
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    cur.execute("PRAGMA journal_mode = WAL")
    cur.execute(f"PRAGMA synchronous = {synchronous}")
    cur.execute("PRAGMA foreign_keys = ON")
    cur.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
    cur.execute(f"PRAGMA secure_delete = {SECURE_DELETE}")
    if writer:
        cur.execute("PRAGMA wal_autocheckpoint = 0")
    cur.close()


_BEGIN = {mode: f"BEGIN {mode}" for mode in ("DEFERRED", "IMMEDIATE", "EXCLUSIVE")}


def make_engine(
    path: str | Path, *, synchronous: str = "NORMAL", writer: bool = True, busy_timeout_ms: int = BUSY_TIMEOUT_MS
) -> Engine:
    """An engine whose connections carry the store's pragmas and explicit BEGIN.

    ``conn.execution_options(sqlite_begin="DEFERRED")`` makes a read transaction;
    the default is ``IMMEDIATE``.
    """
    engine = create_engine(
        URL.create("sqlite", database=str(Path(path))),  # a `?` in the path stays in the name
        poolclass=NullPool,
        # The writer connection is shared by the pumps' threads under a lock.
        connect_args={"check_same_thread": False},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # noqa: ANN001 - SQLAlchemy event signature
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
        _apply_pragmas(dbapi_conn, synchronous=synchronous, writer=writer, busy_timeout_ms=busy_timeout_ms)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "IMMEDIATE")
        # On the sqlite3 connection: through exec_driver_sql this cost ~30 µs of
        # SQLAlchemy's execution machinery per transaction (bench/bench_transitions.py).
        conn.connection.driver_connection.execute(_BEGIN[mode])

    return engine


class Database:
    """The live store file: one writer connection under a lock, a checkpointer thread,
    and fresh connections for readers."""

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: str = "NORMAL",
        checkpointer: bool = True,
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
    ):
        self.path = Path(path)
        if not self.path.is_file():
            raise NotAStoreError(f"{self.path}: no store file here; create one with Store.create()")
        self.busy_timeout_ms = int(busy_timeout_ms)
        self.engine = make_engine(self.path, synchronous=synchronous, writer=True, busy_timeout_ms=self.busy_timeout_ms)
        self._write_lock = threading.RLock()
        self._writer: Connection = self.engine.connect()
        self._depth = 0
        self._closed = False
        self._local = threading.local()  # the reader connection of a thread's open read()
        self._readers_lock = threading.Lock()
        self._idle_readers: list[Connection] = []
        self._checkpointer: _Checkpointer | None = None
        if checkpointer:
            self._checkpointer = _Checkpointer(
                self.path, self._write_lock, self.busy_timeout_ms, set_wal_limit=self._set_wal_limit
            )
            self._checkpointer.start()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[Connection]:
        """The one way to change the store: a ``BEGIN IMMEDIATE`` transaction on the
        writer connection that commits on success and rolls back on any exception.
        Nested calls join the outer transaction. Raises `StoreBusyError` if another
        process holds the write lock past busy_timeout."""
        with self._write_lock:
            if self._depth:
                self._depth += 1
                try:
                    yield self._writer
                finally:
                    self._depth -= 1
                return
            try:
                tx = self._writer.begin()
            except (exc.OperationalError, sqlite3.OperationalError) as e:  # BEGIN runs on sqlite3 (_on_begin)
                raise _typed(e, self.path, self.busy_timeout_ms) from e
            self._depth = 1
            try:
                yield self._writer
                tx.commit()
            except (exc.OperationalError, sqlite3.OperationalError) as e:
                # sqlite3's own error: from the hot-path statements (store/sqlite/prepared.py)
                tx.rollback()
                raise _typed(e, self.path, self.busy_timeout_ms) from e
            except BaseException:
                tx.rollback()
                raise
            finally:
                self._depth = 0

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        """The one way to read the store: a read transaction (``BEGIN DEFERRED``, no write
        lock) on a reader connection, never the writer. From its first statement on it
        sees one consistent state while writers in this process or another go on (WAL),
        and it never queues behind the write lock or makes a writer wait. Nested calls in
        one thread join the outer transaction. Reader connections are kept between calls (opening one and setting
        its pragmas costs more than a pump's read)."""
        held = getattr(self._local, "reader", None)
        if held is not None:
            yield held
            return
        conn = self._checkout_reader()
        self._local.reader = conn
        try:
            with conn.begin():
                yield conn
        finally:
            self._local.reader = None
            self._checkin_reader(conn)

    def _checkout_reader(self) -> Connection:
        with self._readers_lock:
            if self._idle_readers:
                return self._idle_readers.pop()
        return self.engine.connect().execution_options(sqlite_begin="DEFERRED")

    def _checkin_reader(self, conn: Connection) -> None:
        with self._readers_lock:
            if not self._closed and not conn.in_transaction():
                self._idle_readers.append(conn)
                return
        conn.close()

    def checkpoint(self, mode: str = "PASSIVE") -> tuple[int, int, int]:
        # On the raw DBAPI connection: through SQLAlchemy the PRAGMA would autobegin a
        # transaction (BEGIN IMMEDIATE) that stays open and breaks the next atomic().
        with self._write_lock:
            row = self._writer.connection.driver_connection.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        return tuple(row)  # (busy, wal frames, checkpointed frames)

    def _set_wal_limit(self, nbytes: int) -> None:
        """The size the writer truncates the WAL to when it next restarts it."""
        with self._write_lock:
            self._writer.connection.driver_connection.execute(f"PRAGMA journal_size_limit = {int(nbytes)}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._checkpointer:
            self._checkpointer.stop()
        with self._readers_lock:
            idle, self._idle_readers = self._idle_readers, []
        for conn in idle:
            conn.close()
        with self._write_lock:
            # Fold the WAL back so the file is whole on its own after a clean close.
            with contextlib.suppress(exc.OperationalError):
                self._writer.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            self._writer.close()
        self.engine.dispose()


def _typed(e: exc.OperationalError | sqlite3.OperationalError, path: Path, busy_timeout_ms: int) -> Exception:
    orig = getattr(e, "orig", None)
    msg = str(orig) if orig is not None else str(e)
    if "locked" in msg or "busy" in msg:
        return StoreBusyError(
            f"{path}: another writer held the store for more than {busy_timeout_ms} ms; "
            "is a second process running on the same run directory?"
        )
    return e


class _Checkpointer(threading.Thread):
    """Copies WAL frames into the main file in the background (PASSIVE: never waits for
    the writer or readers), so the writer never pays for a checkpoint.

    When the WAL holds more than `restart_bytes` of frames, a second pass runs holding
    the writer lock, so the checkpoint completes and the writer's next commit restarts
    (and truncates) the WAL. That pass only copies what arrived during the first, so the
    writer waits for a short copy, not for the whole WAL."""

    def __init__(
        self,
        path: Path,
        write_lock: threading.RLock,
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
        interval: float = CHECKPOINT_INTERVAL_S,
        restart_bytes: int = WAL_RESTART_BYTES,
        set_wal_limit=None,
    ):
        super().__init__(name=f"rolloutdb-checkpointer:{path.name}", daemon=True)
        self._path = path
        self._write_lock = write_lock
        self._busy_timeout_ms = busy_timeout_ms
        self._interval = interval
        self._restart_bytes = restart_bytes
        self._set_wal_limit = set_wal_limit
        self._wal_limit = JOURNAL_SIZE_LIMIT
        self._stop_event = threading.Event()
        self._conn: sqlite3.Connection | None = None  # this thread's, while open (for stop's interrupt)
        self._conn_lock = threading.Lock()  # no interrupt of a connection being closed

    def _pass(self, conn: sqlite3.Connection) -> tuple[int, int]:
        """One PASSIVE checkpoint; returns (frames in the WAL, frames checkpointed),
        (0, 0) if busy. Fewer checkpointed than held means a reader pins the rest."""
        try:
            _busy, log, done = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.OperationalError:
            return 0, 0
        return max(log, 0), max(done, 0)

    def _step_wal_limit(self) -> None:
        """Let the writer's next restart shrink the WAL file by at most one step."""
        if self._set_wal_limit is None:
            return
        try:
            size = os.path.getsize(f"{self._path}-wal")
        except OSError:
            return
        limit = max(JOURNAL_SIZE_LIMIT, size - WAL_SHRINK_STEP)
        if limit != self._wal_limit:
            with self._writer_held() as held, contextlib.suppress(sqlite3.Error):  # never let this thread die
                if held:
                    self._set_wal_limit(limit)
                    self._wal_limit = limit

    @contextlib.contextmanager
    def _writer_held(self) -> Iterator[bool]:
        """Holds the writer lock (yields True), or yields False once stop() was called
        first: close() may be called by a thread that holds the writer lock, and stop()
        waits for this thread."""
        while not self._write_lock.acquire(timeout=0.1):
            if self._stop_event.is_set():
                yield False
                return
        try:
            yield True
        finally:
            self._write_lock.release()

    def run(self) -> None:
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        self._conn = conn
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
            frame_bytes = conn.execute("PRAGMA page_size").fetchone()[0] + 24
            while not self._stop_event.wait(self._interval):
                self._step_wal_limit()
                log, done = self._pass(conn)
                # Holding the writer cannot let the WAL restart while a reader pins it.
                if log * frame_bytes <= self._restart_bytes or done < log:
                    continue
                for _ in range(CATCH_UP_PASSES):
                    before = done
                    log, done = self._pass(conn)
                    if done - before < CATCH_UP_FRAMES or self._stop_event.is_set():
                        break
                # A pass that "completes" still leaves the frames the writer committed
                # meanwhile, so the WAL restarts only if the writer is held for one pass.
                with self._writer_held() as held:
                    if held:
                        self._pass(conn)
        finally:
            with self._conn_lock:
                self._conn = None
                conn.close()

    def stop(self) -> None:
        """Returns once the thread's connection is closed. A pass in progress is
        interrupted (SQLite stops between pages; what it copied is valid with the WAL it
        leaves): no checkpoint may write the main file after `Database.close()` returns,
        or a copy of the file made then is torn. Until 2026-12-05 this joined for 5 s
        and went on; a pass of a large WAL on a slow disk can outlast that, and one
        "database disk image is malformed" was seen in a copy made right after a close."""
        self._stop_event.set()
        while self.is_alive():
            with self._conn_lock:
                if self._conn is not None:
                    self._conn.interrupt()  # a pass started after the last one is interrupted too
            self.join(timeout=0.05)
