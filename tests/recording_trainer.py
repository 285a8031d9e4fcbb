"""A trainer for twin tests: the built-in GRPO trainer with learning rate 0 (the policy
never changes, so two runs sample the same tokens for the same calls) that appends every
group it trains to a JSONL file: prompt id, prompt tokens and, per generation, the tokens
and logprobs.

    trainer.factory: /abs/path/tests/recording_trainer.py:make_trainer
    trainer.options: {record: /abs/path/samples.jsonl}

A group trained again after a kill (its optimizer commit never landed) is recorded twice,
identically: readers compare sets.

With `algorithm.shared_prefix_packing: true` each record also holds `packed`: per
generation, what the packed batch's loss reads (targets, old logprobs as float32, loss
mask), laid out by the same `pack_shared_prefix` call prepare_step makes.
"""

from __future__ import annotations

import json
import os

from rolloutdb.controller.training.grpo import GRPOConfig, GRPOTrainer
from rolloutdb.controller.training.packing import pack_shared_prefix


class RecordingTrainer(GRPOTrainer):
    def __init__(self, policy_dir, config: GRPOConfig, record: str):
        super().__init__(policy_dir, config)
        self.record = record

    def prepare_step(self, groups):  # the train pump's first call of a step (and train_step's)
        with open(self.record, "a") as f:
            for g in groups:
                row = {"prompt_id": g.prompt_id, "group_id": g.group_id,
                       "prompt_ids": g.completions[0].prompt_ids if g.completions else [],
                       "tokens": [c.token_ids for c in g.completions], "logprobs": [c.logprobs for c in g.completions]}
                if self.config.shared_prefix_packing:
                    batch = pack_shared_prefix([g.completions], [0.0] * len(g.completions), self.pad_id)
                    row["packed"] = [[batch.target_ids[b, :len(c.token_ids)].tolist(),
                                      batch.old_logprobs[b, :len(c.token_ids)].tolist(),
                                      batch.loss_mask[b, :len(c.token_ids)].tolist()]
                                     for b, c in enumerate(g.completions)]
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return super().prepare_step(groups)


def make_trainer(context, record: str):
    config = GRPOConfig(lr=0.0, seed=context.config.run.seed,
                        shared_prefix_packing=context.config.algorithm.shared_prefix_packing)
    return RecordingTrainer(context.policy_dir, config, record)
