"""`rolloutdb train --resume auto` (or `checkpointing.resume: auto`): continue the run in the
run directory if there is one, else start it; what a requeued job script runs every time.
A run that is there but cannot be resumed is refused, never started over. Real
`rolloutdb train` processes (tests/train_cli.py); the run's files read with json and sqlite3.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from train_cli import STEPS, assert_one_error_line, digest, error_lines, metrics, train, trained_groups, verify


@pytest.fixture(scope="module")
def started(tmp_path_factory) -> Path:
    """A run that `--resume auto` started in a directory that did not exist."""
    run_dir = tmp_path_factory.mktemp("auto") / "missing" / "run"
    proc = train(run_dir, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(--resume auto: no run here yet)" in proc.stderr
    return run_dir


def test_resume_auto_starts_a_run_where_there_is_none(started):
    assert len(metrics(started, "train_step")) == STEPS
    assert not metrics(started, "restore")
    assert sum(trained_groups(started).values()) > 0


def test_resume_auto_starts_a_run_in_an_empty_directory(tmp_path):
    proc = train(tmp_path, "--resume", "auto", overrides=["algorithm.total_steps=1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(--resume auto: no run here yet)" in proc.stderr
    assert len(metrics(tmp_path, "train_step")) == 1


def test_checkpointing_resume_auto_continues_the_run_that_is_there(started, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(started, run_dir)
    proc = train(run_dir, overrides=["checkpointing.resume=auto", f"algorithm.total_steps={STEPS + 2}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming" in proc.stderr and "(--resume auto: a run is here)" in proc.stderr, proc.stderr[-3000:]
    restore = metrics(run_dir, "restore")
    assert len(restore) == 1 and restore[0]["snapshot"], restore
    assert sorted({e["step"] for e in metrics(run_dir, "train_step")}) == list(range(1, STEPS + 3))
    check = verify(run_dir)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]


def test_resume_auto_refuses_a_run_it_cannot_resume_and_changes_nothing(started, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(started, run_dir)
    before = digest(run_dir)
    proc = train(run_dir, "--resume", "auto", overrides=["algorithm.learning_rate=0.5"])  # a frozen key
    # Refused at the restore (after the "resuming" line), as `--resume latest` is.
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "config fingerprint" in errors[0], proc.stderr[-3000:]
    assert digest(run_dir) == before


def test_resume_auto_refuses_checkpoints_without_their_live_store_and_changes_nothing(started, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(started, run_dir)
    for name in ("rollout_state.sqlite", "rollout_state.sqlite-wal", "rollout_state.sqlite-shm"):
        (run_dir / name).unlink(missing_ok=True)
    before = digest(run_dir)
    proc = train(run_dir, "--resume", "auto")
    assert_one_error_line(proc, "--resume auto found a run's files (checkpoints/) but no live store")
    assert digest(run_dir) == before


def test_resume_auto_and_start_over_together_are_refused(tmp_path):
    proc = train(tmp_path / "run", "--resume", "auto", "--start-over")
    assert_one_error_line(proc, "--resume auto", "--start-over")
    assert not (tmp_path / "run").exists()
