"""`rolloutdb snapshots` and `rolloutdb verify`, run as real subprocesses on real and
damaged checkpoint directories and store files. Read-only: every test that damages
something checks that the command left every byte as it found it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES
from rolloutdb.store import FinishedGeneration, Publisher, Reservation, Retention, Store
from rolloutdb.store.checkpoints.layout import SNAPSHOT_DB
from rolloutdb.store.checkpoints.retention import KeepNewestSnapshots


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutdb.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def tree_state(root: Path) -> dict[str, str]:
    """Every path under root with the sha256 of its bytes (directories as 'dir')."""
    state = {}
    paths = [root] if root.is_file() else sorted(root.rglob("*"))
    for p in paths:
        state[str(p)] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    if root.is_file():
        for side in ("-wal", "-shm", "-journal"):
            state[str(root) + side] = str(Path(str(root) + side).exists())
    return state


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """bootstrap with 2 snapshots, step_1 with 1, made through the real publisher."""
    base = tmp_path_factory.mktemp("ckpt")
    with Store.create(base / "live.sqlite", replay_capacity=8) as store:
        pub = Publisher(base / "ckpt", retention=Retention(KeepNewestSnapshots(10)))
        pub.publish_bootstrap()
        for seq in range(3):
            (gid,) = store.reserve([Reservation(seq, 0, seq)], num_generations=1, target_step=1)
            (a,) = store.dispatch([gid], policy_version=0)
            store.finish(a, FinishedGeneration([1, 2, 3], [-0.1] * 3, 1.0, [(0, 3)]))
            if seq == 2:
                pub.publish_trainer_checkpoint(1, lambda d: (d / "model.safetensors").write_bytes(b"w" * 5000))
            anchor = "step_1" if seq == 2 else "bootstrap"
            pub.publish_rollout_snapshot(anchor, lambda p: store.capture(p), "model: tiny\n", env_export=b"{}")
    return base / "ckpt"


@pytest.fixture
def ckpt(checkpoint, tmp_path) -> Path:
    """A private copy to damage."""
    return Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))


def _snapshot1(ckpt: Path) -> Path:
    return ckpt / "bootstrap" / "rollout_snapshots" / "snapshot_1"


# ---------------------------------------------------------------- snapshots


def test_snapshots_lists_one_row_per_anchor_and_snapshot(ckpt):
    r = cli("snapshots", ckpt)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["SEQ", "ANCHOR", "KIND", "AGE", "SIZE", "COUNTS", "STATUS"]
    assert set(lines[1]) == {"-", " "} and lines[-1] == "(5 rows)"  # the shared table format
    rows = [line.split()[:3] for line in lines[2:-1]]
    assert rows == [["-", "bootstrap", "trainer"], ["1", "bootstrap", "snapshot"], ["2", "bootstrap", "snapshot"],
                    ["-", "step_1", "trainer"], ["3", "step_1", "snapshot"]]
    assert all(line.rstrip().endswith("complete") for line in lines[2:-1])
    assert "groups=3" in lines[-2]


def test_snapshots_json_gives_counts_and_completeness_and_lists_leftovers_as_incomplete(ckpt):
    leftover = ckpt / "step_1" / "rollout_snapshots" / ".snapshot_4.publish.99.tmp"
    leftover.mkdir()
    before = tree_state(ckpt)
    r = cli("snapshots", ckpt, "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    snaps = [row for row in rows if row["kind"] == "rollout_snapshot"]
    assert [(s["sequence"], s["complete"]) for s in snaps] == [(1, True), (2, True), (3, True), (4, False)]
    assert snaps[-1]["status"].startswith("incomplete")
    assert snaps[2]["row_counts"]["prompt_groups"] == 3 and snaps[2]["size_bytes"] > 0
    assert tree_state(ckpt) == before  # listing removes nothing


def _run_dir_around(ckpt: Path, tmp_path: Path) -> Path:
    """A run directory (store, config.yaml) whose checkpoints/ is a copy of ckpt."""
    run = tmp_path / "run"
    shutil.copytree(ckpt, run / "checkpoints")
    Store.create(run / "rollout_state.sqlite", replay_capacity=8).close()
    (run / "config.yaml").write_text("algorithm:\n  groups_per_step: 1\n")
    return run


def test_snapshots_of_a_run_directory_lists_its_checkpoints_directory(ckpt, tmp_path):
    run = _run_dir_around(ckpt, tmp_path)
    from_run, from_ckpt = cli("snapshots", run, "--json"), cli("snapshots", run / "checkpoints", "--json")
    assert from_run.returncode == 0, from_run.stderr
    rows = json.loads(from_run.stdout)
    assert [(r["sequence"], r["anchor"]) for r in rows] == [(None, "bootstrap"), (1, "bootstrap"), (2, "bootstrap"),
                                                              (None, "step_1"), (3, "step_1")]
    assert [r["path"] for r in rows] == [r["path"] for r in json.loads(from_ckpt.stdout)]


def test_snapshots_of_a_run_directory_without_checkpoints_is_one_error_line(tmp_path):
    run = tmp_path / "run"
    Store.create(run / "rollout_state.sqlite", replay_capacity=8).close()
    (run / "config.yaml").write_text("algorithm:\n  groups_per_step: 1\n")
    r = cli("snapshots", run)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: ") and "checkpoints: no such directory" in r.stderr


def test_snapshots_json_shows_times_as_iso_8601_utc_and_ages_in_seconds_never_epoch_floats(ckpt):
    import re
    import time

    rows = json.loads(cli("snapshots", ckpt, "--json").stdout)
    iso = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3})?Z$")
    snaps = [r for r in rows if r["kind"] == "rollout_snapshot"]
    assert snaps and all(iso.match(r["cut_time"]) for r in snaps)
    assert all(iso.match(r["created_at"]) for r in rows)
    assert all(0 <= r["age_s"] < 3600 for r in rows)  # a relative age, not a point in time
    floats = [v for r in rows for v in r.values() if isinstance(v, float)]
    assert all(v < time.time() / 2 for v in floats), floats


def test_snapshots_of_a_missing_directory_is_one_error_line(tmp_path):
    r = cli("snapshots", tmp_path / "nope")
    assert r.returncode != 0
    assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith("error:")


# ---------------------------------------------------------------- verify: sound input


@pytest.mark.parametrize("which", ["checkpoint", "trainer", "snapshot", "file"])
def test_verify_passes_a_sound_checkpoint_directory_trainer_checkpoint_snapshot_and_file(ckpt, which):
    path = {"checkpoint": ckpt, "trainer": ckpt / "step_1", "snapshot": _snapshot1(ckpt),
            "file": _snapshot1(ckpt) / SNAPSHOT_DB}[which]
    before = tree_state(ckpt)
    r = cli("verify", path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].startswith("ok:") and r.stderr == ""
    assert tree_state(ckpt) == before


def test_verify_json_gives_ok_problems_notes_and_what_was_checked_with_the_same_exit_code(ckpt):
    r = cli("verify", ckpt, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["problems"] == [] and isinstance(doc["notes"], list)
    assert len(doc["checked"]) >= 5
    (_snapshot1(ckpt) / "config.yaml").unlink()
    r = cli("verify", ckpt, "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and any("config.yaml: missing" in p for p in doc["problems"])


def test_verify_json_of_a_run_directory_gives_the_verdict_counts(tmp_path):
    from test_verify_run_lost_work import build_run

    run = build_run(tmp_path, {1: "zero_reward_variance"})
    r = cli("verify", run, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["problems"] == []
    assert {k: doc[k] for k in ("trained", "discarded", "duplicated", "lost")} == {
        "trained": 4, "discarded": 1, "duplicated": 0, "lost": 0}


def test_verify_accepts_an_older_revision_and_says_so(tmp_path):
    old = tmp_path / "old.sqlite"
    shutil.copyfile(FIXTURES / "store_v1_0_a.sqlite", old)
    before = tree_state(old)
    r = cli("verify", old)
    assert r.returncode == 0, r.stderr
    assert "older than head" in r.stdout and "rolloutdb upgrade" in r.stdout
    assert tree_state(old) == before


# ---------------------------------------------------------------- verify: damaged directories


def _damage_delete_file(ckpt):
    (_snapshot1(ckpt) / "config.yaml").unlink()
    return "config.yaml: missing"


def _damage_modify_byte(ckpt):
    db = _snapshot1(ckpt) / SNAPSHOT_DB
    data = bytearray(db.read_bytes())
    data[len(data) // 2] ^= 0x01
    db.write_bytes(bytes(data))
    return "blake3 differs"


def _damage_manifest(ckpt, path):
    m = _snapshot1(ckpt) / "manifest.json"
    d = json.loads(m.read_text())
    d["files"][0]["path"] = path
    m.write_text(json.dumps(d))


def _damage_dotdot(ckpt):
    (ckpt / "bootstrap" / "rollout_snapshots" / "x").write_bytes(b"outside")
    _damage_manifest(ckpt, "../x")
    return "refuses path '../x'"


def _damage_absolute(ckpt):
    _damage_manifest(ckpt, "/etc/hostname")
    return "refuses absolute path '/etc/hostname'"


def _damage_missing_manifest(ckpt):
    (_snapshot1(ckpt) / "manifest.json").unlink()
    return "no manifest"


def _damage_trainer_file(ckpt):
    (ckpt / "step_1" / "model.safetensors").write_bytes(b"v" * 5000)
    return "model.safetensors: blake3 differs"


DAMAGE = {
    "deleted file": _damage_delete_file,
    "modified byte": _damage_modify_byte,
    "manifest with ../x": _damage_dotdot,
    "manifest with an absolute path": _damage_absolute,
    "missing manifest": _damage_missing_manifest,
    "modified trainer file": _damage_trainer_file,
}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("target", ["checkpoint", "snapshot"])
def test_verify_reports_each_damage_as_error_lines_and_changes_nothing(ckpt, damage, target):
    expected = DAMAGE[damage](ckpt)
    path = ckpt if target == "checkpoint" else (ckpt / "step_1" if "trainer" in damage else _snapshot1(ckpt))
    before = tree_state(ckpt)
    r = cli("verify", path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert lines and all(line.startswith("error: ") for line in lines)
    assert any(expected in line for line in lines), lines
    assert tree_state(ckpt) == before
    # The other snapshots are not blamed.
    assert not any("snapshot_2" in line or "snapshot_3" in line for line in lines)


def test_verify_of_a_file_checks_the_manifest_beside_it(ckpt):
    _damage_delete_file(ckpt)
    r = cli("verify", _snapshot1(ckpt) / SNAPSHOT_DB)
    assert r.returncode == 1 and "config.yaml: missing" in r.stderr


# ---------------------------------------------------------------- verify: bad single files


def _flip_a_bit_in_a_table_page(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'prompt_groups'").fetchone()[0]
    data = bytearray(path.read_bytes())
    data[(root - 1) * page_size] ^= 0x01  # the b-tree page type byte
    path.write_bytes(bytes(data))


def _newer_revision(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'v9_9_z'")


def _bad_file(kind: str, snapshot_file: Path, tmp_path: Path) -> Path:
    p = tmp_path / "bad.sqlite"
    if kind == "missing":
        return p
    if kind == "not sqlite":
        p.write_text("model: tiny\n")
        return p
    shutil.copyfile(snapshot_file, p)
    if kind == "truncated":
        os.truncate(p, p.stat().st_size // 2)
    elif kind == "bit-flipped":
        _flip_a_bit_in_a_table_page(p)
    elif kind == "newer revision":
        _newer_revision(p)
    return p


@pytest.mark.parametrize("kind", ["missing", "not sqlite", "truncated", "bit-flipped", "newer revision"])
def test_verify_refuses_a_bad_file_with_one_error_line_and_leaves_it_unchanged(checkpoint, tmp_path, kind):
    path = _bad_file(kind, _snapshot1(checkpoint) / SNAPSHOT_DB, tmp_path)
    before = tree_state(tmp_path)
    r = cli("verify", path)
    assert r.returncode != 0
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert {"missing": "no such file", "not sqlite": "not a SQLite database", "truncated": "truncated",
            "bit-flipped": "integrity_check failed", "newer revision": "unknown schema revision v9_9_z"}[kind] in lines[0]
    assert tree_state(tmp_path) == before  # no bytes changed, no -wal/-shm created


def test_verify_reports_a_broken_invariant(checkpoint, tmp_path):
    p = tmp_path / "s.sqlite"
    shutil.copyfile(_snapshot1(checkpoint) / SNAPSHOT_DB, p)
    with sqlite3.connect(p) as conn:
        conn.execute("UPDATE sampler_state SET next_seq = 0")
    r = cli("verify", p)
    assert r.returncode == 1
    assert "invariant 4" in r.stderr and r.stderr.startswith("error: ")


# ---------------------------------------------------------------- hostile input: no traceback, no hang


def _one_error_line(r: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("table", ["run_meta", "sampler_state"])
def test_verify_reports_an_empty_singleton_table_in_one_line_instead_of_a_traceback(checkpoint, tmp_path, table):
    p = tmp_path / "s.sqlite"
    shutil.copyfile(_snapshot1(checkpoint) / SNAPSHOT_DB, p)
    with sqlite3.connect(p) as conn:
        conn.execute(f"DELETE FROM {table}")
    before = tree_state(tmp_path)
    r = cli("verify", p)
    assert r.returncode == 1
    _one_error_line(r, table, "0 rows")
    assert tree_state(tmp_path) == before


def _without_dac_override() -> None:
    """Run as root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH (dropped from the bounding
    set before exec), so a chmod 000 file is unreadable as it is for any other user."""
    import ctypes

    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH; PR_CAPBSET_DROP is 24
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def cli_unprivileged(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutdb.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, preexec_fn=_without_dac_override)


@pytest.mark.parametrize("what", ["file", "manifest"])
def test_verify_of_an_unreadable_file_is_one_error_line_naming_the_permission(ckpt, what):
    snap = _snapshot1(ckpt)
    target = snap / (SNAPSHOT_DB if what == "file" else "manifest.json")
    target.chmod(0)
    r = cli_unprivileged("verify", snap / SNAPSHOT_DB if what == "file" else snap)
    target.chmod(0o644)
    assert r.returncode in (1, 2)
    _one_error_line(r, str(target), "ermission denied")


def _deep_manifest(ckpt: Path, depth: int) -> Path:
    m = _snapshot1(ckpt) / "manifest.json"
    d = json.loads(m.read_text())
    d["timings"] = "DEEP"  # json cannot build what it cannot read back: spliced in as text
    m.write_text(json.dumps(d).replace('"DEEP"', "[" * depth + "]" * depth))
    return m


@pytest.mark.parametrize("depth", [100, 100_000])
def test_a_manifest_nested_too_deeply_is_one_error_line_for_verify_and_an_invalid_row_for_snapshots(ckpt, depth):
    m = _deep_manifest(ckpt, depth)
    before = tree_state(ckpt)
    r = cli("verify", _snapshot1(ckpt))
    assert r.returncode == 1
    _one_error_line(r, str(m), "nested")
    r = cli("snapshots", ckpt, "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    row = next(x for x in json.loads(r.stdout) if x["path"] == str(_snapshot1(ckpt)))
    assert not row["complete"] and "nested" in row["problem"]
    assert tree_state(ckpt) == before


@pytest.mark.parametrize("field,value", [("created_at", "yesterday"), ("cut_time", [1]), ("row_counts", {"a": "b"}),
                                         ("mutation_counter", 1.5), ("schema_revision", 7), ("sequence", True),
                                         ("created_at", None), ("group_states", []), ("timings", {"x": "1"})])
def test_a_manifest_field_of_the_wrong_type_is_refused_naming_the_field(ckpt, field, value):
    m = _snapshot1(ckpt) / "manifest.json"
    d = json.loads(m.read_text())
    d[field] = value
    m.write_text(json.dumps(d))
    before = tree_state(ckpt)
    r = cli("snapshots", ckpt)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "invalid manifest" in r.stdout or "incomplete" in r.stdout
    r = cli("verify", _snapshot1(ckpt))
    assert r.returncode == 1
    _one_error_line(r, str(m), field)
    assert tree_state(ckpt) == before


def test_a_fifo_as_the_store_path_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "store.sqlite"
    os.mkfifo(fifo)
    r = cli("verify", fifo, timeout=30)  # times out (a failure) if it ever opens the FIFO
    assert r.returncode in (1, 2)
    _one_error_line(r, str(fifo), "FIFO")


def test_a_fifo_named_manifest_json_is_refused_without_waiting_for_a_writer(ckpt):
    m = _snapshot1(ckpt) / "manifest.json"
    m.unlink()
    os.mkfifo(m)
    r = cli("verify", _snapshot1(ckpt), timeout=30)
    assert r.returncode == 1
    _one_error_line(r, str(m), "FIFO")
    r = cli("snapshots", ckpt, timeout=30)
    assert r.returncode == 0 and r.stderr == ""


def test_snapshots_and_inspect_write_the_same_age_the_same_way(ckpt):
    import time

    # An hour and a bit ago: "1h2m" (the one style), where the two commands once wrote
    # "1.0h" and "1h2m".
    snap = _snapshot1(ckpt)
    manifest = json.loads((snap / "manifest.json").read_text())
    manifest["created_at"] = manifest["cut_time"] = time.time() - 3725
    (snap / "manifest.json").write_text(json.dumps(manifest))
    table = cli("snapshots", ckpt)
    assert table.returncode == 0, table.stderr
    (row,) = [line.split() for line in table.stdout.splitlines() if line.split()[:2] == ["1", "bootstrap"]]
    assert row[3] == "1h2m", row
    summary = cli("inspect", snap / SNAPSHOT_DB)
    assert summary.returncode == 0, summary.stderr
    assert "(1h2m ago)" in summary.stdout, summary.stdout


def _epoch_like_floats(doc) -> list:
    """Every number in a JSON document that could be a point in time (after 2001)."""
    if isinstance(doc, dict):
        return [x for v in doc.values() for x in _epoch_like_floats(v)]
    if isinstance(doc, list):
        return [x for v in doc for x in _epoch_like_floats(v)]
    return [doc] if isinstance(doc, float) and doc > 1e9 else []


def test_every_report_command_prints_parseable_json_with_no_epoch_float(ckpt):
    snap = _snapshot1(ckpt)
    for args in (("inspect", snap / SNAPSHOT_DB, "--json"), ("snapshots", ckpt, "--json"), ("verify", ckpt, "--json"),
                 ("verify", snap, "--json")):
        r = cli(*args)
        assert r.returncode == 0, (args, r.stderr)
        doc = json.loads(r.stdout)
        assert doc, args
        assert _epoch_like_floats(doc) == [], args
