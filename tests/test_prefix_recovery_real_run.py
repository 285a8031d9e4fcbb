"""Prefix-level recovery on real runs of the main job, and its twin test.

The multi-turn long-tail example at `target_level: prefix`, with the policy held fixed
(a recording GRPO trainer with learning rate 0, tests/recording_trainer.py) and no
zero-variance discards (so every run trains the same groups), is SIGKILLed twice while
the snapshot a resume would restore holds prefixes of running calls, and resumed each
time. Its never-stopped twin runs the same config. Then:

- every group trained by the killed run was trained by the twin with exactly the same
  tokens and logprobs, generation by generation: "as if never stopped";
- each resume continued every call whose prefix the restored snapshot held, counted from
  a copy of that snapshot taken before the kill (decoded here with SQL, not by the code
  under test), and `rolloutdb verify` finds nothing lost or doubled.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from crash_harness import newest_usable_snapshot

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "multiturn.yaml"
TIMEOUT_S = 300
KILLS = 2


def _config(record: Path) -> list[str]:
    return [
        "run.seed=5",
        "algorithm.total_steps=12",
        "algorithm.max_staleness=2",
        "algorithm.discard_zero_variance=false",
        "checkpointing.interval_steps=1",
        "rollout_recovery.target_level=prefix",
        "rollout_checkpointing.interval_s=0.1",
        "trace.enabled=true",
        "logging.progress=false",
        "logging.plot=false",
        f"trainer.factory={REPO / 'tests' / 'recording_trainer.py'}:make_trainer",
        f"trainer.options={{record: {record}}}",
    ]


def _train(run_dir: Path, record: Path, resume: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rolloutdb", "train", "--config", str(EXAMPLE), "--run-dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUTDB_FAULT"}
    env["RAY_AUTH_MODE"] = "disabled"
    return subprocess.Popen(cmd + (["--resume"] if resume else []) + _config(record), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kept_by_hand(snapshot_db: Path) -> int:
    """What a resume from this snapshot keeps, decoded here with SQL and numpy: the policy
    tokens of the running attempts' saved episodes and their calls' prefixes."""
    uri = f"file:{snapshot_db}?mode=ro&immutable=1"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        runs = conn.execute("SELECT e.version_token_counts FROM env_episodes e JOIN rollouts r "
                            "ON r.attempt_id = e.attempt_id WHERE r.state = 'running' AND e.token_ids IS NOT NULL")
        turns = sum(n for (text,) in runs for v, n in json.loads(text) if v != -1)
        chunks = conn.execute("SELECT c.token_ids FROM token_chunks c JOIN rollouts r ON r.attempt_id = c.attempt_id "
                              "WHERE r.state = 'running'").fetchall()
    return turns + sum(len(np.frombuffer(blob, "<i4")) for (blob,) in chunks)


def _prefix_tokens_by_hand(snapshot_db: Path) -> int:
    uri = f"file:{snapshot_db}?mode=ro&immutable=1"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        chunks = conn.execute("SELECT c.token_ids FROM token_chunks c JOIN rollouts r ON r.attempt_id = c.attempt_id "
                              "WHERE r.state = 'running'").fetchall()
    return sum(len(np.frombuffer(blob, "<i4")) for (blob,) in chunks)


def _prefixed_calls(snapshot_db: Path) -> int:
    """Running attempts whose calls the snapshot holds a prefix of, with one logprob per token."""
    uri = f"file:{snapshot_db}?mode=ro&immutable=1"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        return conn.execute(
            "SELECT count(DISTINCT c.attempt_id) FROM token_chunks c JOIN rollouts r ON r.attempt_id = c.attempt_id "
            "WHERE r.state = 'running' AND length(c.logprobs) = length(c.token_ids)").fetchone()[0]


def _kill_with_prefixes_saved(run_dir: Path, proc: subprocess.Popen, keep: Path) -> int | None:
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        proc.send_signal(signal.SIGSTOP)  # nothing is published while we look
        try:
            newest = newest_usable_snapshot(run_dir / "checkpoints")
            if newest is None:
                continue
            db = Path(newest[1]) / "rollout_state.sqlite"
            n = _prefixed_calls(db)
            if n:
                shutil.copyfile(db, keep)
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)
                return n
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=TIMEOUT_S)
    return None


def _trained(record: Path) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for line in record.read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["prompt_id"], set()).add(json.dumps([row["tokens"], row["logprobs"]]))
    return out


def _metrics(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_run")
    twin_dir, run_dir = root / "twin", root / "run"
    twin = _train(twin_dir, root / "twin.jsonl")
    proc = _train(run_dir, root / "run.jsonl")
    kills = []
    for k in range(KILLS):
        n = _kill_with_prefixes_saved(run_dir, proc, root / f"cut{k}.sqlite")
        if n is None:
            break
        kills.append(n)
        proc = _train(run_dir, root / "run.jsonl", resume=True)
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err[-2000:]
    _, err = twin.communicate(timeout=TIMEOUT_S)
    assert twin.returncode == 0, err[-2000:]
    assert kills, "the run ended before any snapshot held a prefix of a running call"
    verify = subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    report = subprocess.run([sys.executable, "-m", "rolloutdb", "trace", str(run_dir), "--baseline", str(twin_dir),
                             "--out", str(root / "report")], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert report.returncode == 0, report.stderr
    return {"root": root, "run_dir": run_dir, "kills": kills, "verify": verify,
            "report": json.loads((root / "report" / "trace_report.json").read_text()),
            "kept_by_hand": _kept_by_hand(root / "cut0.sqlite"),
            "prefix_tokens_by_hand": _prefix_tokens_by_hand(root / "cut0.sqlite"),
            "run": _trained(root / "run.jsonl"), "twin": _trained(root / "twin.jsonl")}


def test_every_group_the_killed_run_trained_has_exactly_its_twins_tokens_and_logprobs(job):
    assert job["run"].keys() == job["twin"].keys()
    differ = [p for p in job["run"] if job["run"][p] != job["twin"][p]]
    assert not differ, f"prompts whose generations differ from the twin's: {differ[:5]}"


def test_the_last_resume_continued_every_call_the_restored_snapshot_held_a_prefix_of(job):
    # The metrics log rolls back with each restore to its anchor, so it holds the last
    # resume's line only; the twin test above covers every resume.
    restores = _metrics(job["run_dir"], "prefix_restore")
    assert [r["calls"] for r in restores] == job["kills"][-1:]
    assert restores[0]["tokens"] >= restores[0]["calls"]


def test_a_prefix_level_run_killed_twice_loses_and_doubles_nothing(job):
    assert job["verify"].returncode == 0, job["verify"].stderr
    report = json.loads(job["verify"].stdout)
    assert report["duplicated"] == 0 and report["lost"] == 0, report


def test_the_trace_counts_the_first_stops_kept_prefixes_and_turns_as_its_snapshot_holds_them(job):
    # Only what the resumed run recorded: the stopped run's last events before its SIGKILL
    # may never reach the trace file (its writer batches), so its decoded counts are a
    # lower bound, and redone (decoded - kept) is not compared here.
    first = job["report"]["kept_per_stop"][0]
    assert first["kept_tokens"] == job["kept_by_hand"] > 0
    assert first["decoded_by_cut"] >= job["prefix_tokens_by_hand"]


def test_an_attempt_whose_call_the_cut_froze_threw_no_time_away(job):
    rows = job["report"]["kept_by_attempt"]
    frozen = [r for r in rows if r["stop_no"] == 1 and r["decoded_tokens"] > 0 and r["kept_tokens"] > 0]
    assert frozen
    assert any(r["thrown_away_s"] == 0 for r in frozen)
