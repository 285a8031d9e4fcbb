"""A trainer by import path: `trainer.factory: ./trainer.py:make_trainer`.

Any object with the members of `rolloutdb.controller.protocols.Trainer` works; this one
is the built-in GRPO trainer, configured from the section's `options:` mapping, to show
the shape of a factory: factory(context, **options) -> Trainer.

It is also a `StagedTrainer` (same module): `prepare_step` runs the forward and backward
passes and `commit_step` the optimizer step, so the train pump holds the commit lock
only around the commit and snapshots are cut during the rest of a step. A trainer of
your own gets that by offering both methods (and `train_step` as the two in a row);
with `train_step` alone no snapshot is cut while a step runs.
"""

from __future__ import annotations

from rolloutdb.controller.training.grpo import GRPOConfig, GRPOTrainer


def make_trainer(context, lr: float = 1e-3, entropy_coef: float = 0.02, clip_eps: float = 0.2):
    seed = context.config.run.seed if context.config is not None else 0
    return GRPOTrainer(context.policy_dir, GRPOConfig(lr=lr, entropy_coef=entropy_coef, clip_eps=clip_eps, seed=seed))
