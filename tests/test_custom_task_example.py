"""examples/custom_task end to end: `rolloutdb train` on its own JSONL, reward file and
trainer factory, in a real subprocess on the CPU. Four steps: the reward curve and the
TensorBoard events are produced (learning is not required); a resume against a changed
prompts file is refused; a bad import path is refused with nothing written.

The example is copied into tmp_path (its paths are relative to its config), so the
committed files are never touched."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_task"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs pip install tensorboard"),
]


def train(config: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rolloutdb", "train", "--config", str(config), "--run-dir", str(run_dir), *args],
        capture_output=True, text=True, timeout=300, cwd=config.parent.parent,
        env=dict(os.environ, RAY_AUTH_MODE="disabled"),
    )


@pytest.fixture
def example(tmp_path) -> Path:
    copy = tmp_path / "custom_task"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_the_example_trains_on_its_own_prompts_reward_and_trainer_and_draws_the_reward_curve(example, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    done = train(example / "config.yaml", run)
    assert done.returncode == 0, done.stderr
    steps = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in steps if e["kind"] == "train_step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert all(0.0 <= e["reward_mean"] <= 1.0 for e in steps)
    assert (run / "plots" / "reward_curve.png").stat().st_size > 0
    events = EventAccumulator(str(run / "logs" / "tensorboard"))
    events.Reload()
    shown = [(e.step, e.value) for e in events.Scalars("train/reward_mean")]
    assert shown == [(e["step"], pytest.approx(e["reward_mean"], rel=1e-6)) for e in steps]

    # The same run, resumed against a prompts file with one changed word: refused.
    prompts = example / "prompts.jsonl"
    prompts.write_text(prompts.read_text().replace("boxes", "crates", 1))
    done = train(example / "config.yaml", run, "--resume", "algorithm.total_steps=6")
    assert done.returncode != 0
    assert "dataset fingerprint" in done.stderr and "Traceback" not in done.stderr


def test_a_bad_reward_path_is_refused_in_one_line_before_the_run_directory_exists(example, tmp_path):
    run = tmp_path / "run"
    done = train(example / "config.yaml", run, "reward.function=./reward.py:scor")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: reward.function: {(example / 'reward.py').resolve()} has no attribute 'scor'; it defines score"]
    assert not run.exists()
