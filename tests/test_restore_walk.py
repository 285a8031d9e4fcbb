"""The resume walk reads each thing once and passes it down: the snapshot's manifest (the
listing's), its store file's revision and its segment list. Measured by
bench/trace_resume_walk.py (a traced `select_and_restore` of a real small run: two anchors,
two snapshots with sealed payload segments), whose numbers these tests hold; and the
manifest handed to `restore_snapshot` is the one every file is checked against.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from rolloutdb.store.checkpoints.manifest import read_manifest
from rolloutdb.store.errors import SnapshotDamaged
from rolloutdb.store.restore.apply import restore_snapshot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_restore import RUN, build_ledger_run  # noqa: E402

TOOL = Path(__file__).resolve().parents[1] / "bench" / "trace_resume_walk.py"


def _tool():
    spec = importlib.util.spec_from_file_location("trace_resume_walk", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_resume_reads_the_manifest_revision_and_segment_list_of_its_snapshot_once():
    numbers = _tool().measure()
    assert numbers["manifest reads (the restored snapshot)"] == 1
    assert numbers["manifest reads (all directories)"] == 4  # the listing: two anchors, two snapshots
    assert numbers["revision look-ups by restore (sqlite/revision.py, identity.py)"] == 1
    assert numbers["snapshot file revision reads"] == 1
    assert numbers["segment list reads"] == 1
    assert numbers["segments.py importing where segments live from live/payload.py"] == 0


def test_a_resume_past_a_damaged_snapshot_reads_the_one_it_restores_once_per_listing_and_check():
    numbers = _tool().measure(damaged_newest=True)
    assert numbers["manifest reads (the restored snapshot)"] == 2  # two listings: the first choice, the fallback
    assert numbers["manifest reads (all directories)"] == 8
    # verify reads the chosen snapshot's file, restore its copy: once each
    assert numbers["revision look-ups by restore (sqlite/revision.py, identity.py)"] == 2
    assert numbers["snapshot file revision reads"] == 2
    assert numbers["segment list reads"] == 2


def test_a_restore_handed_the_listings_manifest_checks_every_file_against_it_and_reads_no_other(tmp_path,
                                                                                               second_connection):
    run = build_ledger_run(tmp_path)
    listed = read_manifest(run.snap)
    (run.snap / "manifest.json").write_text(json.dumps({"kind": "not a manifest"}))
    with pytest.raises(SnapshotDamaged, match="manifest"):  # read from disk: refused
        restore_snapshot(run.snap, run.live, **RUN, groups_per_step=2)
    plan = restore_snapshot(run.snap, run.live, **RUN, groups_per_step=2, manifest=listed)
    assert plan.sequence == listed.sequence and plan.anchor == "step_1"
    conn = second_connection(run.live)
    assert conn.execute("SELECT state FROM prompt_groups WHERE group_id = ?", (run.A,)).fetchone()[0] == "published"


def test_a_restore_handed_a_manifest_that_does_not_match_the_files_refuses_them(tmp_path):
    run = build_ledger_run(tmp_path)
    listed = read_manifest(run.snap)
    listed.files = [f if f.path != "config.yaml" else type(f)(f.path, f.size, "0" * 64) for f in listed.files]
    with pytest.raises(SnapshotDamaged, match="config.yaml"):  # the manifest on disk would have passed it
        restore_snapshot(run.snap, run.live, **RUN, groups_per_step=2, manifest=listed)
