"""Dashboards survive a resume, through real `rolloutdb train` runs (the crash harness's
small run, TensorBoard on): a run resumed from an earlier snapshot trains the steps after
it again, and TensorBoard then shows one value per step (the retrained one); every
metrics line names the attempt that wrote it; config.yaml is the config the newest
attempt ran with and each attempt's is kept; `--start-over` moves the logs aside with
the run, so the new run's logs and trace begin empty."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import yaml

from train_cli import STEPS, train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="pip install tensorboard")
DASHBOARDS = ["logging.backends=[jsonl,tensorboard]"]  # the harness turns the trace on


def tensorboard_values(log_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def metrics_lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """A finished run, then resumed from its step STEPS - 1 snapshot with one resumable
    setting changed (keep_last): step STEPS is trained twice."""
    run_dir = tmp_path_factory.mktemp("dashboards") / "run"
    first = train(run_dir, overrides=DASHBOARDS)
    assert first.returncode == 0, first.stderr[-3000:]
    snapshot = sorted((run_dir / f"checkpoints/step_{STEPS - 1}/rollout_snapshots").glob("snapshot_*"),
                      key=lambda p: int(p.name.split("_")[1]))[-1]
    again = train(run_dir, "--resume", str(snapshot), overrides=[*DASHBOARDS, "checkpointing.keep_last=7"])
    assert again.returncode == 0, again.stderr[-3000:]
    return run_dir


def test_a_resumed_runs_tensorboard_has_one_value_per_step_the_retrained_one(resumed_run):
    rewards = tensorboard_values(resumed_run / "logs" / "tensorboard", "train/reward_mean")
    assert [step for step, _ in rewards] == list(range(1, STEPS + 1))
    retrained = [e for e in metrics_lines(resumed_run) if e["kind"] == "train_step" and e["attempt"] == 2]
    assert [e["step"] for e in retrained] == [STEPS]
    assert rewards[-1][1] == pytest.approx(retrained[0]["reward_mean"])


def test_every_metrics_line_names_the_attempt_that_wrote_it(resumed_run):
    lines = metrics_lines(resumed_run)
    attempts = [e["attempt"] for e in lines]
    assert attempts == sorted(attempts) and set(attempts) == {1, 2}
    steps = [(e["attempt"], e["step"]) for e in lines if e["kind"] == "train_step"]
    assert steps == [(1, s) for s in range(1, STEPS + 1)] + [(2, STEPS)]


def test_config_yaml_is_what_the_newest_attempt_ran_with_and_each_attempts_is_kept(resumed_run):
    configs = resumed_run / "logs" / "configs"
    assert sorted(p.name for p in configs.iterdir()) == ["attempt_1.yaml", "attempt_2.yaml"]
    assert yaml.safe_load((configs / "attempt_1.yaml").read_text())["checkpointing"]["keep_last"] != 7
    assert yaml.safe_load((configs / "attempt_2.yaml").read_text())["checkpointing"]["keep_last"] == 7
    assert (resumed_run / "config.yaml").read_text() == (configs / "attempt_2.yaml").read_text()


def test_start_over_moves_the_logs_aside_so_the_new_run_starts_them_afresh(resumed_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(resumed_run, run_dir)
    old_lines = (run_dir / "logs" / "metrics.jsonl").read_text()
    done = train(run_dir, "--start-over", overrides=DASHBOARDS)
    assert done.returncode == 0, done.stderr[-3000:]
    (aside,) = (run_dir / "discarded").iterdir()
    assert (aside / "logs" / "metrics.jsonl").read_text() == old_lines
    assert (aside / "logs" / "rollout_trace.sqlite").is_file() and (aside / "logs" / "tensorboard").is_dir()
    assert {e["attempt"] for e in metrics_lines(run_dir)} == {1}
    steps = [e["step"] for e in metrics_lines(run_dir) if e["kind"] == "train_step"]
    assert steps == list(range(1, STEPS + 1))
    rewards = tensorboard_values(run_dir / "logs" / "tensorboard", "train/reward_mean")
    assert [step for step, _ in rewards] == list(range(1, STEPS + 1))
    assert sorted(p.name for p in (run_dir / "logs" / "configs").iterdir()) == ["attempt_1.yaml"]
