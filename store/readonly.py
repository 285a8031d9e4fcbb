"""Opening store files for reading without changing anything on disk.

A WAL-mode file opened with ``mode=ro`` still gets ``-wal`` and ``-shm`` files created
beside it. When no ``-wal`` exists, no process has the file open in WAL mode (SQLite
deletes the WAL when the last connection closes), so we open it ``immutable=1``: no
locks, no side files. When a ``-wal`` exists a writer may be live, and we open ``mode=ro``
so that its committed WAL content is read too.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from urllib.parse import quote

from .errors import NotAStoreError, ReadOnlyViolation
from .revision import check_sqlite_file


def open_readonly(path: str | Path) -> sqlite3.Connection:
    """A read-only connection that leaves the file and its directory as they were.
    Refuses missing files, directories and non-SQLite files with a one-line error."""
    path = check_sqlite_file(path)
    uri = f"file:{quote(str(path.resolve()))}?mode=ro"
    if not Path(f"{path}-wal").exists():
        uri += "&immutable=1"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as e:
        conn.close()
        raise NotAStoreError(f"{path}: unreadable SQLite file ({e}); restore it from another snapshot") from e
    conn.set_authorizer(_deny_writes)
    return conn


_READ_ACTIONS = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
    sqlite3.SQLITE_PRAGMA,
    sqlite3.SQLITE_TRANSACTION,
}
# Pragmas that only read. Anything else (journal_mode = ..., writable_schema) is refused.
_READ_PRAGMAS = {
    "integrity_check", "quick_check", "table_info", "table_xinfo", "index_list", "index_info",
    "foreign_key_list", "foreign_key_check", "page_count", "page_size", "freelist_count",
    "user_version", "schema_version", "application_id", "database_list", "compile_options",
    "journal_mode", "encoding", "function_list", "table_list", "data_version",
}


def _deny_writes(action: int, arg1, arg2, _db, _trigger) -> int:  # noqa: ANN001
    if action in _READ_ACTIONS:
        if action == sqlite3.SQLITE_PRAGMA and (arg1 not in _READ_PRAGMAS or arg2 is not None):
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def run_readonly_query(conn: sqlite3.Connection, sql: str) -> tuple[list[str], list[tuple]]:
    """Run one statement that only reads; returns (column names, rows)."""
    sql = sql.strip().rstrip(";").strip()
    if not sql:
        raise ReadOnlyViolation("empty query; pass one SELECT statement with --sql")
    try:
        cur = conn.execute(sql)
    except sqlite3.DatabaseError as e:
        msg = str(e)
        if "not authorized" in msg or "readonly" in msg or "read-only" in msg:
            raise ReadOnlyViolation(f"refused: the statement would change the file; only reading queries are allowed ({msg})") from e
        if "one statement at a time" in msg:
            raise ReadOnlyViolation("pass exactly one SQL statement") from e
        raise ReadOnlyViolation(f"query failed: {msg}") from e
    columns = [d[0] for d in cur.description or []]
    return columns, cur.fetchall()
