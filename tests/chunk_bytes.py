"""Tests read a snapshot's prefix chunks by hand, with sqlite3 and numpy, not through the
code under test. Since revision v1_8_a a chunk's bytes are inline or a row of the segment
its `token_chunks` row names (CHECKPOINT_DIR/payload_segments/); `inline_copy` makes a
copy of a snapshot's store file with every chunk's bytes put back inline, so the tests'
own SQL over `token_chunks.token_ids` / `logprobs` reads them either way (and the copy
survives retention removing the segments later)."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import tempfile
from pathlib import Path


def segments_of(snapshot_db: Path) -> Path:
    """CHECKPOINT_DIR/payload_segments/ of CHECKPOINT_DIR/<anchor>/rollout_snapshots/snapshot_<n>/<db>."""
    return Path(snapshot_db).parents[3] / "payload_segments"


def inline_copy(snapshot_db: Path, out: Path | None = None, segments: Path | None = None) -> Path:
    """A copy of `snapshot_db` (at `out`, else a new temporary file) whose chunks hold
    their bytes inline (a chunk without logprobs: NULL, as an inline one)."""
    snapshot_db = Path(snapshot_db)
    out = Path(out) if out is not None else Path(tempfile.mkdtemp()) / snapshot_db.name
    shutil.copyfile(snapshot_db, out)
    segments = segments or segments_of(snapshot_db)
    with contextlib.closing(sqlite3.connect(out)) as conn:
        if "segment_id" not in {r[1] for r in conn.execute("PRAGMA table_info(token_chunks)")}:
            return out  # before v1_8_a: inline already
        refs = conn.execute("SELECT c.chunk_id, p.file_name, c.segment_row FROM token_chunks c "
                            "JOIN payload_segments p ON p.segment_id = c.segment_id").fetchall()
        for chunk_id, name, row in refs:
            with contextlib.closing(sqlite3.connect(f"file:{segments / name}?mode=ro&immutable=1", uri=True)) as seg:
                tokens, logprobs = seg.execute("SELECT token_ids, logprobs FROM payload WHERE sample_id = ?",
                                               (row,)).fetchone()
            conn.execute("UPDATE token_chunks SET token_ids = ?, logprobs = ?, segment_id = NULL, segment_row = NULL "
                         "WHERE chunk_id = ?", (tokens, logprobs or None, chunk_id))
        conn.commit()
    return out
