"""Manifest format 2 (BLAKE3) is what publication writes; format 1 (sha256, as rolloutdb
wrote before W2-G) stays readable, verifiable and restorable. Real snapshots published
through store/checkpoints/publish.py; checksums recomputed here with hashlib/blake3
directly, never through the code under test; `verify` and `snapshots` run through the CLI.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import blake3
import pytest

from hostile import run_cli
from rolloutdb.store import Store
from rolloutdb.store.errors import SnapshotDamaged
from test_restore import assert_refused_and_unchanged, build_ledger_run, restore, snapshot, tree_digest

SNAPSHOT_DB = "rollout_state.sqlite"


def _manifest(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def _as_format_1(directory: Path) -> None:
    """Rewrite a published manifest as format 1, the way rolloutdb wrote it before W2-G:
    no `hash` field, each entry {path, size, sha256}."""
    m = _manifest(directory)
    assert m.pop("hash") == "blake3"
    m["format_version"] = 1
    m["files"] = [{"path": f["path"], "size": f["size"],
                   "sha256": hashlib.sha256((directory / f["path"]).read_bytes()).hexdigest()} for f in m["files"]]
    (directory / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _rows(db: Path, sql: str) -> list[tuple]:
    conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


GROUPS = "SELECT group_id, sample_seq, prompt_id FROM prompt_groups ORDER BY group_id"


def test_a_new_snapshot_is_format_2_with_a_blake3_digest_per_file_and_verifies_and_restores(tmp_path):
    run = build_ledger_run(tmp_path)
    m = _manifest(run.snap)
    assert (m["format_version"], m["hash"]) == (2, "blake3")
    for f in m["files"]:
        data = (run.snap / f["path"]).read_bytes()
        assert set(f) == {"path", "size", "blake3"}
        assert (f["size"], f["blake3"]) == (len(data), blake3.blake3(data).hexdigest())
    assert _manifest(run.ckpt / "step_1")["hash"] == "blake3"  # trainer checkpoints too
    assert run_cli("verify", run.snap).code == 0
    assert run_cli("verify", run.ckpt).code == 0
    groups = _rows(run.snap / SNAPSHOT_DB, GROUPS)
    restore(run.snap, run.live)
    assert _rows(run.live, GROUPS) == groups and len(groups) == 5  # 8 handed out, 3 settled (ranges)


@pytest.mark.parametrize("name", [SNAPSHOT_DB, "config.yaml"])
def test_a_byte_flipped_in_a_format_2_file_is_caught_by_verify_and_restore_naming_the_file(tmp_path, name):
    run = build_ledger_run(tmp_path)
    _flip_a_byte(run.snap / name)
    result = run_cli("verify", run.snap)
    assert result.code == 1
    assert f"{run.snap / name}: blake3 differs from the manifest" in result.err, result.err
    assert_refused_and_unchanged(run, SnapshotDamaged, f"{name}: blake3 differs")


def test_a_format_1_snapshot_and_checkpoints_still_verify_list_and_restore(tmp_path):
    run = build_ledger_run(tmp_path)
    for directory in (run.snap, run.ckpt / "step_1"):
        _as_format_1(directory)
    assert "hash" not in _manifest(run.snap) and "sha256" in _manifest(run.snap)["files"][0]
    assert run_cli("verify", run.snap).code == 0
    assert run_cli("verify", run.ckpt).code == 0
    listed = run_cli("snapshots", run.ckpt, "--json")
    rows = json.loads(listed.out)
    assert listed.code == 0 and len(rows) == 2 and all(r["complete"] for r in rows)
    assert run_cli("inspect", run.snap / SNAPSHOT_DB).code == 0
    groups = _rows(run.snap / SNAPSHOT_DB, GROUPS)
    restore(run.snap, run.live)
    assert _rows(run.live, GROUPS) == groups


def test_publishing_beside_format_1_checkpoints_writes_format_2_and_keeps_both_verifiable(tmp_path):
    run = build_ledger_run(tmp_path)
    for directory in (run.snap, run.ckpt / "step_1"):
        _as_format_1(directory)
    store = Store.open(run.live)
    try:
        second = snapshot(run.pub, store, "step_1")  # scans and applies retention over format 1
    finally:
        store.close()
    assert second.name == "snapshot_2" and _manifest(second)["hash"] == "blake3"
    assert _manifest(run.snap)["format_version"] == 1
    assert run_cli("verify", run.ckpt).code == 0


def test_a_byte_flipped_in_a_format_1_file_is_caught_naming_sha256(tmp_path):
    run = build_ledger_run(tmp_path)
    _as_format_1(run.snap)
    _flip_a_byte(run.snap / SNAPSHOT_DB)
    result = run_cli("verify", run.snap)
    assert result.code == 1 and f"{run.snap / SNAPSHOT_DB}: sha256 differs from the manifest" in result.err
    before = tree_digest(run.snap)
    with pytest.raises(SnapshotDamaged, match=f"{SNAPSHOT_DB}: sha256 differs"):
        restore(run.snap, run.live)
    assert tree_digest(run.snap) == before
