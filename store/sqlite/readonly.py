"""Opening store files for reading without changing anything on disk: no byte and no
mtime of the file, its ``-wal`` or its ``-shm`` changes, and no side file is created.

A WAL-mode file opened with ``mode=ro`` gets ``-wal`` and ``-shm`` created beside it, and
a ``mode=ro`` connection writes into an existing ``-shm`` (its read marks, a rebuilt
index), so we never open a file that has a WAL beside it in place:

- no ``-wal``: no process has the file open in WAL mode (SQLite deletes the WAL when the
  last connection closes), so everything committed is in the main file. We open it
  ``immutable=1``: no locks, no side files, whatever the journal mode in its header.
- a ``-wal`` (a live writer, or one that was killed): we read a private copy of the file
  and its WAL in a temporary directory, removed when the connection closes. The copy is
  made consistent without touching the live files (`private_copy`). Its cost is one
  sequential copy of the file (measured: 0.06 s for a 100 MB file and a 4 MB WAL,
  page-cached, same file system), paid only when a WAL is there; `inspect` and `verify`
  then read the whole file anyway (quick_check, integrity_check), so the copy at most
  doubles their I/O, and a reader in place would rewrite a live run's -shm.
- a published snapshot file (a ``manifest.json`` beside it lists it) never has a WAL: a
  stray ``-wal`` beside one is ignored (the file is read as published, ``immutable``) and
  one line on stderr says so.

Every connection refuses writes twice over: ``PRAGMA query_only`` and an authorizer that
admits only reading actions (so even ``VACUUM INTO`` another file is refused).
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from ..errors import NotAStoreError, ReadOnlyViolation, StoreError
from ..fsio import make_work_dir, work_dir_name
from .integrity import check_sqlite_file

WAL_HEADER = 32
COPY_ATTEMPTS = 20
# The file beside a published snapshot's or checkpoint's files that lists them
# (`checkpoints.manifest` writes it); named here so that opening and upgrading a file
# can leave a published one alone without importing the checkpoints layer.
MANIFEST_NAME = "manifest.json"


class PrivateCopyConnection(sqlite3.Connection):
    """A connection on a copy in a temporary directory, removed when it closes."""

    tmpdir: str | Path | None = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.tmpdir:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
                self.tmpdir = None


def _uri(path: Path, **params: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return f"file:{quote(str(path.resolve()))}?{query}"


def listing_manifest(path: str | Path) -> Path | None:
    """The ``manifest.json`` beside `path` that lists it (a published snapshot or
    checkpoint file), or None. A manifest beside it that cannot be read counts as
    listing it: when in doubt, the file is treated as published and left alone."""
    path = Path(path)
    manifest = path.parent / MANIFEST_NAME
    if not manifest.is_file():
        return None
    try:
        files = json.loads(manifest.read_bytes()).get("files")
        names = {f.get("path") for f in files if isinstance(f, dict)}
    except (OSError, ValueError, AttributeError, TypeError):
        return manifest
    return manifest if path.name in names else None


def open_readonly(path: str | Path) -> sqlite3.Connection:
    """A read-only connection that leaves the file and its directory as they were.
    Refuses missing files, directories and non-SQLite files with a one-line error."""
    path = check_sqlite_file(path)
    wal = Path(f"{path}-wal")
    published = listing_manifest(path) if wal.exists() else None
    if published is not None:
        print(f"warning: {wal}: ignored: {path} is a published snapshot file ({published} lists it) and a "
              "published file never has a WAL; read as published", file=sys.stderr)
    if not wal.exists() or published is not None:
        conn = sqlite3.connect(_uri(path, mode="ro", immutable="1"), uri=True, isolation_level=None)
    else:
        conn = _open_private_copy(path)
    try:
        conn.execute("PRAGMA query_only = ON")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as e:
        conn.close()
        raise NotAStoreError(f"{path}: unreadable SQLite file ({e}); restore it from another snapshot") from e
    conn.set_authorizer(_deny_writes)
    return conn


def _wal_header(wal: Path) -> bytes | None:
    try:
        with open(wal, "rb") as f:
            return f.read(WAL_HEADER)
    except FileNotFoundError:
        return None


def private_copy(path: Path, directory: Path, name: str = "store.sqlite") -> Path:
    """Copy `path` and its ``-wal`` (if any) into `directory` as one consistent pair,
    without opening either through SQLite. A live writer only appends frames to its WAL
    (a torn last frame is discarded by SQLite's recovery, by checksum) and its
    checkpoints copy frames into the main file; we copy the main file first, then the
    WAL, so every page a checkpoint wrote meanwhile is also in the copied WAL. Only a WAL
    *restart* (after a full checkpoint the writer starts again at frame 1, with new salts
    in the WAL header) could pair an old main file with a new WAL: the header is read
    before and after, and the copy is taken again if it changed."""
    copy = directory / name
    wal = Path(f"{path}-wal")
    for _ in range(COPY_ATTEMPTS):
        header = _wal_header(wal)
        shutil.copyfile(path, copy)
        if header is None:  # no WAL: the main file is everything
            return copy
        try:
            shutil.copyfile(wal, f"{copy}-wal")
        except FileNotFoundError:  # the last connection closed and folded the WAL away
            Path(f"{copy}-wal").unlink(missing_ok=True)
            continue
        if _wal_header(wal) == header:
            return copy
        time.sleep(0.01)
    raise NotAStoreError(f"{path}: its WAL was restarted during every one of {COPY_ATTEMPTS} attempts to read it; "
                         "retry, or stop the writer first")


def _open_private_copy(path: Path) -> sqlite3.Connection:
    tmpdir = work_dir_name("rolloutdb-inspect-")  # held before it is made: see there
    try:
        copy = private_copy(path, make_work_dir(tmpdir))
        conn = sqlite3.connect(copy, isolation_level=None, factory=PrivateCopyConnection)
        conn.tmpdir = tmpdir
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return conn


_READ_ACTIONS = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
    sqlite3.SQLITE_PRAGMA,
    sqlite3.SQLITE_TRANSACTION,  # BEGIN/COMMIT of a read transaction
}
# Pragmas that only read, with or without an argument naming a table or index
# (table_info(x), also as the table-valued pragma_table_info('x')).
_READ_PRAGMAS_WITH_ARG = {
    "table_info", "table_xinfo", "index_list", "index_info", "index_xinfo", "foreign_key_list",
    "foreign_key_check", "integrity_check", "quick_check",
}
# Pragmas that read without an argument and *set* something with one (user_version = 3).
_READ_PRAGMAS_BARE = {
    "page_count", "page_size", "freelist_count", "user_version", "schema_version", "application_id",
    "database_list", "compile_options", "journal_mode", "encoding", "function_list", "table_list",
    "data_version", "collation_list", "module_list", "pragma_list", "foreign_keys", "auto_vacuum",
}


# SQL functions that only compute from their arguments (or read the connection's own
# counters) and change nothing: an allow-list, so a function this list has not judged
# (an extension's, a newer SQLite's) is refused rather than trusted. Left out on purpose:
# load_extension (runs code), fts3_tokenizer (its 2-argument form installs a pointer as a
# tokenizer), sqlite_log (writes to the error log), and the FTS/R-tree internals
# (fts5, rtreenode, ..., never needed on a store, which has no such tables).
SAFE_FUNCTIONS = frozenset("""
    -> ->> abs avg changes char coalesce concat concat_ws count cume_dist current_date current_time
    current_timestamp date datetime dense_rank first_value format glob group_concat hex ifnull if iif
    instr julianday lag last_insert_rowid last_value lead length like likelihood likely lower ltrim
    max min nth_value ntile nullif octet_length percent_rank printf quote random randomblob rank
    replace round row_number rtrim sign soundex sqlite_compileoption_get sqlite_compileoption_used
    sqlite_source_id sqlite_version strftime string_agg substr substring subtype sum time timediff
    total total_changes trim typeof unhex unicode unistr unixepoch unlikely upper zeroblob
    acos acosh asin asinh atan atan2 atanh ceil ceiling cos cosh degrees exp floor ln log log10 log2
    mod pi pow power radians sin sinh sqrt tan tanh trunc
    json json_array json_array_length json_error_position json_extract json_group_array
    json_group_object json_insert json_object json_patch json_pretty json_quote json_remove
    json_replace json_set json_type json_valid json_each json_tree jsonb jsonb_array jsonb_extract
    jsonb_group_array jsonb_group_object jsonb_insert jsonb_object jsonb_patch jsonb_remove
    jsonb_replace jsonb_set
""".split())


def _deny_writes(action: int, arg1, arg2, _db, _trigger) -> int:  # noqa: ANN001
    if action == sqlite3.SQLITE_FUNCTION:
        return sqlite3.SQLITE_OK if (arg2 or "").lower() in SAFE_FUNCTIONS else sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_UPDATE and arg1 == "sqlite_master":
        # SQLite asks this while it declares a table-valued pragma (pragma_table_info);
        # a real UPDATE of the schema table is refused anyway ("may not be modified"
        # without writable_schema, which is refused below, and query_only is on).
        return sqlite3.SQLITE_OK
    if action not in _READ_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_PRAGMA:
        name = (arg1 or "").lower()
        if name in _READ_PRAGMAS_WITH_ARG or (name in _READ_PRAGMAS_BARE and arg2 is None):
            return sqlite3.SQLITE_OK
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


class QueryTimeout(StoreError):
    """A user's query ran past its time limit and was stopped."""


DEFAULT_QUERY_TIMEOUT_S = 30.0
# How often (in SQLite VM instructions) the progress handler runs: each call is a point
# where Python runs pending signal handlers and the deadline is checked. 10,000
# instructions take well under a millisecond, and the check costs ~1% of a long scan.
_PROGRESS_EVERY = 10_000


def run_readonly_query(conn: sqlite3.Connection, sql: str, timeout_s: float = DEFAULT_QUERY_TIMEOUT_S, *,
                       stop: Callable[[], int | None] | None = None) -> tuple[list[str], list[tuple]]:
    """Run one statement that only reads; returns (column names, rows). Anything that
    would write, attach, call a function not in `SAFE_FUNCTIONS`, or run more than one
    statement raises `ReadOnlyViolation`; running past `timeout_s` raises `QueryTimeout`.

    SIGINT and SIGTERM stop the query (SQLite's VM does not return to Python on its own,
    so without this a runaway recursive query ignores Ctrl-C); the signal is then raised
    again under the handler that was in place, so the caller's cleanup runs (the
    connection's close removes a private copy) and the process ends as the signal says.
    `stop()`: a stop signal the caller received before the query (or None), whose own
    exception may have been lost (rolloutdb/commands/_stop_signals.py): the query does not start,
    or stops, as if that signal had arrived during it."""
    sql = sql.strip().rstrip(";").strip()
    if not sql:
        raise ReadOnlyViolation("empty query; pass one SELECT statement with --sql")
    deadline = time.monotonic() + timeout_s
    caught: list[int] = []
    earlier = stop or (lambda: None)

    def on_signal(signum, _frame):  # noqa: ANN001
        caught.append(signum)
        conn.interrupt()

    def progress() -> int:
        if not caught and (signum := earlier()) is not None:
            caught.append(signum)
        return 1 if caught or time.monotonic() > deadline else 0

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    conn.set_progress_handler(progress, _PROGRESS_EVERY)
    try:
        if progress():  # stopped before it started
            raise sqlite3.OperationalError("interrupted")
        cur = conn.execute(sql)
        columns = [d[0] for d in cur.description or []]
        rows = cur.fetchall()
    except sqlite3.Warning as e:  # "You can only execute one statement at a time."
        raise ReadOnlyViolation("pass exactly one SQL statement (found more than one)") from e
    except sqlite3.DatabaseError as e:
        msg = " ".join(str(e).split())
        if caught or "interrupted" in msg:
            if not caught:
                raise QueryTimeout(f"query stopped after {timeout_s:g} s, its time limit") from None
        elif "one statement at a time" in msg:
            raise ReadOnlyViolation("pass exactly one SQL statement (found more than one)") from e
        elif "to use function" in msg:
            raise ReadOnlyViolation(
                f"refused: {msg}; only functions that read (SQLite's core, math, date and JSON functions) are allowed"
            ) from e
        elif any(w in msg for w in ("not authorized", "authorization denied", "readonly", "read-only",
                                    "may not be modified")):
            raise ReadOnlyViolation(
                f"refused: the statement would change a file or the connection ({msg}); only reading queries are allowed"
            ) from e
        else:
            raise ReadOnlyViolation(f"query failed: {msg}") from e
    finally:
        conn.set_progress_handler(None, 0)
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    if caught:
        signal.raise_signal(caught[0])  # under the caller's handler, now restored
        raise KeyboardInterrupt  # the caller's handler ignored it: stop anyway
    return columns, rows
