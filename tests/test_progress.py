"""The progress display of `rolloutdb train`: a tqdm bar with an ETA when stderr is a
terminal (a real pseudo-terminal here), plain lines when it is a pipe (what CI and log
files see)."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

import train_cli
from rolloutdb.controller.run.run_log import ProgressBar

TWO_STEPS = ["algorithm.total_steps=2", "logging.progress=true"]


def _pty() -> tuple[int, int]:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    return master, slave


def _drain(master: int, proc: subprocess.Popen | None, deadline_s: float) -> str:
    """Everything written to the terminal until the writer exits (or the deadline)."""
    out, deadline = b"", time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError as e:  # EIO: every writer closed the terminal
                if e.errno != errno.EIO:
                    raise
                break
            if not chunk:
                break
            out += chunk
        elif proc is None or proc.poll() is not None:
            break
    return out.decode("utf-8", "replace")


def test_a_train_run_on_a_terminal_shows_a_tqdm_bar_with_its_eta_and_the_step_metrics(tmp_path: Path):
    master, slave = _pty()
    try:
        proc = subprocess.Popen(train_cli.command(tmp_path / "run", overrides=TWO_STEPS), env=train_cli.env(),
                                stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
        os.close(slave)
        screen = _drain(master, proc, train_cli.TIMEOUT)
        assert proc.wait(timeout=60) == 0, screen[-3000:]
        proc.stdout.close()
    finally:
        os.close(master)
    final = screen.replace("\r\n", "\n").split("\r")[-1]  # what the line shows at the end
    assert "100%|" in final and "█" in final and " 2/2 [" in final, screen[-2000:]
    # [elapsed<remaining (the ETA), rate, then the step's metrics]
    assert re.search(r" 2/2 \[\d\d:\d\d<00:00, +[\d.]+(step/s|s/step), reward [\d.]+ staleness [\d.]+ \d+ tok/s\]", final), final
    assert "step 1/2 [" not in screen, "the plain lines are for pipes"


def test_a_train_run_into_a_pipe_prints_plain_lines_and_no_bar(tmp_path: Path):
    proc = train_cli.train(tmp_path / "run", overrides=TWO_STEPS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("step ")]
    assert [line.split(" [")[0] for line in lines] == ["step 1/2", "step 2/2"]
    assert lines[1].startswith("step 2/2 [########################] reward ") and lines[1].endswith(" tok/s")
    assert "\r" not in proc.stderr and "█" not in proc.stderr and "%|" not in proc.stderr


def test_a_resumed_runs_bar_starts_at_its_resumed_step_and_ends_its_line():
    master, slave = _pty()
    try:
        with os.fdopen(slave, "w", encoding="utf-8") as terminal:
            bar = ProgressBar(5, enabled=True, start_step=3, stream=terminal)
            for step in (4, 5):
                bar.update({"step": step, "reward_mean": 0.5, "staleness_mean": 0.0, "policy_tokens": 10})
            assert bar.bar is None, "the bar closes itself at the last step"
        screen = _drain(master, None, 10)
    finally:
        os.close(master)
    frames = screen.replace("\r\n", "\n").split("\r")
    assert " 3/5 [" in frames[1] or " 3/5 [" in frames[0], frames[:3]
    assert " 5/5 [" in frames[-1] and frames[-1].endswith("\n"), frames[-1]


def test_a_disabled_bar_writes_nothing_even_on_a_terminal():
    master, slave = _pty()
    try:
        with os.fdopen(slave, "w", encoding="utf-8") as terminal:
            bar = ProgressBar(2, enabled=False, stream=terminal)
            bar.update({"step": 2, "reward_mean": 0.5, "staleness_mean": 0.0})
            bar.close()
        assert _drain(master, None, 2) == ""
    finally:
        os.close(master)
