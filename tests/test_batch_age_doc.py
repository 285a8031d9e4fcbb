"""The batch-age SQL that docs/trace.md gives, run as written through `rolloutdb sql` on the
trace of a real run that was killed (SIGKILL at a fault point after a train step's commit)
and resumed, equals the batch age the trainer logged in metrics.jsonl at every step,
the steps trained twice included."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from train_cli import env

DOC = REPO / "docs" / "trace.md"
# Multi-turn at prefix level with staleness 2: tokens of several versions per group, and
# environment tokens (negative versions) in every published group.
CONFIG = REPO / "examples" / "multiturn.yaml"
OVERRIDES = ["run.seed=9", "algorithm.total_steps=8", "algorithm.groups_per_step=3", "algorithm.group_size=4",
             "environment.dataset_size=64", "environment.task=digits_longtail", "environment.max_digits=8",
             "generation.max_tokens=9", "environment.turns=3", "rollout_recovery.target_level=prefix",
             "checkpointing.interval_steps=1", "rollout_checkpointing.enabled=true",
             "rollout_checkpointing.interval_s=0.1", "trace.enabled=true", "logging.progress=false",
             "logging.plot=false", "algorithm.max_staleness=2"]
TOLERANCE = 1e-9


def documented_batch_age_sql() -> str:
    text = DOC.read_text()
    block = re.search(r"```sql\n(.*?)```", text[text.index("- **Batch age**"):], re.S)
    assert block, "docs/trace.md's batch-age bullet has no ```sql block"
    return "\n".join(line.removeprefix("  ") for line in block.group(1).splitlines())


def _train(run_dir: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rolloutdb", "train", "--config", str(CONFIG), "--run-dir", str(run_dir), *extra]
    return subprocess.run(cmd + OVERRIDES, env={**env(), **({"ROLLOUTDB_FAULT": fault} if fault else {})},
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("batch_age") / "run"
    # Killed while step 4's checkpoint is being published: step 4 is trained and logged, and
    # no snapshot anchored on it exists, so the resume trains it again (a kill right after a
    # step's commit loses its metrics line with it, and whether a logged step is lost then
    # hangs on which snapshot made it out first).
    killed = _train(run_dir, fault="train.before_checkpoint_publish@4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = _train(run_dir, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    return run_dir


def logged_batch_ages(run_dir: Path) -> list[tuple[int, float]]:
    return [(step, age) for _, step, age in logged_by_process(run_dir)]


def logged_by_process(run_dir: Path) -> list[tuple[int, int, float]]:
    """(attempt: the process that wrote the line, step, batch age) of every train step logged."""
    events = []
    for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line the kill cut
        if event.get("kind") == "train_step":
            events.append((event["attempt"], event["step"], event["batch_age"]))
    return events


def _per_process(items: list[tuple]) -> list[list[tuple]]:
    """Consecutive items of one process (first field) as lists of the rest, in order."""
    out: list[list[tuple]] = []
    for process, *rest in items:
        if not out or process != last:
            out.append([])
        out[-1].append(tuple(rest))
        last = process
    return out


def test_the_documented_batch_age_sql_gives_the_logged_batch_age_of_every_step_of_a_resumed_run(resumed_run):
    result = subprocess.run([sys.executable, "-m", "rolloutdb", "sql", str(resumed_run), "--format", "json", "-q",
                             documented_batch_age_sql()], env=env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    logged = logged_by_process(resumed_run)
    steps = [step for _, step, _ in logged]
    assert len(steps) > len(set(steps)), f"a step the stop lost is trained again after the resume: {steps}"
    assert [r["run"] for r in rows] == sorted(r["run"] for r in rows) and {r["run"] for r in rows} == {1, 2}
    traced = _per_process([(r["run"], r["step"], r["batch_age"]) for r in rows])
    written = _per_process(logged)
    assert len(written) == 2, written
    # The resumed run ended: its trace and its log hold the same steps. The killed one's
    # trace may hold one step more: the kill can land between a step's trace event and its
    # metrics line (the line waits for the event, never the other way round).
    (killed_traced, resumed_traced), (killed_logged, resumed_logged) = traced, written
    assert [s for s, _ in resumed_traced] == [s for s, _ in resumed_logged]
    assert [s for s, _ in killed_traced[:len(killed_logged)]] == [s for s, _ in killed_logged]
    assert len(killed_traced) - len(killed_logged) in (0, 1), (killed_traced, killed_logged)
    off = [(step, doc, age) for t, w in zip(traced, written) for (step, doc), (_, age) in zip(t, w)
           if abs(doc - age) > TOLERANCE]
    assert not off, f"(step, documented SQL, logged) differ: {off}"
    assert any(age > 0 for _, _, age in logged)


def test_a_run_killed_right_after_a_train_steps_metrics_line_has_that_step_in_its_trace(tmp_path):
    """The trace commits its events every few milliseconds and a SIGKILL loses the last
    ones; a train step's metrics line is written only once the trace holds its event, so a
    step logged as trained is in the trace the documented SQL reads."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rolloutdb", "train", "--config", str(REPO / "examples" / "quickstart.yaml"),
           "--run-dir", str(run_dir), "algorithm.total_steps=6", "logging.progress=false", "logging.plot=false",
           "trace.enabled=true"]
    killed = subprocess.run(cmd, env={**env(), "ROLLOUTDB_FAULT": "train.after_step_logged@3"}, capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    logged = [step for step, _ in logged_batch_ages(run_dir)]
    assert logged == [1, 2, 3]
    trace = run_dir / "logs" / "rollout_trace.sqlite"
    with contextlib.closing(sqlite3.connect(f"file:{trace}?mode=ro", uri=True)) as conn:
        traced = [step for (step,) in conn.execute("SELECT step FROM train_step ORDER BY seq")]
    assert traced == logged
