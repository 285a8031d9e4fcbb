"""Hostile input, configs: every numeric key at 0, -1, huge, NaN, +-inf, true and a
string (keys found by walking the pydantic model), every key given a mapping, and forged
config.yaml files in a run directory given to `verify`. A refused config leaves no run
directory. Helpers: tests/hostile.py."""

from __future__ import annotations

import math
import shutil

import pytest

from rolloutdb.config import Config
from hostile import assert_refused, run_cli, unchanged, world  # noqa: F401 - world is a fixture

# ----------------------------------------------------------------------------- class 4: configs at their limits


def _numeric_keys() -> list[tuple[str, str, type]]:
    """(section, key, int|float) for every numeric key, found by walking the model."""
    found = []
    for section, field in Config.model_fields.items():
        for key, f in field.annotation.model_fields.items():
            if f.annotation in (int, float):
                found.append((section, key, f.annotation))
    return found


LIMITS = {"zero": 0, "minus one": -1, "huge": 10**30, "huge float": 1e300, "nan": math.nan, "inf": math.inf,
          "-inf": -math.inf, "true": True, "a string": "3"}
# Limit values a key accepts on purpose (anything else must be refused).
ACCEPTED = {
    ("run", "seed", "zero"), ("algorithm", "max_staleness", "zero"), ("algorithm", "entropy_coef", "zero"),
    ("generation", "min_tokens", "zero"), ("generation", "temperature", "zero"),
    # Penalties: -2 to 2, as in OpenAI / vLLM (a negative one favours repeats).
    ("generation", "presence_penalty", "zero"), ("generation", "presence_penalty", "minus one"),
    ("generation", "frequency_penalty", "zero"), ("generation", "frequency_penalty", "minus one"),
    ("cluster", "worker_gpus", "zero"),  # the default: Ray engine workers on CPUs
    ("cluster", "environment_workers", "zero"),  # the default: the environment steps in the driver
    ("run", "shutdown_grace_s", "zero"),  # no grace: the first SIGTERM exits at once (tests/test_graceful_stop.py)
}


def _yaml_value(v) -> str:
    if isinstance(v, bool):
        return "true"
    if isinstance(v, str):
        return "'3'"
    if isinstance(v, float) and math.isnan(v):
        return ".nan"
    if isinstance(v, float) and math.isinf(v):
        return ".inf" if v > 0 else "-.inf"
    return repr(v)


def _limit_cases():
    for section, key, kind in _numeric_keys():
        for name, value in LIMITS.items():
            if kind is int and name == "huge float":
                continue
            yield pytest.param(section, key, name, id=f"{section}.{key}={name}")


def test_the_walk_finds_the_numeric_keys():
    keys = {f"{s}.{k}" for s, k, _ in _numeric_keys()}
    assert {"run.seed", "algorithm.replay_capacity", "policy.hidden_size", "generation.temperature",
            "rollout_checkpointing.interval_s", "cluster.torch_threads"} <= keys


@pytest.mark.parametrize("section,key,name", list(_limit_cases()))
def test_a_config_value_at_its_limit_is_refused_naming_the_key_or_accepted_on_purpose(world, tmp_path, section, key, name):
    from rolloutdb.config import ConfigError, load_config

    override = f"{section}.{key}={_yaml_value(LIMITS[name])}"
    try:
        load_config(world["config"], [override])
    except ConfigError:
        refused = True
    else:
        refused = False
    if (section, key, name) in ACCEPTED:
        assert not refused, override
        return
    assert refused, f"{override} passes validation: it must be refused or listed in ACCEPTED"
    run_dir = tmp_path / "run"
    with unchanged(tmp_path), unchanged(world["base"]):
        r = run_cli("train", "--config", world["config"], "--run-dir", run_dir, override)
    line = assert_refused(r, {2})
    assert f"{section}.{key}" in line, line
    assert not run_dir.exists()


def _all_keys() -> list[tuple[str, str]]:
    return [(section, key) for section, field in Config.model_fields.items()
            for key in field.annotation.model_fields]


@pytest.mark.parametrize("section,key", _all_keys(), ids=[f"{s}.{k}" for s, k in _all_keys()])
def test_every_config_key_refuses_a_mapping_naming_the_key(world, tmp_path, section, key):
    run_dir = tmp_path / "run"
    with unchanged(tmp_path), unchanged(world["base"]):
        r = run_cli("train", "--config", world["config"], "--run-dir", run_dir, f"{section}.{key}={{a: 1}}")
    line = assert_refused(r, {2})
    assert f"{section}.{key}" in line, line
    assert not run_dir.exists()


RUN_CONFIGS = {
    "not YAML": b"algorithm: [\n",
    "not UTF-8": b"\xff\xfe\x00",
    "nested 5000 deep": b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n",
    "a boolean for groups_per_step": b"algorithm:\n  groups_per_step: true\n",
    "a list at the top": b"- 1\n",
}


@pytest.mark.parametrize("name", list(RUN_CONFIGS))
def test_verify_of_a_run_directory_with_a_forged_config_is_refused_in_one_line(world, tmp_path, name):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copyfile(world["store"], run_dir / "rollout_state.sqlite")
    (run_dir / "config.yaml").write_bytes(RUN_CONFIGS[name])
    with unchanged(tmp_path):
        assert_refused(run_cli("verify", run_dir), {1, 2})
