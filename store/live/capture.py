"""Consistent snapshot files of the live store, taken while the pumps keep writing.

The cut is a *read* transaction: under WAL it sees one committed state and never blocks
the writer. Inside it the caller checks whatever must hold at the cut (the trainer has
not moved, the environment's export matches the ledger), and the backup API copies the
database as of that same read mark in one step (``pages=-1``). Measured on these
machines: a file copy taken inside a read transaction was stale or corrupt 2 times in 5
(it misses the WAL), and a stepped backup restarts after every foreign commit, so it
never finished under load.

The snapshot file is switched to rollback-journal mode so it stands alone: one file,
readable with ``mode=ro`` without creating ``-wal``/``-shm`` beside it.

Given the previous snapshot's file (`base`) on a file system that clones (XFS with
reflink, btrfs), the new file starts as a clone of it and only the blocks that differ
are written: the copy is taken into memory, and its image compared with the base's.
The snapshot is still one standalone SQLite file, and a snapshot writes the metadata
that changed since the last one, not the whole file (1.3% of its pages per interval in
bench/bench_snapshot_segments.py). Where the clone fails (ext4) the copy goes straight
to the file, as before.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fsio import clone_file, remove_sqlite_file, write_changed_blocks
from ..sqlite.revision import file_revision
from .schema import STATE_TABLES


@dataclass
class Capture:
    """What a capture saw at its cut."""

    path: Path
    revision: str
    mutation_counter: int
    cut_time: float
    row_counts: dict[str, int]
    group_states: dict[str, int]
    check_result: Any = None
    timings: dict[str, float] = field(default_factory=dict)
    # Prefix level: the wall-clock time the running calls the cut saved were read at (its
    # decode point, before `cut_time`), set by the caller that read them; None otherwise.
    decoded_at: float | None = None
    # Written as a clone of the previous snapshot's file: (blocks written, blocks of the
    # file); None when the file was written whole.
    incremental: tuple[int, int] | None = None


def count_rows(conn: sqlite3.Connection) -> tuple[dict[str, int], dict[str, int]]:
    """Rows per state table and ledger groups per state, over an open connection."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    counts = {t: conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in STATE_TABLES if t in tables}
    states = dict(conn.execute("SELECT state, count(*) FROM prompt_groups GROUP BY state ORDER BY state").fetchall()) if "prompt_groups" in tables else {}
    return counts, states


# A copy whose free pages exceed this share of its pages (and FREE_PAGES_MIN pages) is
# vacuumed before it is published.
FREE_SHARE = 0.25
FREE_PAGES_MIN = 256


def _drop_free_pages(out: sqlite3.Connection) -> bool:
    """VACUUM the copy when most of it is free pages, so a snapshot does not publish
    (fsync, hash, keep) the space its payload left. Sealing (store/live/payload.py)
    moves a snapshot interval's inline payload into a segment, and the backup API copies
    the live file page for page, free pages too: without this every snapshot would carry
    the last interval's payload again as free pages. Costs a rewrite of what is live in
    the copy (the metadata: rows and references), never of the payload in flight. No
    journal: the copy is a temporary file until published (a crash leaves a leftover)."""
    (free,) = out.execute("PRAGMA freelist_count").fetchone()
    (pages,) = out.execute("PRAGMA page_count").fetchone()
    if free < FREE_PAGES_MIN or free < FREE_SHARE * pages:
        return False
    out.execute("PRAGMA journal_mode = OFF")
    out.execute("VACUUM")
    return True


# The cloned path holds the copy in memory twice (SQLite's pages and their serialized
# image): a live store larger than this (payload left inline, never sealed) is written
# whole. A sealed store's file is its metadata: 9.3 MiB at 10k groups x 8 in flight.
# Measured on the main file alone: the -wal file's size is the most it ever grew (it is
# reused, and cut back only to journal_size_limit, 64 MiB; 100-200 MiB while a capture
# pins it), not the database's size. Counting it sent a 13 MiB store's capture down the
# whole path now and then on XFS (a WAL of 76-119 MiB, once past 243).
INCREMENTAL_MAX_BYTES = 256 * 2**20


def _write_stamp(fd: int) -> tuple[int, ...]:
    """What a write to the file changes: its size, mtime and ctime."""
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _clone_of(base: Path, dst: Path, clone: Callable[[int, int], bool]) -> tuple[int, int, tuple] | None:
    """(base's descriptor, the new file `dst`'s, the base's `_write_stamp` before the
    clone) with `dst` a clone of `base`; None, and no `dst`, when `base` is gone
    (retention removed it) or the file system cannot clone."""
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    dst_fd = -1
    try:
        dst_fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        stamp = _write_stamp(base_fd)
        if clone(base_fd, dst_fd):
            return base_fd, dst_fd, stamp
    except BaseException:
        _close(base_fd, dst_fd)
        if dst_fd >= 0:
            dst.unlink(missing_ok=True)
        raise
    _close(base_fd, dst_fd)
    dst.unlink()
    return None


def _close(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def _complete(out: sqlite3.Connection, into_copy, check: Any, counts: dict[str, int]) -> dict[str, float]:
    """On the copy's file: what `into_copy` adds, the free pages dropped, and the switch to
    rollback-journal mode (the file stands alone); the vacuum's timing when it ran."""
    out.execute("PRAGMA synchronous = OFF")  # publication fsyncs the file
    if into_copy is not None:
        out.execute("BEGIN")
        added = into_copy(out, check)
        out.execute("COMMIT")
        for table, n in (added or {}).items():
            counts[table] = counts.get(table, 0) + n
    t_vacuum = time.perf_counter()
    vacuumed = _drop_free_pages(out)
    t_done = time.perf_counter()
    out.execute("PRAGMA journal_mode = DELETE")
    return {"vacuum": t_done - t_vacuum} if vacuumed else {}


def capture_snapshot(
    live_path: str | Path,
    dst: str | Path,
    *,
    at_cut: Callable[[sqlite3.Connection], Any] | None = None,
    into_copy: Callable[[sqlite3.Connection, Any], dict[str, int]] | None = None,
    base: str | Path | None = None,
    clone: Callable[[int, int], bool] = clone_file,
) -> Capture:
    """Copy the live store at `live_path` into the new file `dst` as of one read cut.

    `at_cut(conn)` runs inside the read transaction, before the copy, and sees exactly
    the state being copied; an exception from it aborts the capture (nothing is left at
    `dst`). Its return value is kept in `Capture.check_result`.

    `into_copy(out, check_result)` runs on the copy, in one transaction after it is
    taken, and returns the rows it added per table: what belongs to the cut but lives
    outside the store (an environment server's export, the running calls' prefixes) goes
    into the snapshot's own file this way, never beside it.

    `base`: the previous snapshot's file (`Publisher.snapshot_base()`). Where `clone`
    (FICLONE) can clone it beside `dst`, `dst` starts as that clone and only the blocks
    that differ are written (`Capture.incremental`); otherwise it is written whole.
    """
    dst = Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst}: capture target exists; captures never overwrite")
    t0 = time.perf_counter()
    small = base is not None and os.stat(live_path).st_size <= INCREMENTAL_MAX_BYTES
    cloned_from = _clone_of(Path(base), dst, clone) if small else None
    fds, stamp = (cloned_from[:2], cloned_from[2]) if cloned_from is not None else (None, None)
    t_cloned = time.perf_counter()
    cloned = {"clone": t_cloned - t0} if fds is not None else {}
    incremental = None
    src = sqlite3.connect(live_path, isolation_level=None, check_same_thread=False)
    try:
        src.execute("PRAGMA busy_timeout = 5000")
        src.execute("BEGIN")
        # The first read takes the WAL read mark: this is the cut.
        counter = src.execute("SELECT mutation_counter FROM run_meta").fetchone()[0]
        cut_time = time.time()
        t_cut = time.perf_counter()
        check = at_cut(src) if at_cut is not None else None
        revision = file_revision(src)
        counts, states = count_rows(src)
        t_checked = time.perf_counter()
        if fds is None:
            with contextlib.closing(sqlite3.connect(dst, isolation_level=None)) as out:
                out.execute("PRAGMA synchronous = OFF")  # publication fsyncs the file
                src.backup(out, pages=-1)
                parts = {"copy": time.perf_counter() - t_checked}
                src.execute("COMMIT")
                parts.update(_complete(out, into_copy, check, counts))
        else:
            # Into memory, then the blocks that differ into the clone. memdb, not
            # ":memory:": its pages are one buffer, so its image is one copy (serialize
            # 0.7 vs 8.5 ms for 4.7 MiB; ":memory:" reads them through the pager).
            with contextlib.closing(sqlite3.connect("file:rolloutdb-capture?vfs=memdb", uri=True,
                                                    isolation_level=None)) as mem:
                src.backup(mem, pages=-1)
                image = mem.serialize()
            src.execute("COMMIT")
            t_write = time.perf_counter()
            written = write_changed_blocks(fds[1], image, fds[0], path=dst)
            if _write_stamp(fds[0]) != stamp:
                # The base was written to after the clone (a published snapshot is never
                # changed by us; a user's sqlite3 might): blocks compared equal to its
                # new bytes may differ from the clone's, so the copy is written whole.
                written = write_changed_blocks(fds[1], image, -1, path=dst)
            parts = {"copy": t_write - t_checked, "write": time.perf_counter() - t_write}
            incremental = (written, -(-len(image) // 4096))
            _close(*fds)
            fds = None
            with contextlib.closing(sqlite3.connect(dst, isolation_level=None)) as out:
                parts.update(_complete(out, into_copy, check, counts))
    except BaseException:
        with contextlib.suppress(Exception):
            src.execute("ROLLBACK")
        remove_sqlite_file(dst)  # a cloned file opened by SQLite may have a -wal beside it
        raise
    finally:
        src.close()
        if fds is not None:
            _close(*fds)
    return Capture(
        path=dst,
        revision=revision,
        mutation_counter=counter,
        cut_time=cut_time,
        row_counts=counts,
        group_states=states,
        check_result=check,
        timings={**cloned, "begin": t_cut - t_cloned, "check": t_checked - t_cut, **parts,
                 "total": time.perf_counter() - t0},
        incremental=incremental,
    )
