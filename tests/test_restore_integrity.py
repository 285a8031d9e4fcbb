"""Restore runs PRAGMA integrity_check itself: a snapshot file whose bytes are damaged
in a way only integrity_check sees (an index entry no longer matching its row: every
read through the table still works, nothing says "malformed") is refused, even with its
manifest re-sealed so that every checksum matches.

The mutation run (tests/mutation/run_mutations.py) showed that the restore tests passed
with integrity_check skipped: their damage was also caught later, as "malformed", by the
first query that read it.
"""

from __future__ import annotations

import sqlite3

from rolloutdb.store.checkpoints.manifest import describe_files, read_manifest
from rolloutdb.store.errors import SnapshotDamaged
from test_restore import assert_refused_and_unchanged, build_ledger_run


def _damage_one_index_key(db, index: str, old: bytes, new: bytes) -> None:
    """Change `old` to `new` inside one key of `index`'s root page, bytes on disk."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (index,)).fetchone()
    conn.close()
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big") or 65536
    start = (root - 1) * page
    at = data.find(old, start, start + page)
    assert at >= 0, f"{old!r} not on the root page of {index}"
    data[at: at + len(new)] = new
    db.write_bytes(bytes(data))


def test_an_index_that_disagrees_with_its_table_is_refused_by_integrity_check(tmp_path):
    run = build_ledger_run(tmp_path)
    db = run.snap / "rollout_state.sqlite"
    # (B and E are dispatched at the cut; trained groups are settled ranges, no rows.)
    _damage_one_index_key(db, "ix_prompt_groups_state", b"dispatched", b"dispatchee")
    # Every table still reads: the damage is invisible to ordinary queries.
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT count(*) FROM prompt_groups NOT INDEXED WHERE state = 'dispatched'").fetchone()[0] == 2
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] != "ok"
    conn.close()
    manifest = read_manifest(run.snap)  # re-sealed: every checksum matches the damaged bytes
    manifest.files = describe_files(run.snap)
    (run.snap / "manifest.json").write_bytes(manifest.to_json())
    err = assert_refused_and_unchanged(run, SnapshotDamaged, "integrity_check failed")
    assert "ix_prompt_groups_state" in str(err) or "index" in str(err)
