"""What an interval can and cannot do (issue W3-B item 3): rollout snapshots exist only
while the weights in force have a durable trainer checkpoint, so with
`checkpointing.interval_steps` N > 1 they are taken in one step of every N. The config
says so at load (one line: what will happen and the setting that avoids it) and the run's
summary line counts the attempts `skipped_not_durable`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rolloutdb.config import config_from_dict, snapshot_interval_warning
from rolloutdb.controller.run.run_log import summary_line

REPO = Path(__file__).resolve().parents[1]


def _config(interval_steps: int, snapshots: bool = True, checkpoints: bool = True):
    return config_from_dict({"checkpointing": {"interval_steps": interval_steps, "enabled": checkpoints},
                             "rollout_checkpointing": {"enabled": snapshots}})


def test_checkpoints_every_few_steps_with_snapshots_on_warn_naming_the_interval_and_the_setting_that_avoids_it():
    line = snapshot_interval_warning(_config(5))
    assert line is not None and "\n" not in line
    assert "checkpointing.interval_steps: 5" in line and "one train step of every 5" in line
    assert "skipped_not_durable" in line and "checkpointing.interval_steps: 1" in line and "async" in line


def test_checkpoints_every_step_or_no_snapshots_give_no_warning():
    assert snapshot_interval_warning(_config(1)) is None
    assert snapshot_interval_warning(_config(5, snapshots=False)) is None


def test_the_summary_line_counts_published_snapshots_and_attempts_without_a_durable_anchor():
    steps = [{"kind": "train_step", "step": s, "reward_mean": 0.5} for s in (1, 2)]
    outcomes = ["published", "skipped_not_durable", "skipped_not_durable", "skipped_commit", "published"]
    line = summary_line(steps, [{"kind": "snapshot", "outcome": o} for o in outcomes])
    assert line.endswith(" snapshots=2 skipped_not_durable=2")
    assert "snapshots=" not in summary_line(steps)  # no snapshot lines: nothing said


def test_a_run_checkpointing_every_other_step_warns_at_start_and_counts_the_skipped_attempts(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rolloutdb", "train", "--config", str(REPO / "examples" / "quickstart.yaml"),
           "--run-dir", str(run_dir), "algorithm.total_steps=8", "algorithm.groups_per_step=2",
           "algorithm.group_size=2", "checkpointing.interval_steps=4", "rollout_checkpointing.interval_s=0.05",
           "logging.progress=false", "logging.plot=false", "trace.enabled=false"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("rolloutdb: warning:")]
    assert len(warnings) == 1 and "checkpointing.interval_steps: 4" in warnings[0], proc.stderr[-2000:]
    # The metrics file, read here on its own, is what the line must agree with.
    events = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    skipped = sum(1 for e in events if e.get("kind") == "snapshot" and e.get("outcome") == "skipped_not_durable")
    published = sum(1 for e in events if e.get("kind") == "snapshot" and e.get("outcome") == "published")
    assert skipped > 0, "steps 1-3 and 5-7 have no durable anchor: their interval attempts are skipped"
    assert proc.stdout.strip().splitlines()[-1].endswith(f" snapshots={published} skipped_not_durable={skipped}")
