"""Hostile class: no setting silently ruins a run (issue 26, item 2).

A temperature of 1e-40 was accepted (`ge=0`): its logits / temperature overflowed
float32, every token came out id 0 with logprob NaN, the loss was NaN from step 1, the
run exited 0 and `verify` said ok. The policy endpoint answered a bare `NaN` (not JSON)
for temperature 1e-300 and took penalties of 1e308. Here: the config, the endpoint (a
real aiohttp server over a real engine) and the engines refuse those values with the
bounds of `rolloutdb/sampling_limits.py`; the endpoint's answers are strict JSON; and a
real `rolloutdb train` whose loss turns non-finite (a trainer factory's learning rate,
accepted before and after) stops with one line naming the step, before any checkpoint
of non-finite weights is published (read back through safetensors' numpy reader).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rolloutdb.config import ConfigError, config_from_dict
from rolloutdb.controller.protocols import Completion, NonFiniteTraining, TrainGroup
from rolloutdb.gpu_capture.protocol import GenerationRequest, SamplingParams
from rolloutdb.gpu_capture.reference_engine import ReferenceEngine
from rolloutdb.gpu_capture.tiny_policy import build_tiny_policy

ROOT = Path(__file__).resolve().parents[1]

# (override, what the one error line must say besides the key); each was accepted before.
# Penalties beyond [-2, 2] were refused already (tests/test_hostile_configs.py).
BAD_SETTINGS = {
    "temperature 1e-40": ("generation.temperature=1e-40", "use 0 for greedy decoding"),
    "temperature 1e-300": ("generation.temperature=1e-300", "use 0 for greedy decoding"),
    "temperature 0.005": ("generation.temperature=0.005", "at least 0.01"),
}


@pytest.mark.parametrize("case", BAD_SETTINGS)
def test_a_temperature_that_would_overflow_float32_is_refused_naming_the_key_and_what_to_use(tmp_path, case):
    from rolloutdb import cli

    override, words = BAD_SETTINGS[case]
    config = tmp_path / "c.yaml"
    config.write_text("{}\n")
    run_dir = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["train", "--config", str(config), "--run-dir", str(run_dir), override])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1, err.getvalue()
    assert lines[0].startswith(f"error: {override.split('=')[0]}: "), lines[0]
    assert words in lines[0], lines[0]
    assert not run_dir.exists()


def test_the_temperature_line_is_drawn_at_the_shared_bound_with_greedy_and_the_largest_still_accepted():
    from rolloutdb import sampling_limits as limits

    for accepted in (0.0, limits.MIN_TEMPERATURE, limits.MAX_TEMPERATURE):
        assert config_from_dict({"generation": {"temperature": accepted}}).generation.temperature == accepted
    with pytest.raises(ConfigError, match=f"at least {limits.MIN_TEMPERATURE}"):
        config_from_dict({"generation": {"temperature": math.nextafter(limits.MIN_TEMPERATURE, 0)}})


# ------------------------------------------------------------------- engines and the endpoint


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    from rolloutdb.controller.tasks.digits import TASK_ALPHABET

    return build_tiny_policy(tmp_path_factory.mktemp("policy"), seed=0, hidden_size=32, num_layers=1,
                             num_heads=4, intermediate_size=64, alphabet=TASK_ALPHABET)


ENGINE_CASES = {
    "temperature 1e-40": {"temperature": 1e-40},
    "temperature 1e-300": {"temperature": 1e-300},
    "presence penalty 1e308": {"presence_penalty": 1e308},
    "frequency penalty -1e308": {"frequency_penalty": -1e308},
}


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_the_engine_refuses_a_call_whose_sampling_would_overflow_before_queueing_it(policy_dir, case):
    with ReferenceEngine(policy_dir, max_batch_size=2, num_threads=1) as engine:
        params = SamplingParams(max_tokens=3, **ENGINE_CASES[case])
        with pytest.raises(ValueError, match=next(iter(ENGINE_CASES[case]))):
            engine.submit(GenerationRequest("r", [1, 2, 3], params))
        assert engine.running_tokens() == {}


def _strict(text: str):
    """json.loads that refuses NaN and Infinity, as every strict JSON parser does."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


@contextlib.contextmanager
def endpoint_over(engine):
    from rolloutdb.controller.agent_server.http_loop import HttpLoop
    from rolloutdb.controller.agent_server.policy_endpoint import PolicyEndpoint

    loop = HttpLoop()
    from agent_server_world import TOKEN  # `request` sends it

    endpoint = PolicyEndpoint(engine, loop, owner=lambda key: key, tokens=[TOKEN])
    try:
        endpoint.start()
        yield endpoint
    finally:
        endpoint.close()
        loop.close()


def _post(url: str, body: dict | bytes) -> tuple[int, str]:
    from agent_server_world import request

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(url, "POST", "/v1/completions", raw=raw,
                   headers={"X-Rolloutdb-Episode": "5.0-a0", "X-Rolloutdb-Turn": "0"})


CALL = {"prompt": [1, 2, 3], "max_tokens": 3, "seed": 1}
ENDPOINT_CASES = {
    "temperature 1e-300": ({**CALL, "temperature": 1e-300}, "temperature"),
    "temperature 1e-40": ({**CALL, "temperature": 1e-40}, "temperature"),
    "presence penalty 1e308": ({**CALL, "presence_penalty": 1e308}, "presence_penalty"),
    "presence penalty -1e308": ({**CALL, "presence_penalty": -1e308}, "presence_penalty"),
    "frequency penalty 1e308": ({**CALL, "frequency_penalty": 1e308}, "frequency_penalty"),
    "temperature 101": ({**CALL, "temperature": 101}, "temperature"),
    "top_k, which no engine implements": ({**CALL, "top_k": 5}, "top_k"),
    "logit_bias, which no engine implements": ({**CALL, "logit_bias": {"7": 100}}, "logit_bias"),
}


@pytest.fixture(scope="module")
def served(policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1) as engine, endpoint_over(engine) as endpoint:
        yield endpoint


@pytest.mark.parametrize("case", ENDPOINT_CASES)
def test_the_policy_endpoint_refuses_sampling_that_would_overflow_with_400_and_one_json_line(served, case):
    body, field = ENDPOINT_CASES[case]
    calls = served.calls
    status, text = _post(served.url, body)
    assert status == 400, (status, text)
    answer = _strict(text)
    assert set(answer) == {"error"} and "\n" not in answer["error"] and f"'{field}'" in answer["error"], answer
    assert served.calls == calls


def test_the_policy_endpoint_draws_the_line_where_the_config_does_and_answers_in_strict_json(served):
    """Greedy, the smallest temperature and the neutral value of a field no engine
    implements are answered; just below the smallest temperature is refused."""
    for extra in ({"temperature": 0}, {"temperature": 0.01}, {"top_k": -1, "min_p": 0}):
        status, text = _post(served.url, {**CALL, **extra})
        assert status == 200, (extra, text)
        logprobs = _strict(text)["choices"][0]["logprobs"]["token_logprobs"]
        assert len(logprobs) == 3 and all(math.isfinite(lp) for lp in logprobs)
    status, text = _post(served.url, {**CALL, "temperature": 0.005})
    assert status == 400 and "at least 0.01" in _strict(text)["error"], (status, text)


def test_the_policy_endpoint_never_answers_a_bare_nan_even_from_broken_weights(policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=2, num_threads=1) as engine:
        broken = {k: torch.full_like(v, float("nan")) for k, v in engine.model.state_dict().items()}
        engine.load_weights(broken, 1)
        with endpoint_over(engine) as endpoint:
            status, text = _post(endpoint.url, CALL)
    assert status == 500, (status, text)
    error = _strict(text)["error"]
    assert "nan" in error and "5.0-a0-t0" in error and "\n" not in error, error


# ------------------------------------------------------------------- the trainer


def test_a_step_whose_loss_is_not_finite_raises_naming_the_step_and_applies_nothing(policy_dir):
    from rolloutdb.controller.training.grpo import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(policy_dir, GRPOConfig(lr=1e-2))
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    prompt, replies = [3, 4, 5], [[6, 7], [8, 9]]
    # An infinite reward: its group's advantages are NaN, so the loss is.
    group = TrainGroup(0, 0, [Completion(prompt, r, trainer.logprobs_of(prompt, r), [0, 0], reward)
                              for r, reward in zip(replies, [math.inf, 0.0])])
    with pytest.raises(NonFiniteTraining, match=r"^step 1: the loss is nan, so the run stops before"):
        trainer.train_step([group])
    assert trainer.step == 0
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(trainer.optimizer.state.values())  # no moment was updated either


# ------------------------------------------------------------------- a real run


def _published_checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "checkpoints").iterdir() if (p / "manifest.json").is_file())


def _non_finite_tensors(checkpoint: Path) -> list[str]:
    """Read with safetensors' numpy reader, not the trainer's torch loader."""
    from safetensors.numpy import load_file

    bad = []
    for file in sorted(checkpoint.glob("*.safetensors")):
        for name, array in load_file(file).items():
            if array.dtype.kind == "f" and not np.isfinite(array).all():
                bad.append(f"{file.name}:{name}")
    return bad


@pytest.mark.timeout(600)  # ~60-110 s each on 2 busy cores (2026-12-02); the NaN run it replaced took > 300 s
@pytest.mark.parametrize("staleness,what", [(0, "logprob"), (1, "")], ids=["on-policy", "one step stale"])
def test_a_run_whose_learning_rate_blows_the_weights_up_stops_at_that_step_and_publishes_no_nan_weights(
        tmp_path, staleness, what):
    """examples/custom_task's trainer factory with lr 1e30 (a typo's worth of exponent):
    step 1 trains, and its weights make the next step's logits overflow. Before, the run
    trained on NaN to its last step, exited 0 and published checkpoints of NaN weights.
    On policy the engine's logprobs are the first non-finite number; one step stale the
    step-2 groups may come from the first weights, and the loss is."""
    example = tmp_path / "custom_task"
    shutil.copytree(ROOT / "examples" / "custom_task", example, ignore=shutil.ignore_patterns("__pycache__"))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rolloutdb", "train", "--config", str(example / "config.yaml"), "--run-dir",
         str(run_dir), "trainer.options.lr=1e30", "checkpointing.interval_steps=1", "logging.backends=[jsonl]",
         "rollout_checkpointing.enabled=false", f"algorithm.max_staleness={staleness}", "algorithm.total_steps=2"],
        capture_output=True, text=True, timeout=540, env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]  # beside the progress bar
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: step 2: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "nan" in lines[0] and what in lines[0] and "before that step is committed" in lines[0], lines[0]
    trained = [json.loads(line)["step"] for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "train_step"]
    assert trained == [1]
    published = _published_checkpoints(run_dir)
    assert [p.name for p in published if p.name.startswith("step_")] == ["step_1"]
    for checkpoint in published:
        assert _non_finite_tensors(checkpoint) == [], checkpoint
