"""`--resume` never starts a run over on its own, and restores only this run's snapshots.
A refused resume writes nothing anywhere (the whole run directory is compared, byte for
byte, before and after). Real runs in subprocesses; each test works on a copy."""

from __future__ import annotations

import shutil
import signal

import pytest

from train_cli import (
    GROUPS, STEPS, assert_one_error_line, digest, metrics, train, trained_groups, verify,
)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = train(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(finished_run, dest)
    return dest


def _newest_snapshot(run_dir):
    snaps = sorted(run_dir.glob("checkpoints/step_*/rollout_snapshots/snapshot_*"),
                   key=lambda p: int(p.name.split("_")[1]))
    return snaps[-1]


@pytest.mark.parametrize("damage", ["checkpoints missing", "checkpoints empty"])
def test_a_resume_with_nothing_to_restore_beside_trained_work_is_refused_and_changes_nothing(run_copy, damage):
    shutil.rmtree(run_copy / "checkpoints")
    if damage == "checkpoints empty":
        (run_copy / "checkpoints").mkdir()
    before = digest(run_copy)
    result = train(run_copy, "--resume")
    assert_one_error_line(result, "--start-over")
    assert "trained" in result.stderr  # says what would be lost
    assert digest(run_copy) == before  # no trace row, no metrics line, no directory, no store change


def test_start_over_moves_the_old_run_aside_and_trains_from_step_zero_saying_so(run_copy):
    shutil.rmtree(run_copy / "checkpoints")
    old_store = (run_copy / "rollout_state.sqlite").read_bytes()
    result = train(run_copy, "--resume", "--start-over")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "start" in result.stderr and "over" in result.stderr, result.stderr
    kept = list((run_copy / "discarded").glob("*/rollout_state.sqlite"))
    assert len(kept) == 1 and kept[0].read_bytes() == old_store  # nothing destroyed
    assert trained_groups(run_copy) == {s: GROUPS for s in range(1, STEPS + 1)}
    assert verify(run_copy).returncode == 0
    restores = metrics(run_copy, "restore")
    assert restores[-1]["snapshot"] is None and restores[-1]["step"] == 0


def test_a_run_killed_before_it_handed_out_a_prompt_resumes_by_starting_over(tmp_path):
    """The one silent-safe start over: the live store provably holds no work."""
    run_dir = tmp_path / "run"
    killed = train(run_dir, extra_env={"ROLLOUTDB_FAULT": "publish.tmpdir_created@1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    result = train(run_dir, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting the run over" in result.stderr
    assert trained_groups(run_dir) == {s: GROUPS for s in range(1, STEPS + 1)}


def test_start_over_is_refused_together_with_a_snapshot_directory(run_copy):
    before = digest(run_copy)
    result = train(run_copy, "--resume", str(_newest_snapshot(run_copy)), "--start-over")
    assert_one_error_line(result, "--start-over")
    assert digest(run_copy) == before


def test_a_snapshot_of_another_run_is_refused_before_anything_is_replaced(run_copy, tmp_path):
    other = tmp_path / "other"
    made = train(other)  # same config and seed: only the run id tells the runs apart
    assert made.returncode == 0, made.stderr[-3000:]
    foreign = _newest_snapshot(other)
    before, other_before = digest(run_copy), digest(other)
    result = train(run_copy, "--resume", str(foreign))
    assert_one_error_line(result, "another run")
    assert digest(run_copy) == before
    assert digest(other) == other_before
