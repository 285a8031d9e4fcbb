"""The one integrity check of a SQLite file, and the cheap checks before any open.

`check_sqlite_file` refuses what is not a readable SQLite file from its header, before
SQLite opens it. `integrity_problems` runs ``PRAGMA integrity_check`` (or the cheaper
``quick_check``: page structure, not index contents) and returns what it found; every
caller (upgrade, `inspect`, `verify`, restore) says it in its own words. What they cost:
both read the whole file; a restore overlaps the check with its copy
(`restore/copying.py`), and `inspect` uses ``quick_check``, skippable with --no-check.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ..errors import NotAStoreError
from ..fsio import refuse_special_file

SQLITE_MAGIC = b"SQLite format 3\x00"
# SQLite prefixes the problems of a multi-database check with this marker line.
_MARKER = "*** in database main ***"


def check_sqlite_file(path: str | Path) -> Path:
    """Refuse anything that is not an existing, readable SQLite file."""
    path = Path(path)
    refuse_special_file(path, NotAStoreError)  # FIFOs, devices, sockets: refused before any open
    if not path.exists():
        raise NotAStoreError(f"{path}: no such file; pass the path of a store or snapshot file")
    if path.is_dir():
        raise NotAStoreError(f"{path}: is a directory; pass a .sqlite file inside it")
    with open(path, "rb") as f:
        header = f.read(100)
    if len(header) < 100 or not header.startswith(SQLITE_MAGIC):
        raise NotAStoreError(f"{path}: not a SQLite database (bad header); is this the right file?")
    page_size = int.from_bytes(header[16:18], "big") or 65536
    pages = int.from_bytes(header[28:32], "big")
    wal = Path(f"{path}-wal")
    # With a non-empty WAL beside it (a live store, or one killed mid-checkpoint) the
    # file may legitimately be shorter than its header says: the WAL holds the rest.
    live_wal = wal.exists() and wal.stat().st_size > 0
    if not live_wal and path.stat().st_size < page_size * pages:
        raise NotAStoreError(
            f"{path}: truncated ({path.stat().st_size} bytes, header says {page_size * pages}); "
            "restore it from another snapshot"
        )
    return path


def integrity_problems(conn: sqlite3.Connection, limit: int = 3, *, quick: bool = False,
                       errors_as_problems: bool = False) -> list[str]:
    """The problems ``PRAGMA integrity_check(limit)`` finds (``quick_check`` with `quick`),
    at most `limit`; an empty list when the file is sound. A file SQLite cannot read at
    all raises `sqlite3.DatabaseError`, or with `errors_as_problems` is one problem: the
    error's text."""
    pragma = "quick_check" if quick else "integrity_check"
    try:
        rows = [r[0] for r in conn.execute(f"PRAGMA {pragma}({int(limit)})").fetchall()]
    except sqlite3.DatabaseError as e:
        if not errors_as_problems:
            raise
        return [str(e)]
    return [] if rows == ["ok"] else rows


def first_problem(problems: list[str]) -> str:
    """The first problem on one line, without SQLite's database marker."""
    return " ".join(problems[0].replace(_MARKER, "").split())


def quick_check(conn: sqlite3.Connection, path: str | Path) -> None:
    """Refuse a damaged file (``PRAGMA quick_check``: page structure, not index contents)
    with one line naming the first problem."""
    problems = integrity_problems(conn, 3, quick=True, errors_as_problems=True)
    if problems:
        raise NotAStoreError(f"{path}: damaged ({first_problem(problems)}); run `rolloutdb verify {path}` "
                             "or restore another snapshot")
