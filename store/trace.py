"""The rollout trace: an append-only SQLite file of timestamped events.

The controller calls ``tracer.emit("attempt_dispatched", prompt_id=..., ...)`` from any
thread. `emit` only stamps the wall time, checks the event against `EVENTS` and puts one
tuple on a queue; a writer thread commits what it finds there in one transaction every
`FLUSH_INTERVAL_S` (or every `MAX_BATCH` events), so a process killed with SIGKILL loses
at most the events of the last few milliseconds and never leaves a torn file (WAL).

Each process gets a new ``run_id``; a resumed run appends to the same file, and rows
match across runs by (prompt_id, generation_index). The fields every analysis joins on
are real columns of ``events``; the rest are one JSON object in ``events.fields``. Two
list-valued fields are rows of their own so that SQL can join and sum them:
``version_token_counts`` ({policy version: tokens}) goes to ``version_tokens`` and
``group_ids`` goes to ``event_groups``. docs/trace.md describes every event and field.

The file is created by running the trace's own Alembic migrations
(``rolloutdb/migrations/trace``); `trace_metadata` below is the schema at head and a test
compares the two. With tracing off the controller gets a `NullTracer`, whose `emit` does
nothing.
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

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import (
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
)
from sqlalchemy.pool import NullPool

from .db import Database
from .errors import StoreError
from .fsio import replace_file, temp_path_beside
from .revision import check_sqlite_file, file_revision
from .schema import NAMING

log = logging.getLogger("rolloutdb.trace")

TRACE_FILENAME = "rollout_trace.sqlite"
FLUSH_INTERVAL_S = 0.005  # the most a SIGKILL can lose, plus one commit
MAX_BATCH = 2000

# Columns every analysis joins on; any event may carry them.
COMMON_FIELDS = ("prompt_id", "generation_index", "group_id", "attempt", "step", "policy_version", "reason")
_ATTEMPT = ("group_id", "prompt_id", "generation_index", "attempt", "step", "policy_version")
_GROUP = ("group_id", "prompt_id", "step", "policy_version")

# Event name -> the fields it may carry (common columns and JSON fields alike).
# docs/trace.md says what each one means; tests check the two agree.
EVENTS: dict[str, frozenset[str]] = {
    name: frozenset(fields)
    for name, fields in {
        "run_started": ("pid", "host"),
        "group_reserved": _GROUP + ("epoch", "group_size"),
        "attempt_dispatched": _ATTEMPT + ("prefix_tokens",),
        "call_cut": _ATTEMPT + ("tokens",),
        "attempt_abandoned": _ATTEMPT + ("reason", "tokens"),
        "rollout_finished": _ATTEMPT + ("tokens", "reward", "finish_reason", "version_token_counts"),
        "group_sealed": _GROUP + ("generations",),
        "group_published": _GROUP + ("version_token_counts", "tokens"),
        "group_discarded": _GROUP + ("reason",),
        "refit": ("step", "policy_version", "old_version", "new_version", "running"),
        "train_step": ("step", "policy_version", "group_ids", "batch_age", "tokens"),
        "snapshot_cut": ("step", "policy_version", "cut_time", "snapshot_seq", "anchor", "snapshot", "groups_in_flight"),
        "restore_done": ("step", "policy_version", "cut_time", "snapshot_seq", "anchor", "snapshot", "groups_restored", "replay_restored"),
    }.items()
}

ABANDON_REASONS = ("restart", "deadline", "error")


class TraceError(StoreError):
    """A trace file or directory that cannot be used; the message says what to do."""


# --------------------------------------------------------------------------- schema

trace_metadata = MetaData(naming_convention=NAMING)

events = Table(
    "events",
    trace_metadata,
    # Assigned by the writer inside its transaction, so child rows can refer to it.
    Column("seq", Integer, primary_key=True, autoincrement=False),
    Column("t", Float, nullable=False),  # wall time, seconds since the epoch
    Column("run_id", String(36), nullable=False),  # new for each process
    Column("event", String(32), nullable=False),
    Column("prompt_id", Integer),
    Column("generation_index", Integer),
    Column("group_id", Integer),
    Column("attempt", Integer),
    Column("step", Integer),
    Column("policy_version", Integer),
    Column("reason", String(32)),
    Column("fields", Text),  # JSON object of the event's other fields, or NULL
    Index("ix_events_event", "event"),
    Index("ix_events_prompt_id_generation_index", "prompt_id", "generation_index"),
    Index("ix_events_group_id", "group_id"),
)

version_tokens = Table(
    "version_tokens",
    trace_metadata,
    Column("seq", Integer, ForeignKey("events.seq"), primary_key=True),
    Column("policy_version", Integer, primary_key=True),
    Column("tokens", Integer, nullable=False),
)

event_groups = Table(
    "event_groups",
    trace_metadata,
    Column("seq", Integer, ForeignKey("events.seq"), primary_key=True),
    Column("group_id", Integer, primary_key=True),
)

# --------------------------------------------------------------------------- files


def trace_alembic_config() -> Config:
    import rolloutdb.migrations.trace as trace_migrations

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(trace_migrations.__file__).parent))
    return cfg


def trace_head_revision() -> str:
    return ScriptDirectory.from_config(trace_alembic_config()).get_current_head()


def run_trace_migrations(path: str | Path, target: str = "head") -> None:
    """Run the trace migrations on `path` in place (a new file or one we own)."""
    cfg = trace_alembic_config()
    engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _fk_off(dbapi_conn, _record):  # noqa: ANN001
        dbapi_conn.execute("PRAGMA foreign_keys = OFF")  # batch mode copies tables

    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, target)
    finally:
        engine.dispose()


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
        "run with rollout_checkpointing.trace: true to record one"
    )


def open_trace_file(path: str | Path) -> Path:
    """Create the trace file by running its migrations, or bring an existing one to head.
    Refuses a file that is not a trace or was written by a newer rolloutdb."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path_beside(path, "create")
        try:
            run_trace_migrations(tmp)
            with contextlib.closing(sqlite3.connect(tmp)) as conn:
                conn.execute("PRAGMA journal_mode = WAL")
            replace_file(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path
    try:
        check_sqlite_file(path)
    except StoreError as e:
        raise TraceError(str(e)) from e
    with contextlib.closing(sqlite3.connect(path)) as conn:
        revision = file_revision(conn)
    head = trace_head_revision()
    known = [s.revision for s in ScriptDirectory.from_config(trace_alembic_config()).walk_revisions()]
    if revision == head:
        return path
    if revision is None or not revision.startswith("trace_"):
        raise TraceError(f"{path}: not a rolloutdb trace file; move it aside or point the run at another log directory")
    if revision not in known:
        raise TraceError(f"{path}: trace revision {revision} is newer than this rolloutdb knows (head {head}); upgrade rolloutdb")
    run_trace_migrations(path)  # older: the log is ours, migrate it in place
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

_INSERT_EVENT = (
    "INSERT INTO events (seq, t, run_id, event, prompt_id, generation_index, group_id, attempt, "
    "step, policy_version, reason, fields) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_INSERT_VERSIONS = "INSERT INTO version_tokens (seq, policy_version, tokens) VALUES (?, ?, ?)"
_INSERT_GROUPS = "INSERT INTO event_groups (seq, group_id) VALUES (?, ?)"


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
        # Plain ints: sqlite3 cannot bind numpy integers, and one bad value would cost
        # the whole batch.
        common = [_int_or_none(fields.pop(name, None)) for name in COMMON_FIELDS[:-1]]
        reason = fields.pop("reason", None)
        common.append(None if reason is None else str(reason))
        versions = fields.pop("version_token_counts", None)
        groups = fields.pop("group_ids", None)
        # Encoded here, not in the writer: the caller may change its dicts after emit.
        self._queue.put((
            self._clock() if t is None else float(t),
            event,
            *common,
            json.dumps(fields, separators=(",", ":"), default=_json_default) if fields else None,
            tuple((int(v), int(n)) for v, n in versions.items()) if versions else None,
            tuple(int(g) for g in groups) if groups else None,
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
                base = conn.exec_driver_sql("SELECT coalesce(max(seq), 0) FROM events").scalar()
                rows, version_rows, group_rows = [], [], []
                for i, (t, name, *common, fields, versions, groups) in enumerate(batch, start=base + 1):
                    rows.append((i, t, self.run_id, name, *common, fields))
                    if versions:
                        version_rows.extend((i, v, n) for v, n in versions)
                    if groups:
                        group_rows.extend((i, g) for g in groups)
                conn.exec_driver_sql(_INSERT_EVENT, rows)
                if version_rows:
                    conn.exec_driver_sql(_INSERT_VERSIONS, version_rows)
                if group_rows:
                    conn.exec_driver_sql(_INSERT_GROUPS, group_rows)
        except Exception as e:  # noqa: BLE001 - tracing must never stop the run
            self.dropped += len(batch)
            log.warning("trace: %d events not written to %s: %s", len(batch), self.path, e)


def _int_or_none(value) -> int | None:
    return None if value is None else int(value)


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
