"""What a trace file holds, for `rolloutdb inspect`: its revision, the processes that wrote
to it (the `runs` table) and its rows per table. Read through the caller's read-only
connection; nothing is upgraded (an older revision is summarised as it is)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from ..sqlite.revision import file_revision, trace_head_revision, trace_known_revisions

_RUN_COLUMNS = ("run", "run_id", "pid", "host", "first_t", "last_t", "last_seq")


def trace_summary(conn: sqlite3.Connection, path: str | Path | None = None) -> dict[str, Any] | None:
    """The trace file's summary, or None when `conn` is no trace (no trace_* revision).
    `path` names the file in a refusal (a mislabelled alembic_version)."""
    revision = file_revision(conn, path)
    if revision is None or not revision.startswith("trace_"):
        return None
    known = trace_known_revisions()
    status = "head" if revision == known[-1] else "old" if revision in known else "newer"
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
              if not r[0].startswith("sqlite_") and r[0] != "alembic_version"]
    runs = []
    if "runs" in tables and status != "newer":
        # `runs` has had these columns since trace_v1_1_a; a trace_v1_0_a file has no `runs`.
        runs = [dict(zip(_RUN_COLUMNS, row)) for row in
                conn.execute(f"SELECT {', '.join(_RUN_COLUMNS)} FROM runs ORDER BY run")]
    return {
        "kind": "trace",
        "revision": revision,
        "revision_status": status,
        "head_revision": trace_head_revision(),
        "runs": runs,
        "row_counts": {t: conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables},
    }
