"""A trainer whose step takes a GPU step's time without its cost on this CPU, for
bench/bench_recovery_scale.py: `prepare_step` sleeps `step_s` (the forward and backward
of a real step, seconds), `commit_step` sleeps `commit_s` (the optimizer step, a few ms)
and bumps the version; the tiny policy's weights are never changed. Everything else
(checkpoints synchronous and asynchronous, refit weights, `load_checkpoint`) is the
built-in GRPO trainer's, so checkpoints and resumes are the real ones.

    trainer.factory: /abs/path/bench/scale_trainer.py:make_trainer
    trainer.options: {step_s: 10.0, commit_s: 0.005}

`train_step` is the two in a row, so code without the staged protocol (a revision
before it, under bench/bench_ab.py) holds its commit lock around the whole sleep: what
every trainer got there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rolloutdb.controller.protocols import TrainGroup
from rolloutdb.controller.training.grpo import GRPOConfig, GRPOTrainer


class SleepingTrainer(GRPOTrainer):
    def __init__(self, policy_dir, config: GRPOConfig, step_s: float, commit_s: float):
        super().__init__(policy_dir, config)
        self.step_s = step_s
        self.commit_s = commit_s

    def train_step(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        return self.commit_step(self.prepare_step(groups))

    def prepare_step(self, groups: Sequence[TrainGroup]) -> Any:
        time.sleep(self.step_s)
        tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
        return (self._step + 1, {"loss": 0.0, "policy_tokens": float(tokens), "sequences": float(
            sum(len(g.completions) for g in groups))})

    def commit_step(self, prepared: Any) -> dict[str, float]:
        step, metrics = prepared
        if step != self._step + 1:
            raise ValueError(f"a step prepared as step {step} cannot be committed at step {self._step + 1}")
        time.sleep(self.commit_s)
        self._step += 1
        return dict(metrics)


def make_trainer(context, step_s: float = 10.0, commit_s: float = 0.005):
    return SleepingTrainer(context.policy_dir, GRPOConfig(seed=context.config.run.seed), step_s, commit_s)
