"""Every setting that changes the rollouts moves the config fingerprint (a restore refuses a
snapshot whose fingerprint differs), derived from the config model, not from a list of
a few keys kept by hand.

The keys come from walking the pydantic model (`leaf_keys`): a key added to the config
is tested here without anyone remembering to (a key in `IN_USE_WHEN`, in a config that
uses it). Each key is in exactly one class:
`RESUMABLE_KEYS` (may change across a resume: the fingerprint stays), `CHECKED_AT_RESUME`
(refused at resume by a check of its own that names it), or frozen: changing it to any
valid value moves the fingerprint. A key dropped from the fingerprint fails the frozen
test with the key in the test's id.
"""

from __future__ import annotations

import copy
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

from rolloutdb.config import (
    CHECKED_AT_RESUME, IN_USE_WHEN, RESUMABLE_KEYS, Config, ConfigError, config_from_dict, fingerprinted, leaf_keys,
    load_config,
)

KEYS = leaf_keys(Config)
FROZEN = [k for k in KEYS if k not in RESUMABLE_KEYS and k not in CHECKED_AT_RESUME]

# Configs a key is changed in, tried in order until the change validates (agent servers,
# factories and environment workers each need settings the plain config lacks).
BASES: dict[str, dict] = {
    "plain": {},
    "servers": {"rollout_recovery": {"target_level": "turn"},
                # a server at a url needs the token file it was started with
                "environment": {"servers": [{"name": "a", "token_file": "/srv/a.token"},
                                            {"name": "b", "mode": "restart_only"}]}},
    "factories": {"environment": {"factory": "envs:make", "options": {"a": 1}},
                  "trainer": {"factory": "trainers:make", "options": {"b": 2}}},
    "ray": {"cluster": {"backend": "ray", "environment_workers": 1}},
    "long_tail": {"environment": {"task": "digits_longtail"}, "generation": {"max_tokens": 97}},
    "dataset": {"dataset": {"path": "prompts.jsonl"}},
}


def _get(data: dict, key: str) -> Any:
    section, name = key.split(".", 1)
    if name.startswith("servers[]."):
        return data[section]["servers"][0][name.removeprefix("servers[].")]
    return data[section][name]


def _set(data: dict, key: str, value: Any) -> dict:
    data = copy.deepcopy(data)
    section, name = key.split(".", 1)
    if name.startswith("servers[]."):
        servers = data.get(section, {}).get("servers")
        if not servers:
            raise KeyError(key)
        servers[0][name.removeprefix("servers[].")] = value
    else:
        data.setdefault(section, {})[name] = value
    return data


def _field(key: str):
    model: Any = Config
    parts = key.replace("[]", "").split(".")
    for part in parts[:-1]:
        annotation = model.model_fields[part].annotation
        model = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else annotation
    return next(f for n, f in model.model_fields.items() if (f.alias or n) == parts[-1])


def alternatives(key: str, current: Any, tmp_path: Path) -> list[Any]:
    """Values to change `key` to, from its annotation (a few keys need a value of a
    shape the annotation cannot tell)."""
    special: dict[str, list[Any]] = {
        "generation.stop": [["\n"]],
        "logging.backends": [["jsonl", "tensorboard"]],
        "dataset.reward_fields": [["answer"]],
        "environment.servers": [[{"name": "z", "mode": "restart_only"}], []],
        "environment.servers[].name": ["c"],
        # null resolves to the environment's kind and turns (copy, 1): a value that differs
        "environment.servers[].kind": ["reverse"],
        "environment.servers[].turns": [2],
        "environment.servers[].token_file": ["/srv/other.token"],
    }
    if key == "policy.model_dir":
        model = tmp_path / "model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text("{}")
        return [str(model)]
    if key in special:
        return special[key]
    annotation = _field(key).annotation
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = [a for a in typing.get_args(annotation) if a is not type(None)] if union else [annotation]
    out: list[Any] = []
    for t in options:
        if typing.get_origin(t) is Literal:
            out += typing.get_args(t)
        elif t is bool:
            out.append(not current)
        elif t is int:
            base = current if isinstance(current, int) else 1
            out += [base + 1, base - 1, base * 2, base // 2, 1, 2]
        elif t is float:
            base = current if isinstance(current, float) else 1.0
            out += [base * 2, base / 2, base + 0.5, 0.5, 1.0]
        elif t is str:
            out += ["other", "mod:fn", "http://127.0.0.1:9/", "other.jsonl"]
        elif typing.get_origin(t) is dict:
            out.append({"k": 1})
        elif typing.get_origin(t) is list:
            out.append(["x"])
    return [v for v in out if v != current]


def changed(key: str, tmp_path: Path) -> tuple[Config, Config] | None:
    """(a config, the same config with only `key` changed), the first base where some
    other value of `key` validates; None for a key of a few allowed values none of which
    validates here (`algorithm.name` has one, `generation.backend: vllm` needs vLLM)."""
    tried = []
    for name, base in BASES.items():
        before = config_from_dict(copy.deepcopy(base))
        if key in IN_USE_WHEN and not IN_USE_WHEN[key](before):
            continue  # read only where the key is in use (the tail of the long-tail task)
        try:
            current = _get(before.model_dump(), key)
        except (KeyError, IndexError):
            continue
        for value in alternatives(key, current, tmp_path):
            try:
                return before, config_from_dict(_set(base, key, value))
            except (ConfigError, KeyError) as e:
                tried.append(f"{name}: {value!r}: {str(e)[:80]}")
    if typing.get_origin(_field(key).annotation) is Literal:
        return None
    raise AssertionError(f"{key}: no value to change it to validates; teach alternatives() one ({tried[:6]})")


@pytest.mark.parametrize("key", FROZEN)
def test_every_setting_not_declared_resumable_moves_the_config_fingerprint(key, tmp_path):
    pair = changed(key, tmp_path)
    if pair is None:  # no other value to try here: the key is hashed at the value it has
        assert key in fingerprinted(Config()), f"{key} is not in the config fingerprint"
        return
    before, after = pair
    assert after.fingerprint() != before.fingerprint(), (
        f"{key} changes what a run makes but not the config fingerprint: a resume with it changed would restore a "
        f"snapshot made under the old value; hash it (rolloutdb/config.py fingerprinted) or declare it in "
        f"RESUMABLE_KEYS with why it cannot change the rollouts")


@pytest.mark.parametrize("key", sorted(RESUMABLE_KEYS))
def test_a_setting_declared_resumable_leaves_the_fingerprint_as_it_was(key, tmp_path):
    pair = changed(key, tmp_path)
    assert pair is not None, key
    before, after = pair
    assert after.fingerprint() == before.fingerprint()


def test_the_declared_lists_name_only_keys_the_config_has_each_once_with_a_reason():
    assert set(RESUMABLE_KEYS) <= set(KEYS), set(RESUMABLE_KEYS) - set(KEYS)
    assert set(CHECKED_AT_RESUME) <= set(KEYS), set(CHECKED_AT_RESUME) - set(KEYS)
    assert not set(RESUMABLE_KEYS) & set(CHECKED_AT_RESUME)
    assert all(reason.strip() for reason in [*RESUMABLE_KEYS.values(), *CHECKED_AT_RESUME.values()])
    assert len(KEYS) == len(set(KEYS)) > 60  # the walk reached every section


def test_a_plugins_options_of_any_yaml_shape_are_fingerprinted(tmp_path):
    # YAML mappings may mix integer and string keys, and hold dates: still one fingerprint,
    # and a changed value moves it.
    path = tmp_path / "c.yaml"
    text = "environment:\n  factory: envs:make\n  options:\n    table: {1: a, b: 2}\n    since: 2026-01-01\n"
    path.write_text(text)
    with_options = load_config(path).fingerprint()
    path.write_text(text.replace("1: a", "1: c"))
    assert load_config(path).fingerprint() != with_options


# --------------------------------------------------------------------------- checked at resume


def _snapshot_with(tmp_path: Path, config: Config) -> Path:
    snap = tmp_path / "step_2" / "snapshot_3"
    snap.mkdir(parents=True)
    (snap / "config.yaml").write_text(config.to_yaml())
    return snap


def _refused_by_check_packing(tmp_path: Path) -> None:
    from rolloutdb.controller.recovery.resume import ResumeError, check_packing

    before, after = changed("algorithm.shared_prefix_packing", tmp_path) or pytest.fail("no change")
    with pytest.raises(ResumeError, match="algorithm.shared_prefix_packing"):
        check_packing(after, _snapshot_with(tmp_path, before))


def _refused_by_check_server_modes(tmp_path: Path) -> None:
    from rolloutdb.controller.recovery.resume import ResumeError, check_server_modes

    before, after = changed("environment.servers[].mode", tmp_path) or pytest.fail("no change")
    with pytest.raises(ResumeError, match="checkpoint mode .*a: export_restore in the snapshot"):
        check_server_modes(after, _snapshot_with(tmp_path, before))


def _dataset_fingerprint_moves(key: str):
    def check(tmp_path: Path) -> None:
        from rolloutdb.controller.tasks.datasets import FileDataset

        one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
        one.write_text('{"prompt": "12", "q": "34", "answer": "1"}\n')
        two.write_text('{"prompt": "12", "q": "34", "answer": "2"}\n')
        base = {"path": one, "prompt_field": "prompt", "reward_fields": None}
        change = {"dataset.path": {"path": two}, "dataset.prompt_field": {"prompt_field": "q"},
                  "dataset.reward_fields": {"reward_fields": ["answer"]}}[key]
        assert FileDataset(**{**base, **change}).fingerprint() != FileDataset(**base).fingerprint()
    return check


CHECKS = {
    "algorithm.shared_prefix_packing": _refused_by_check_packing,
    "environment.servers[].mode": _refused_by_check_server_modes,
    "dataset.path": _dataset_fingerprint_moves("dataset.path"),
    "dataset.prompt_field": _dataset_fingerprint_moves("dataset.prompt_field"),
    "dataset.reward_fields": _dataset_fingerprint_moves("dataset.reward_fields"),
}


@pytest.mark.parametrize("key", sorted(CHECKED_AT_RESUME))
def test_a_setting_left_out_of_the_fingerprint_is_refused_at_resume_by_its_own_check(key, tmp_path):
    assert key in CHECKS, f"{key}: CHECKED_AT_RESUME names no check this test knows; add one to CHECKS"
    CHECKS[key](tmp_path)


# --------------------------------------------------------------------------- older runs


@pytest.mark.parametrize("data, expected", [
    ({}, "7931358db6547444"),
    ({"environment": {"task": "digits_longtail"}, "generation": {"max_tokens": 97}}, "b36f1e8ce0cd8a1b"),
    ({"environment": {"servers": [{"name": "a", "mode": "restart_only", "url": "http://127.0.0.1:9/",
                                   "token_file": "/srv/a.token"},
                                  {"name": "b", "kind": "reverse", "turns": 2, "mode": "restart_only"}]}},
     "0494a1bc44aa2116"),
    ({"dataset": {"path": "x.jsonl", "prompt_field": "q"}}, "2a25139f86cec8bc"),
    ({"generation": {"presence_penalty": 0.5}}, "903991d18c56f138"),
], ids=["default", "long_tail", "servers", "dataset", "penalty"])
def test_a_run_fingerprinted_before_the_keys_were_derived_from_the_model_keeps_its_fingerprint(data, expected):
    # Values computed by the fingerprint before it walked the model (a resumed run's
    # snapshot holds the old value: a new one would refuse every older run's resume).
    assert config_from_dict(data).fingerprint() == expected
