"""A trainer for twin tests: the built-in GRPO trainer with learning rate 0 (the policy
never changes, so two runs sample the same tokens for the same calls) that appends every
group it trains to a JSONL file: prompt id, prompt tokens and, per generation, the tokens
and logprobs.

    trainer.factory: /abs/path/tests/recording_trainer.py:make_trainer
    trainer.options: {record: /abs/path/samples.jsonl}

A group trained again after a kill (its optimizer commit never landed) is recorded twice,
identically: readers compare sets.
"""

from __future__ import annotations

import json
import os

from rolloutdb.controller.grpo import GRPOConfig, GRPOTrainer


class RecordingTrainer(GRPOTrainer):
    def __init__(self, policy_dir, config: GRPOConfig, record: str):
        super().__init__(policy_dir, config)
        self.record = record

    def train_step(self, groups):
        with open(self.record, "a") as f:
            for g in groups:
                f.write(json.dumps({"prompt_id": g.prompt_id,
                                    "prompt_ids": g.completions[0].prompt_ids if g.completions else [],
                                    "tokens": [c.token_ids for c in g.completions],
                                    "logprobs": [c.logprobs for c in g.completions]}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return super().train_step(groups)


def make_trainer(context, record: str):
    return RecordingTrainer(context.policy_dir, GRPOConfig(lr=0.0, seed=context.config.run.seed), record)
