"""Connections, pragmas and the one way to open a transaction.

Every write is one short transaction begun explicitly with ``BEGIN IMMEDIATE``. pysqlite
otherwise delays ``BEGIN`` until the first write, so two read-then-write transactions
could interleave and one of them would fail late with SQLITE_BUSY; taking the write lock
up front makes a transaction a clean *mutation cut*. We follow the recipe of SQLAlchemy's
SQLite dialect: turn off pysqlite's own transaction handling (``isolation_level=None``)
and emit ``BEGIN`` from the engine's ``begin`` event.

The store has one writer connection, shared by the pumps under a lock (SQLite admits
one writer at a time anyway, and a long-lived connection skips a pool checkout per
transaction). Readers (snapshot capture, inspection) use their own connections; under
WAL they see one consistent state while the writer goes on.

The writer never checkpoints the WAL itself (``wal_autocheckpoint=0``): measured here, the
writer's own auto-checkpoint right after a large snapshot stalled it 150-200 ms. A
background thread runs PASSIVE checkpoints instead, which never wait for the writer.
Under a writer that never pauses, though, a PASSIVE checkpoint never *completes* (frames
keep arriving while it copies), the WAL is never restarted and grows without bound
(measured: 220 MB in 2 s). So when the WAL holds more than a threshold of frames, the
checkpointer runs one more PASSIVE pass holding the writer lock: it only copies the frames written since
its previous pass, the checkpoint completes, and the writer's next commit restarts the
WAL from its start and truncates it to ``journal_size_limit``.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event, exc, text
from sqlalchemy.pool import NullPool

from .errors import NotAStoreError, StoreBusyError

BUSY_TIMEOUT_MS = 5000
JOURNAL_SIZE_LIMIT = 64 * 1024 * 1024  # without it the WAL file never shrinks
CHECKPOINT_INTERVAL_S = 0.25
# Past this WAL size the checkpointer briefly holds the writer to let the WAL restart.
WAL_RESTART_BYTES = JOURNAL_SIZE_LIMIT // 2


def _apply_pragmas(dbapi_conn: sqlite3.Connection, *, synchronous: str, writer: bool, busy_timeout_ms: int) -> None:
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    cur.execute("PRAGMA journal_mode = WAL")
    cur.execute(f"PRAGMA synchronous = {synchronous}")
    cur.execute("PRAGMA foreign_keys = ON")
    cur.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
    if writer:
        cur.execute("PRAGMA wal_autocheckpoint = 0")
    cur.close()


def make_engine(
    path: str | Path, *, synchronous: str = "NORMAL", writer: bool = True, busy_timeout_ms: int = BUSY_TIMEOUT_MS
) -> Engine:
    """An engine whose connections carry the store's pragmas and explicit BEGIN.

    ``conn.execution_options(sqlite_begin="DEFERRED")`` makes a read transaction;
    the default is ``IMMEDIATE``.
    """
    engine = create_engine(
        f"sqlite:///{Path(path)}",
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
        conn.exec_driver_sql(f"BEGIN {mode}")

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
        self._checkpointer: _Checkpointer | None = None
        if checkpointer:
            self._checkpointer = _Checkpointer(self.path, self._write_lock, self.busy_timeout_ms)
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
            except exc.OperationalError as e:
                raise _typed(e, self.path, self.busy_timeout_ms) from e
            self._depth = 1
            try:
                yield self._writer
                tx.commit()
            except exc.OperationalError as e:
                tx.rollback()
                raise _typed(e, self.path, self.busy_timeout_ms) from e
            except BaseException:
                tx.rollback()
                raise
            finally:
                self._depth = 0

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        """A read transaction on a fresh connection: one consistent state of the store
        while the writer goes on (WAL). Used for snapshot cuts and inspection."""
        with self.engine.connect().execution_options(sqlite_begin="DEFERRED") as conn:
            with conn.begin():
                # A deferred BEGIN takes its read mark at the first read; make it now.
                conn.execute(text("SELECT count(*) FROM sqlite_master")).scalar()
                yield conn

    def checkpoint(self, mode: str = "PASSIVE") -> tuple[int, int, int]:
        # On the raw DBAPI connection: through SQLAlchemy the PRAGMA would autobegin a
        # transaction (BEGIN IMMEDIATE) that stays open and breaks the next atomic().
        with self._write_lock:
            row = self._writer.connection.driver_connection.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        return tuple(row)  # (busy, wal frames, checkpointed frames)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._checkpointer:
            self._checkpointer.stop()
        with self._write_lock:
            # Fold the WAL back so the file is whole on its own after a clean close.
            with contextlib.suppress(exc.OperationalError):
                self._writer.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            self._writer.close()
        self.engine.dispose()


def _typed(e: exc.OperationalError, path: Path, busy_timeout_ms: int) -> Exception:
    msg = str(e.orig) if e.orig is not None else str(e)
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
    ):
        super().__init__(name=f"rolloutdb-checkpointer:{path.name}", daemon=True)
        self._path = path
        self._write_lock = write_lock
        self._busy_timeout_ms = busy_timeout_ms
        self._interval = interval
        self._restart_bytes = restart_bytes
        self._stop_event = threading.Event()

    def _pass(self, conn: sqlite3.Connection) -> int:
        """One PASSIVE checkpoint; returns how many frames the WAL holds (0 if busy)."""
        try:
            _busy, log, _done = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.OperationalError:
            return 0
        return max(log, 0)

    def run(self) -> None:
        conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
            frame_bytes = conn.execute("PRAGMA page_size").fetchone()[0] + 24
            while not self._stop_event.wait(self._interval):
                # A pass that "completes" still leaves the frames the writer committed
                # meanwhile, so the WAL restarts only if the writer is held for one pass.
                if self._pass(conn) * frame_bytes > self._restart_bytes:
                    with self._write_lock:
                        self._pass(conn)
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)
