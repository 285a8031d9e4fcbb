"""One process per run directory: `rolloutdb train` holds an OS lock on RUN_DIR/run.lock
for its whole life. Real subprocesses; the run directory is checked afterwards by
reading its files, not through the code under test."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from train_cli import (
    GROUPS, STEPS, assert_one_error_line, digest, metrics, start, train, trace_pids, trained_groups, verify, wait_for,
)

# Long enough that a second process reaches the lock while the first still trains.
LONG = ["algorithm.total_steps=60"]


def _assert_healthy(run_dir, steps: int) -> None:
    result = verify(run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "duplicated=0 lost=0" in result.stdout, result.stdout
    assert trained_groups(run_dir) == {s: GROUPS for s in range(1, steps + 1)}


def test_two_simultaneous_starts_leave_one_healthy_run_and_the_other_is_refused_naming_the_holder_pid(tmp_path):
    run_dir = tmp_path / "run"
    a, b = start(run_dir), start(run_dir)
    done = {}
    for p in (a, b):
        out, err = p.communicate(timeout=240)
        done[p.pid] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    codes = sorted(r.returncode for r in done.values())
    assert codes == [0, 2], {pid: (r.returncode, r.stderr[-1500:]) for pid, r in done.items()}
    (winner,) = [pid for pid, r in done.items() if r.returncode == 0]
    (loser,) = [r for r in done.values() if r.returncode == 2]
    assert_one_error_line(loser, f"pid {winner}")
    _assert_healthy(run_dir, STEPS)
    # The refused process wrote nothing: the trace knows one process only.
    assert trace_pids(run_dir) == [winner]


def test_a_resume_started_while_the_run_trains_is_refused_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    first = start(run_dir, overrides=LONG)
    try:
        wait_for(lambda: metrics(run_dir, "train_step"), deadline_s=180, what="the first train step", proc=first)
        second = train(run_dir, "--resume", overrides=LONG)
        assert first.poll() is None, "the first run ended before the resume was tried; the test proved nothing"
        assert_one_error_line(second, f"pid {first.pid}")
        _out, err = first.communicate(timeout=300)
        assert first.returncode == 0, err[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    _assert_healthy(run_dir, 60)
    assert trace_pids(run_dir) == [first.pid]
    assert not metrics(run_dir, "restore"), "the refused resume restored something"


def test_after_kill_9_of_the_holder_a_resume_takes_the_run_over_at_once(tmp_path):
    run_dir = tmp_path / "run"
    first = start(run_dir)

    def snapshot_after_a_step() -> bool:
        return any(e.get("outcome") == "published" and e.get("anchor") != "bootstrap" for e in metrics(run_dir, "snapshot"))

    try:
        wait_for(snapshot_after_a_step, deadline_s=180, what="a snapshot anchored to a train step", proc=first)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL
    resumed = train(run_dir, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step_" in resumed.stderr
    _assert_healthy(run_dir, STEPS)


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_a_run_lock_name_taken_by_something_else_than_a_file_is_refused_in_one_line(tmp_path, kind):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / "run.lock"
    if kind == "directory":
        lock.mkdir()
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.symlink_to(tmp_path / "elsewhere")
    before = digest(tmp_path)
    result = train(run_dir, timeout=60)  # a FIFO opened for reading would hang
    assert_one_error_line(result, "run.lock")
    assert digest(tmp_path) == before
