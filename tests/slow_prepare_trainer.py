"""A trainer whose steps are long before their optimizer commit, for the commit-window
tests (tests/test_commit_window.py) and bench/bench_commit_window.py: the built-in GRPO
trainer whose `prepare_step` spends `prepare_s` more seconds after its backward (the
time a GPU step spends in its forward and backward passes) and whose `commit_step` is
the optimizer step, a few ms.

    trainer.factory: /abs/path/tests/slow_prepare_trainer.py:make_trainer
    trainer.options: {prepare_s: 2.0, staged: true, windows: /abs/path/windows.jsonl}

`staged: false` hands the train pump a trainer with `train_step` only (the same step,
whole under the commit lock: today's behaviour for such trainers). `windows`: each
step's prepare and commit are appended as {"stage", "step", "t_start", "t_end"} (wall
clock, the metrics log's), so a reader can tell which snapshot attempts fell inside one.
`save_s`: every trainer checkpoint takes that many seconds more (a large model's write),
for tests/test_graceful_stop.py's stops that must outlast a second signal or the grace.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rolloutdb.controller.protocols import TrainGroup
from rolloutdb.controller.training.grpo import GRPOConfig, GRPOTrainer, PreparedStep


class SlowPrepareTrainer(GRPOTrainer):
    def __init__(self, policy_dir, config: GRPOConfig, prepare_s: float, windows: str | None, save_s: float = 0.0):
        super().__init__(policy_dir, config)
        self.prepare_s = prepare_s
        self.windows = windows
        self.save_s = save_s

    def save_checkpoint(self, directory: Path) -> list[Path]:
        time.sleep(self.save_s)
        return super().save_checkpoint(directory)

    def prepare_step(self, groups: Sequence[TrainGroup]) -> PreparedStep:
        t_start = time.time()
        prepared = super().prepare_step(groups)
        time.sleep(self.prepare_s)
        self._window("prepare", prepared.step, t_start)
        return prepared

    def commit_step(self, prepared: PreparedStep) -> dict[str, float]:
        t_start = time.time()
        metrics = super().commit_step(prepared)
        self._window("commit", prepared.step, t_start)
        return metrics

    def _window(self, stage: str, step: int, t_start: float) -> None:
        if self.windows:
            with open(self.windows, "a") as f:
                f.write(json.dumps({"stage": stage, "step": step, "t_start": t_start, "t_end": time.time()}) + "\n")


class WholeStepTrainer:
    """The same trainer seen through `Trainer` alone: no `prepare_step`/`commit_step`."""

    def __init__(self, inner: SlowPrepareTrainer):
        self._inner = inner

    @property
    def step(self) -> int:
        return self._inner.step

    def train_step(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        return self._inner.train_step(groups)

    def export_weights(self) -> Mapping[str, Any]:
        return self._inner.export_weights()

    def save_checkpoint(self, directory: Path) -> list[Path]:
        return self._inner.save_checkpoint(directory)

    def load_checkpoint(self, directory: Path) -> None:
        self._inner.load_checkpoint(directory)


def make_trainer(context, prepare_s: float = 1.0, staged: bool = True, windows: str | None = None,
                 lr: float = 1e-3, save_s: float = 0.0):
    config = GRPOConfig(lr=lr, seed=context.config.run.seed, entropy_coef=0.02)
    trainer = SlowPrepareTrainer(context.policy_dir, config, prepare_s, windows, save_s)
    return trainer if staged else WholeStepTrainer(trainer)
