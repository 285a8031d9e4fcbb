"""The rollout trace: an append-only SQLite file of timestamped events.

The controller calls ``tracer.emit("attempt_dispatched", prompt_id=..., ...)`` from any
thread. `emit` only stamps the wall time, checks the event against `EVENTS` and puts one
tuple on a queue; a writer thread commits what it finds there in one transaction every
`FLUSH_INTERVAL_S` (or every `MAX_BATCH` events), so a process killed with SIGKILL loses
at most the events of the last few milliseconds and never leaves a torn file (WAL).

Layout (revision trace_v1_1_a): one table per event type, named after the event, with one
typed column per field (``group_reserved(seq, t, run, group_id, prompt_id, step, ...)``),
so that an analysis reads only the events and fields it needs, in SQLite's own types.
``seq`` numbers the events of the file across all tables. Each process is a *run*: a row
of ``runs`` (its ``run_id``, new for each process, and the first and last ``t`` and last
``seq`` of its events, kept up to date in the same transaction as every batch), referred
to by the small integer ``run``. List-valued fields are rows of their own so that SQL can
join and sum them (`LIST_TABLES`). The view ``events`` shows every event in one table with
the columns of trace_v1_0_a (run_id, event name, the common columns, other fields as
JSON), for reading by eye. Rows match across runs by (prompt_id, generation_index).
docs/trace.md describes every event and field.

The file is created by running the trace's own Alembic migrations
(``rolloutdb/migrations/trace``); the events, their fields and the tables that hold them
are defined in `events.py`. With tracing off the controller gets a `NullTracer`, whose
`emit` does nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from ..errors import StoreError
from ..fsio import write_file_atomic
from ..sqlite.database import Database
from ..sqlite.integrity import check_sqlite_file
from ..sqlite.revision import file_revision, run_trace_migrations, trace_head_revision, trace_known_revisions
from .events import EVENT_FIELDS, EVENTS, FIELD_TYPES, LIST_TABLES, event_columns

log = logging.getLogger("rolloutdb.trace")

TRACE_FILENAME = "rollout_trace.sqlite"
FLUSH_INTERVAL_S = 0.005  # the most a SIGKILL can lose, plus one commit
MAX_BATCH = 2000


class TraceError(StoreError):
    """A trace file or directory that cannot be used; the message says what to do."""


# --------------------------------------------------------------------------- files


def trace_file_for(run_or_log_dir: str | Path) -> Path:
    """The trace file of a run directory (RUN_DIR/logs/rollout_trace.sqlite) or of its
    log directory. Raises `TraceError` with what to do when there is none."""
    d = Path(run_or_log_dir)
    if not d.exists():
        raise TraceError(f"{d}: no such directory; pass a run directory or its logs/ directory")
    if d.is_file():
        raise TraceError(f"{d}: is a file; pass the run directory that holds logs/{TRACE_FILENAME}")
    for candidate in (d / "logs" / TRACE_FILENAME, d / TRACE_FILENAME):
        if candidate.is_file():
            return candidate
    raise TraceError(
        f"{d}: no trace file (looked for logs/{TRACE_FILENAME}); "
        "run with trace.enabled: true to record one"
    )


def open_trace_file(path: str | Path) -> Path:
    """Create the trace file by running its migrations, or bring an existing one to head.
    Refuses a file that is not a trace or was written by a newer rolloutdb."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)

        def build(tmp: Path) -> None:
            run_trace_migrations(tmp)
            with contextlib.closing(sqlite3.connect(tmp)) as conn:
                conn.execute("PRAGMA journal_mode = WAL")

        return write_file_atomic(path, build, tag="create")
    try:
        check_sqlite_file(path)
    except StoreError as e:
        raise TraceError(str(e)) from e
    with contextlib.closing(sqlite3.connect(path)) as conn:
        revision = file_revision(conn)
    head = trace_head_revision()
    known = trace_known_revisions()
    if revision == head:
        return path
    if revision is None or not revision.startswith("trace_"):
        raise TraceError(f"{path}: not a rolloutdb trace file; move it aside or point the run at another log directory")
    if revision not in known:
        raise TraceError(f"{path}: trace revision {revision} is newer than this rolloutdb knows (head {head}); upgrade rolloutdb")
    # Older: the log is ours, migrate it in place. Said on stderr because a revision that
    # rebuilds indexes (trace_v1_6_a) takes seconds on a trace of millions of events, and
    # the run would otherwise sit silent at its start.
    log.warning("trace: upgrading %s (%.0f MiB) from %s to %s, once", path, path.stat().st_size / 2**20, revision, head)
    run_trace_migrations(path)
    return path


# --------------------------------------------------------------------------- writers


class NullTracer:
    """What the controller holds when tracing is off: every call does nothing."""

    enabled = False
    run_id = None
    path = None

    def emit(self, event: str, /, **fields) -> None:  # noqa: ARG002
        return None

    def flush(self, timeout: float | None = None) -> bool:  # noqa: ARG002
        return True

    def close(self) -> None:
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Flush:
    """A marker put on the queue: set once everything before it is committed."""

    __slots__ = ("done",)

    def __init__(self):
        self.done = threading.Event()


_STOP = object()


def _insert_sql(table: str, columns: tuple[str, ...]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


# Event -> its INSERT; (event, list field) -> the INSERT of its rows.
_INSERT_EVENT = {name: _insert_sql(name, ("seq", "t", "run", *event_columns(name))) for name in EVENT_FIELDS}
_INSERT_LIST = {key: _insert_sql(table, ("seq", *cols)) for key, (table, cols) in LIST_TABLES.items()}
_LIST_FIELDS = {name: tuple(f for (e, f) in LIST_TABLES if e == name) for name in EVENT_FIELDS}


def _encode(field: str, value):
    """One field value in its column's type. Plain ints and floats: sqlite3 cannot bind
    numpy scalars, and one bad value would cost the whole batch."""
    if value is None:
        return None
    kind = FIELD_TYPES[field]
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "json":
        return json.dumps(value, separators=(",", ":"), default=_json_default)
    return str(value)


def _encode_list(event: str, field: str, value) -> tuple[tuple, ...]:
    if not value:
        return ()
    if LIST_TABLES[(event, field)][1] == ("group_id",):
        return tuple((int(g),) for g in value)
    return tuple((int(v), int(n)) for v, n in value.items())


class Tracer:
    """Appends events to a trace file from any thread; see the module docstring.

    ``emit(event, t=None, **fields)``: `t` defaults to ``clock()`` (``time.time()``) at
    the call; pass it only to replay recorded events or to build a trace by hand. Unknown events or fields raise ValueError at the
    call site, so a typo fails in tests instead of vanishing from the trace.
    """

    enabled = True

    def __init__(
        self,
        path: str | Path,
        *,
        flush_interval: float = FLUSH_INTERVAL_S,
        max_batch: int = MAX_BATCH,
        clock: Callable[[], float] = time.time,
    ):
        self.path = open_trace_file(path)
        self._clock = clock
        self.run_id = uuid.uuid4().hex
        self.dropped = 0  # events lost to a failed commit or emitted after close
        self._flush_interval = flush_interval
        self._max_batch = max_batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._run_row: int | None = None  # this process's row in `runs`, once committed
        self._close_lock = threading.Lock()
        self._db = Database(self.path, synchronous="NORMAL")
        self._thread = threading.Thread(target=self._run, name=f"rolloutdb-trace:{self.run_id[:8]}", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        self.emit("run_started", pid=os.getpid(), host=socket.gethostname())

    # ---- the caller's side: cheap, thread-safe
    def emit(self, event: str, /, *, t: float | None = None, **fields) -> None:
        allowed = EVENTS.get(event)
        if allowed is None:
            raise ValueError(f"unknown trace event {event!r}; known: {', '.join(sorted(EVENTS))}")
        extra = fields.keys() - allowed
        if extra:
            raise ValueError(f"trace event {event!r} has no field(s) {sorted(extra)}; it takes {sorted(allowed)}")
        if self._closed:
            self.dropped += 1
            return
        # Encoded here, not in the writer: the caller may change its dicts after emit.
        self._queue.put((
            event,
            self._clock() if t is None else float(t),
            tuple(_encode(f, fields.get(f)) for f in event_columns(event)),
            tuple((f, _encode_list(event, f, fields.get(f))) for f in _LIST_FIELDS[event] if fields.get(f)),
        ))

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Block until every event emitted before this call is committed."""
        if self._closed:
            return True
        marker = _Flush()
        self._queue.put(marker)
        return marker.done.wait(timeout)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        self._queue.put(_STOP)
        self._thread.join(timeout=30)
        self._db.close()
        # Leave a closed trace in rollback-journal mode: a read-only reader of a WAL file
        # (DuckDB's sqlite scanner) would create -wal/-shm files beside it and leave them.
        # The next Tracer switches back to WAL; a killed run keeps WAL and its side files.
        with contextlib.suppress(sqlite3.Error), contextlib.closing(sqlite3.connect(self.path, timeout=0.5)) as conn:
            conn.execute("PRAGMA journal_mode = DELETE")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the writer thread
    def _run(self) -> None:
        stop = False
        while not stop:
            batch, markers = [], []
            item = self._queue.get()
            deadline = time.monotonic() + self._flush_interval
            while True:
                if item is _STOP:
                    stop = True
                    break
                if isinstance(item, _Flush):
                    markers.append(item)
                    break  # commit now: someone is waiting
                batch.append(item)
                if len(batch) >= self._max_batch:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = self._queue.get(timeout=remaining)
                except queue.Empty:
                    break
            if batch:
                self._commit(batch)
            for m in markers:
                m.done.set()
        # Whatever was emitted before close() but queued behind the stop marker.
        rest = []
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._queue.get_nowait()
                if isinstance(item, _Flush):
                    item.done.set()
                elif item is not _STOP:
                    rest.append(item)
        if rest:
            self._commit(rest)

    def _commit(self, batch: list[tuple]) -> None:
        try:
            with self._db.atomic() as conn:
                # Inside BEGIN IMMEDIATE: no other writer can take the same numbers.
                base = conn.exec_driver_sql("SELECT coalesce(max(last_seq), 0) FROM runs").scalar()
                first_t, last_t = min(item[1] for item in batch), max(item[1] for item in batch)
                if self._run_row is None:
                    run = conn.exec_driver_sql("SELECT coalesce(max(run), 0) + 1 FROM runs").scalar()
                    conn.exec_driver_sql(
                        "INSERT INTO runs (run, run_id, pid, host, first_t, last_t, last_seq) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (run, self.run_id, os.getpid(), socket.gethostname(), first_t, last_t, base + len(batch)),
                    )
                else:
                    run = self._run_row
                    conn.exec_driver_sql(
                        "UPDATE runs SET first_t = min(first_t, ?), last_t = max(last_t, ?), last_seq = ? WHERE run = ?",
                        (first_t, last_t, base + len(batch), run),
                    )
                rows: dict[str, list[tuple]] = {}
                list_rows: dict[tuple[str, str], list[tuple]] = {}
                for seq, (name, t, values, lists) in enumerate(batch, start=base + 1):
                    rows.setdefault(name, []).append((seq, t, run, *values))
                    for field, items in lists:
                        list_rows.setdefault((name, field), []).extend((seq, *item) for item in items)
                for name, event_rows in rows.items():
                    conn.exec_driver_sql(_INSERT_EVENT[name], event_rows)
                for key, items in list_rows.items():
                    conn.exec_driver_sql(_INSERT_LIST[key], items)
            self._run_row = run  # only once its row is committed
        except Exception as e:  # noqa: BLE001 - tracing must never stop the run
            self.dropped += len(batch)
            log.warning("trace: %d events not written to %s: %s", len(batch), self.path, e)


def _json_default(value):
    # numpy scalars and the like: anything with item() becomes its Python value.
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"trace field value {value!r} is not JSON-serialisable")


def open_tracer(log_dir: str | Path | None, *, enabled: bool = True) -> Tracer | NullTracer:
    """The controller's entry point: a `Tracer` on LOG_DIR/rollout_trace.sqlite, or a
    `NullTracer` when tracing is off (or there is no log directory)."""
    if not enabled or log_dir is None:
        return NullTracer()
    return Tracer(Path(log_dir) / TRACE_FILENAME)
