"""Driving `rolloutdb train` as a user does, in real subprocesses, for the run-lock and
resume-safety tests: small runs (the crash harness's settings), a digest of a whole run
directory to prove a refusal changed nothing, and reads of what a run left on disk that
do not go through the code under test."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import settled
from crash_harness import EXAMPLE, GROUPS, OVERRIDES, STEPS  # noqa: F401  (re-exported for the tests)

TIMEOUT = 240


def command(run_dir: Path, *args: str, overrides: list[str] | None = None) -> list[str]:
    base = [sys.executable, "-m", "rolloutdb", "train", "--config", str(EXAMPLE), "--run-dir", str(run_dir)]
    return base + list(args) + OVERRIDES + list(overrides or [])


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k != "ROLLOUTDB_FAULT"}
    e["RAY_AUTH_MODE"] = "disabled"
    return e


def train(run_dir: Path, *args: str, overrides: list[str] | None = None, extra_env: dict | None = None,
          timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(command(run_dir, *args, overrides=overrides), env={**env(), **(extra_env or {})},
                          capture_output=True, text=True, timeout=timeout)


def start(run_dir: Path, *args: str, overrides: list[str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(command(run_dir, *args, overrides=overrides), env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def verify(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(run_dir)], env=env(),
                          capture_output=True, text=True, timeout=TIMEOUT)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def assert_one_error_line(proc, *needles: str) -> str:
    """A refusal: exit 2, and stderr is exactly one line starting with `error:`."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def digest(root: Path) -> dict[str, str]:
    """Every directory and file under `root` with its content hash: equal digests mean
    nothing was created, removed or changed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        out[rel + "/"] = "dir"
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            mode = os.lstat(p).st_mode
            if stat.S_ISREG(mode):
                out[(Path(rel) / name).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:  # never opened: a FIFO would block
                out[(Path(rel) / name).as_posix()] = f"mode {stat.S_IFMT(mode):o} -> {os.readlink(p) if p.is_symlink() else ''}"
    return out


def metrics(run_dir: Path, kind: str | None = None) -> list[dict]:
    path = run_dir / "logs" / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if kind is None or event.get("kind") == kind:
            out.append(event)
    return out


def trained_groups(run_dir: Path) -> dict[int, int]:
    """Groups trained per step, read with a plain sqlite3 connection."""
    conn = sqlite3.connect(f"file:{run_dir / 'rollout_state.sqlite'}?mode=ro", uri=True)
    try:
        return settled.trained_per_step(conn)
    finally:
        conn.close()


def trace_pids(run_dir: Path) -> list[int]:
    """The pid of every process that wrote to the run's trace."""
    conn = sqlite3.connect(f"file:{run_dir / 'logs' / 'rollout_trace.sqlite'}?mode=ro", uri=True)
    try:
        return [r[0] for r in conn.execute("SELECT pid FROM run_started ORDER BY seq")]
    finally:
        conn.close()


def snapshot_sequences(checkpoints: Path) -> set[int]:
    """Every snapshot number found under a checkpoint directory, by directory name
    (published, temporary or being deleted)."""
    seqs = set()
    for dirpath, dirnames, _files in os.walk(checkpoints):
        for d in dirnames:
            name = d.lstrip(".")
            if name.startswith("snapshot_"):
                digits = name[len("snapshot_"):].split(".", 1)[0]
                if digits.isdigit():
                    seqs.add(int(digits))
    return seqs


def wait_for(predicate, *, deadline_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    """Poll until `predicate()` holds; fail (never hang) after `deadline_s`."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            _out, err = proc.communicate()
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}: {err[-2000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))
