"""A resume uses only sound checkpoints: an anchor (trainer checkpoint) is checked against
its manifest before its files are loaded, `latest` falls back to the newest sound
(anchor, snapshot) pair and says so on stderr and in the metrics, and no snapshot number
is ever handed out twice. Real runs in subprocesses; each test works on a copy."""

from __future__ import annotations

import shutil

import pytest

from train_cli import (
    GROUPS, STEPS, assert_one_error_line, digest, flip_byte, metrics, snapshot_sequences, train, trained_groups,
    verify,
)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = train(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    # The layout the tests rely on: the last two trainer checkpoints, each with a snapshot.
    assert (run_dir / f"checkpoints/step_{STEPS}").is_dir() and (run_dir / f"checkpoints/step_{STEPS - 1}").is_dir()
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(finished_run, dest)
    return dest


def _snapshots_of(run_dir, anchor):
    return sorted((run_dir / "checkpoints" / anchor / "rollout_snapshots").glob("snapshot_*"),
                  key=lambda p: int(p.name.split("_")[1]))


def _snapshot_dirs(run_dir) -> set[str]:
    return {p.relative_to(run_dir).as_posix() for p in run_dir.glob("checkpoints/*/rollout_snapshots/snapshot_*")}


def _assert_finished_healthy(run_dir):
    assert trained_groups(run_dir) == {s: GROUPS for s in range(1, STEPS + 1)}
    result = verify(run_dir)
    assert result.returncode == 0 and "duplicated=0 lost=0" in result.stdout, result.stdout + result.stderr


def test_an_anchor_failing_its_checksum_is_never_loaded_and_latest_falls_back_saying_why(run_copy):
    newest = f"step_{STEPS}"
    flip_byte(run_copy / "checkpoints" / newest / "model.safetensors")
    result = train(run_copy, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {newest}/" not in result.stderr
    assert f"resumed from step_{STEPS - 1}/" in result.stderr, result.stderr
    announced = [line for line in result.stderr.splitlines() if "passed over" in line and newest in line]
    assert announced and "model.safetensors" in announced[0], result.stderr
    (restore,) = metrics(run_copy, "restore")
    assert restore["anchor"] == f"step_{STEPS - 1}"
    assert any(newest in p and "model.safetensors" in p for p in restore["passed_over"]), restore["passed_over"]
    _assert_finished_healthy(run_copy)


def test_an_explicit_snapshot_whose_anchor_fails_its_checksum_is_refused_and_changes_nothing(run_copy):
    newest = f"step_{STEPS}"
    flip_byte(run_copy / "checkpoints" / newest / "model.safetensors")
    snapshot = _snapshots_of(run_copy, newest)[-1]
    before = digest(run_copy)
    result = train(run_copy, "--resume", str(snapshot))
    assert_one_error_line(result, "model.safetensors")
    assert digest(run_copy) == before


def test_sequence_numbers_are_never_reused_after_a_fallback(run_copy):
    ever_seen = snapshot_sequences(run_copy / "checkpoints")
    dirs_before = _snapshot_dirs(run_copy)
    newest = _snapshots_of(run_copy, f"step_{STEPS}")[-1]
    assert int(newest.name.split("_")[1]) == max(ever_seen)
    flip_byte(newest / "rollout_state.sqlite", offset=200)  # in the file header page: a checksum failure
    result = train(run_copy, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    announced = [line for line in result.stderr.splitlines() if "passed over" in line and newest.name in line]
    assert announced, result.stderr
    (restore,) = metrics(run_copy, "restore")
    assert any(newest.name in p for p in restore["passed_over"]), restore
    events = metrics(run_copy)
    since_restore = events[next(i for i, e in enumerate(events) if e.get("kind") == "restore"):]
    published = [e["sequence"] for e in since_restore if e.get("kind") == "snapshot" and e.get("outcome") == "published"]
    assert published, "the resumed run published no snapshot"
    assert min(published) > max(ever_seen), (sorted(ever_seen), published)
    new_dirs = _snapshot_dirs(run_copy) - dirs_before
    assert new_dirs and all(int(d.rsplit("_", 1)[1]) > max(ever_seen) for d in new_dirs), (sorted(ever_seen), new_dirs)
    _assert_finished_healthy(run_copy)
