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
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def capture_snapshot(
    live_path: str | Path,
    dst: str | Path,
    *,
    at_cut: Callable[[sqlite3.Connection], Any] | None = None,
    into_copy: Callable[[sqlite3.Connection, Any], dict[str, int]] | None = None,
) -> Capture:
    """Copy the live store at `live_path` into the new file `dst` as of one read cut.

    `at_cut(conn)` runs inside the read transaction, before the copy, and sees exactly
    the state being copied; an exception from it aborts the capture (nothing is left at
    `dst`). Its return value is kept in `Capture.check_result`.

    `into_copy(out, check_result)` runs on the copy, in one transaction after it is
    taken, and returns the rows it added per table: what belongs to the cut but lives
    outside the store (an environment server's export, the running calls' prefixes) goes
    into the snapshot's own file this way, never beside it.
    """
    dst = Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst}: capture target exists; captures never overwrite")
    t0 = time.perf_counter()
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
        with contextlib.closing(sqlite3.connect(dst, isolation_level=None)) as out:
            out.execute("PRAGMA synchronous = OFF")  # publication fsyncs the file
            src.backup(out, pages=-1)
            t_copied = time.perf_counter()
            if into_copy is not None:
                out.execute("BEGIN")
                added = into_copy(out, check)
                out.execute("COMMIT")
                for table, n in (added or {}).items():
                    counts[table] = counts.get(table, 0) + n
            t_vacuum = time.perf_counter()
            vacuumed = _drop_free_pages(out)
            out.execute("PRAGMA journal_mode = DELETE")
        src.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(Exception):
            src.execute("ROLLBACK")
        dst.unlink(missing_ok=True)
        raise
    finally:
        src.close()
    return Capture(
        path=dst,
        revision=revision,
        mutation_counter=counter,
        cut_time=cut_time,
        row_counts=counts,
        group_states=states,
        check_result=check,
        timings={
            "begin": t_cut - t0,
            "check": t_checked - t_cut,
            "copy": t_copied - t_checked,
            **({"vacuum": time.perf_counter() - t_vacuum} if vacuumed else {}),
            "total": time.perf_counter() - t0,
        },
    )
