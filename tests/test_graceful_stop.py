"""SIGTERM and SIGINT stop `rolloutdb train` gracefully (rolloutdb/commands/_graceful_stop.py):
real `rolloutdb train` processes, real signals, the run's files read with json and sqlite3.

The runs take no snapshot on their own between the first (bootstrap) and the stop:
trainer checkpoints every 1000 steps and snapshots every 600 s. So a resume that restores a
snapshot cut after the signal restores the final snapshot the stop took, and nothing else
could have given it.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from crash_harness import TURN_LEVEL
from train_cli import env, metrics, verify, wait_for

REPO = Path(__file__).resolve().parents[1]
STEPS = 12
STARTUP_S = 240  # a hang detector: torch's import and the policy's build beside two CPU hogs
QUIET = ["checkpointing.interval_steps=1000", "rollout_checkpointing.interval_s=600"]


def _command(run_dir: Path, *extra: str) -> list[str]:
    overrides = [o for o in TURN_LEVEL.overrides if not o.startswith(("checkpointing.interval_steps",
                                                                       "rollout_checkpointing.interval_s",
                                                                       "algorithm.total_steps"))]
    return [sys.executable, "-m", "rolloutdb", "train", "--config", str(TURN_LEVEL.example), "--run-dir", str(run_dir),
            *overrides, f"algorithm.total_steps={STEPS}", *QUIET, *extra]


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(_command(run_dir, *extra), env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _slow_saves(save_s: float) -> list[str]:
    """Every trainer checkpoint takes `save_s` more: a stop that outlasts a second signal."""
    return [f"trainer.factory={REPO / 'tests' / 'slow_prepare_trainer.py'}:make_trainer",
            f"trainer.options={{prepare_s: 0.0, save_s: {save_s}}}"]


def _signal_after_steps(proc: subprocess.Popen, run_dir: Path, steps: int, signum: int) -> float:
    wait_for(lambda: len(metrics(run_dir, "train_step")) >= steps, deadline_s=STARTUP_S,
             what=f"{steps} train steps", proc=proc)
    sent = time.time()
    proc.send_signal(signum)
    return sent


def _continue_command(stderr: str) -> list[str]:
    lines = [line for line in stderr.splitlines() if line.startswith("rolloutdb: to continue: ")]
    assert len(lines) == 1, stderr[-3000:]
    words = shlex.split(lines[0].removeprefix("rolloutdb: to continue: "))
    assert words[:2] == ["rolloutdb", "train"], words
    return words


def test_sigterm_takes_a_final_snapshot_that_the_printed_command_resumes_from(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    sent = _signal_after_steps(proc, run_dir, 2, signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    saved = [line for line in err.splitlines() if line.startswith("rolloutdb: stopped by SIGTERM")]
    assert len(saved) == 1 and "saved: rollout snapshot " in saved[0], err[-3000:]
    words = _continue_command(err)
    assert words[words.index("--resume") + 1] == "auto" and words[words.index("--run-dir") + 1] == str(run_dir)

    resumed = subprocess.run([sys.executable, "-m", "rolloutdb", *words[1:]], env=env(), capture_output=True,
                             text=True, timeout=STARTUP_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    restore = metrics(run_dir, "restore")
    assert len(restore) == 1, restore
    manifest = json.loads((Path(restore[0]["snapshot"]) / "manifest.json").read_text())
    assert manifest["cut_time"] > sent, ("the resume restored a snapshot cut before the signal", manifest, sent)
    assert restore[0]["step"] >= 2
    assert f"rollout snapshot {restore[0]['snapshot_seq']} " in saved[0]
    assert len({e["step"] for e in metrics(run_dir, "train_step")}) == STEPS
    check = verify(run_dir)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]


def test_a_second_sigterm_during_the_grace_exits_at_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *_slow_saves(6.0))  # the stop's checkpoint alone takes 6 s
    _signal_after_steps(proc, run_dir, 1, signal.SIGTERM)
    time.sleep(1.0)
    second = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    took = time.monotonic() - second
    assert proc.returncode == 143, err[-3000:]
    assert "rolloutdb: stopped at once (a second signal (SIGTERM)); saved: " in err, err[-3000:]
    assert took < 4.0, took
    _continue_command(err)
    check = verify(run_dir)  # what was durable is a sound run
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]


def test_the_grace_running_out_ends_the_stop_where_it_is(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *_slow_saves(6.0), "run.shutdown_grace_s=1")
    first = _signal_after_steps(proc, run_dir, 1, signal.SIGINT)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "run.shutdown_grace_s (1 s) ran out" in err, err[-3000:]
    assert time.time() - first < 5.0
    _continue_command(err)


def test_a_grace_of_zero_exits_at_once_on_the_first_signal(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "run.shutdown_grace_s=0")
    _signal_after_steps(proc, run_dir, 1, signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "stopped at once (SIGTERM, run.shutdown_grace_s is 0)" in err, err[-3000:]
    assert not metrics(run_dir, "shutdown")  # no graceful stop ran
