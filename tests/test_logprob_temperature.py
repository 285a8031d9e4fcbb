"""The trainer's importance ratio is taken at the temperature the engine reported its
logprobs at (controller/job/build.py `logprob_temperature`).

The reference engine reports log-softmax(logits / temperature); the trainer computed at
temperature 1, so at any other temperature even the first step's samples, drawn by the very
weights being trained, looked off-policy (ratio 1.019 at temperature 0.6, measured). The
arithmetic is pinned in tests/test_grpo.py; this is the run a user starts.
"""

from __future__ import annotations

import json

import pytest
from train_cli import train

from rolloutdb.config import config_from_dict
from rolloutdb.controller.job.build import logprob_temperature


def test_the_first_step_of_a_run_sampling_at_temperature_0_6_trains_on_policy_with_ratio_one(tmp_path):
    run = tmp_path / "run"
    result = train(run, overrides=["generation.temperature=0.6"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    first = next(line for line in lines if "ratio_mean" in line)
    # Step 1 trains on samples of version 0 only: the weights it starts from.
    assert first["step"] == 1
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and first["clip_fraction"] == 0.0


@pytest.mark.parametrize(("generation", "expected"), [
    ({"temperature": 0.6}, 0.6),
    ({"temperature": 1.3}, 1.3),
    ({"temperature": 0.0}, 1.0),  # greedy calls report at temperature 1
])
def test_the_reference_engine_reports_at_the_calls_temperature(generation, expected):
    assert logprob_temperature(config_from_dict({"generation": generation})) == expected


def test_vllm_reports_raw_logprobs_at_temperature_1_whatever_the_calls_temperature():
    """vllm_engine.py asks vLLM for its raw logprobs (its test_vllm_engine.py checks them
    against the HF model at temperature 1). Built past validation, which needs vLLM
    installed to accept backend: vllm."""
    config = config_from_dict({"generation": {"temperature": 0.6}})
    config = config.model_copy(update={"generation": config.generation.model_copy(update={"backend": "vllm"})})
    assert logprob_temperature(config) == 1.0
