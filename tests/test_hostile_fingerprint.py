"""What may change across a resume is one declared list, `RESUMABLE_KEYS` (each with
why); every other setting is frozen into the config fingerprint, which a restore checks.

The keys come from walking the pydantic model (`leaf_keys`): a key added to the config
is tested here without anyone remembering to. Each key is either declared resumable
(changing it leaves the fingerprint, and a restore takes the snapshot) or frozen
(changing it to any valid value moves the fingerprint, and a restore refuses the
snapshot). A key dropped from the fingerprint fails the frozen test with the key in the
test's id. Runs fingerprinted by the earlier formula still resume (the last section).
"""

from __future__ import annotations

import copy
import sqlite3
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from rolloutdb.config import (
    RESUMABLE_KEYS, Config, ConfigError, config_from_dict, frozen_settings, leaf_keys, load_config,
)
from rolloutdb.controller.recovery.earlier_fingerprint import earlier_config_fingerprint

REPO = Path(__file__).resolve().parent.parent
KEYS = leaf_keys(Config)
FROZEN = [k for k in KEYS if k not in RESUMABLE_KEYS]

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
    for part in name.split(".")[:-1]:  # a section inside a section (generation.vllm)
        data = data[section]
        section, name = part, name.split(".", 1)[1]
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
        inner = data.setdefault(section, {})
        *sections, leaf = name.split(".")
        for part in sections:  # a section inside a section (generation.vllm)
            inner = inner.setdefault(part, {})
        inner[leaf] = value
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
        "generation.vllm.max_model_len": [128],
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


def _set_unvalidated(config: Config, key: str, value: Any) -> Config:
    """`config` with `key` set to a value validation refuses here (vLLM is not
    installed), to see whether the fingerprint would hash it."""
    section, name = key.split(".", 1)
    part = getattr(config, section).model_copy(update={name: value})
    return config.model_copy(update={section: part})


@pytest.mark.parametrize("key", FROZEN)
def test_every_setting_not_declared_resumable_moves_the_config_fingerprint(key, tmp_path):
    pair = changed(key, tmp_path)
    if pair is None:  # no other value validates here: set one past validation
        others = [v for v in typing.get_args(_field(key).annotation) if v != _get(Config().model_dump(), key)]
        pair = Config(), _set_unvalidated(Config(), key, (others or ["a_later_value"])[0])
    before, after = pair
    assert after.fingerprint() != before.fingerprint(), (
        f"{key} changes what a run makes but not the config fingerprint: a resume with it changed would restore a "
        f"snapshot made under the old value; declare it in RESUMABLE_KEYS (rolloutdb/config.py) with why it "
        f"cannot change the rollouts, or let the fingerprint hash it")


@pytest.mark.parametrize("key", sorted(RESUMABLE_KEYS))
def test_a_setting_declared_resumable_leaves_the_fingerprint_as_it_was(key, tmp_path):
    pair = changed(key, tmp_path)
    assert pair is not None, key
    before, after = pair
    assert after.fingerprint() == before.fingerprint()


def test_the_declared_list_names_only_keys_the_config_has_each_with_a_reason():
    assert set(RESUMABLE_KEYS) <= set(KEYS), set(RESUMABLE_KEYS) - set(KEYS)
    assert all(reason.strip() and "\n" not in reason for reason in RESUMABLE_KEYS.values())
    assert len(KEYS) == len(set(KEYS)) > 60  # the walk reached every section


def test_the_fingerprint_hashes_every_frozen_key_away_from_its_default_and_nothing_else():
    # The one rule: a key at its default is left out (so a key added later keeps every
    # earlier run's fingerprint), any other value of a frozen key is in, a resumable one never.
    assert frozen_settings(Config()) == {}
    config = config_from_dict({"algorithm": {"group_size": 4, "total_steps": 9}, "logging": {"plot": False},
                               "environment": {"servers": [{"name": "a", "url": "http://127.0.0.1:9/",
                                                            "token_file": "/srv/a.token"}]},
                               "rollout_recovery": {"target_level": "turn"}})
    assert frozen_settings(config) == {"algorithm.group_size": 4,
                                       "environment.servers": [{"environment.servers[].name": "a"}]}


def test_a_plugins_options_of_any_yaml_shape_are_fingerprinted(tmp_path):
    # YAML mappings may mix integer and string keys, and hold dates: still one fingerprint,
    # and a changed value moves it.
    path = tmp_path / "c.yaml"
    text = "environment:\n  factory: envs:make\n  options:\n    table: {1: a, b: 2}\n    since: 2026-01-01\n"
    path.write_text(text)
    with_options = load_config(path).fingerprint()
    path.write_text(text.replace("1: a", "1: c"))
    assert load_config(path).fingerprint() != with_options


# --------------------------------------------------------------------------- a resume, for real


def _run_with_snapshot(root: Path, config_fingerprint: str) -> Path:
    """A store whose run_meta carries `config_fingerprint`, published as a snapshot the
    way the controller publishes one; returns the snapshot directory."""
    from rolloutdb.store import Publisher, Store

    store = Store.create(root / "run" / "rollout_state.sqlite", config_fingerprint=config_fingerprint,
                         dataset_fingerprint="data", forest_training={"enabled": False}, ledger_dispatch=True,
                         replay_capacity=8)
    pub = Publisher(root / "ckpt")
    pub.publish_trainer_checkpoint(None, lambda d: (d / "weights.bin").write_bytes(b"w"))
    snap = pub.publish_rollout_snapshot("bootstrap", lambda p: store.capture(p), config_text="{}\n").path
    store.close()
    return snap


def _resume(snap: Path, live: Path, config: Config):
    from rolloutdb.store.restore.apply import restore_snapshot

    return restore_snapshot(snap, live, config_fingerprint=config.fingerprint(),
                            earlier_config_fingerprint=earlier_config_fingerprint(config), dataset_fingerprint="data",
                            forest_training={"enabled": False}, groups_per_step=1)


def _stored_fingerprint(live: Path) -> str:
    with sqlite3.connect(live) as conn:
        return conn.execute("SELECT config_fingerprint FROM run_meta").fetchone()[0]


def _example(name: str) -> dict:
    data = yaml.safe_load((REPO / "examples" / name).read_text())
    data.setdefault("run", {})["name"] = Path(name).stem
    return data


@pytest.mark.parametrize("example", ["quickstart.yaml", "multiturn.yaml", "agent_server.yaml"])
def test_a_restore_refuses_a_changed_frozen_key_and_takes_a_changed_resumable_one_in_the_example_configs(
        example, tmp_path):
    from rolloutdb.store.errors import RunMismatch

    data = _example(example)
    started = config_from_dict(copy.deepcopy(data))
    snap = _run_with_snapshot(tmp_path, started.fingerprint())
    tried: dict[str, list[str]] = {"refused": [], "taken": []}
    for n, key in enumerate(KEYS):
        try:
            current = _get(started.model_dump(), key)
        except (KeyError, IndexError):
            continue  # a server's key in a config without servers
        for value in alternatives(key, current, tmp_path):
            try:
                resumed = config_from_dict(_set(data, key, value))
            except (ConfigError, KeyError):
                continue
            live = tmp_path / f"live_{n}" / "rollout_state.sqlite"
            live.parent.mkdir()
            if key in RESUMABLE_KEYS:
                plan = _resume(snap, live, resumed)
                assert plan.config_fingerprint_was is None, key
                tried["taken"].append(key)
            else:
                with pytest.raises(RunMismatch, match="config fingerprint") as refused:
                    _resume(snap, live, resumed)
                assert refused.value.fields == ["config_fingerprint"], key
                assert not live.exists(), key
                tried["refused"].append(key)
            break
    # the file's own frozen keys and most of the resumable ones were tried
    assert len(tried["refused"]) > 30 and len(tried["taken"]) > 20, tried


# --------------------------------------------------------------------------- checked at resume as well


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


@pytest.mark.parametrize("check", [_refused_by_check_packing, _refused_by_check_server_modes],
                         ids=["algorithm.shared_prefix_packing", "environment.servers[].mode"])
def test_a_frozen_setting_with_a_check_of_its_own_is_refused_naming_it_before_the_restore(check, tmp_path):
    # Frozen, and refused first by a check that can say which key differs (a fingerprint
    # cannot): controller/recovery/resume.py runs these before the restore.
    check(tmp_path)


def test_the_dataset_file_may_move_across_a_resume_because_its_content_is_checked(tmp_path):
    from rolloutdb.controller.tasks.datasets import FileDataset

    one, moved, other = tmp_path / "one.jsonl", tmp_path / "moved.jsonl", tmp_path / "other.jsonl"
    one.write_text('{"prompt": "12", "answer": "1"}\n')
    moved.write_text(one.read_text())
    other.write_text('{"prompt": "12", "answer": "2"}\n')
    assert "dataset.path" in RESUMABLE_KEYS
    assert FileDataset(moved).fingerprint() == FileDataset(one).fingerprint()
    assert FileDataset(other).fingerprint() != FileDataset(one).fingerprint()


# --------------------------------------------------------------------------- runs of the earlier formula

# Made by the earlier formula itself: `Config.fingerprint()` at commit 99227be (before the
# fingerprint was the config minus RESUMABLE_KEYS), run on these configs. A run started
# then carries these values in its store and snapshots (run_meta.config_fingerprint).
EARLIER = [
    ({}, "7931358db6547444"),
    ({"environment": {"task": "digits_longtail"}, "generation": {"max_tokens": 97}}, "b36f1e8ce0cd8a1b"),
    ({"environment": {"servers": [{"name": "a", "mode": "restart_only", "url": "http://127.0.0.1:9/",
                                   "token_file": "/srv/a.token"},
                                  {"name": "b", "kind": "reverse", "turns": 2, "mode": "restart_only"}]}},
     "0494a1bc44aa2116"),
    ({"dataset": {"path": "x.jsonl", "prompt_field": "q"}}, "2a25139f86cec8bc"),
    ({"generation": {"presence_penalty": 0.5}}, "903991d18c56f138"),
    ("quickstart.yaml", "c63b555bd3a5dfb6"),
    ("multiturn.yaml", "03b3b2a73c849774"),
    ("agent_server.yaml", "5a834958680e152b"),
]


def _config(data: dict | str) -> Config:
    return load_config(REPO / "examples" / data) if isinstance(data, str) else config_from_dict(data)


@pytest.mark.parametrize("data, expected", EARLIER,
                         ids=["default", "long_tail", "servers", "dataset", "penalty", "quickstart", "multiturn",
                              "agent_server"])
def test_the_earlier_formula_gives_the_value_runs_of_that_time_carry(data, expected):
    assert earlier_config_fingerprint(_config(data)) == expected
    assert _config(data).fingerprint() != expected  # so accepting it is a separate, tested, path


def test_a_run_of_the_earlier_formula_resumes_once_and_then_carries_the_current_fingerprint(
        tmp_path):
    from rolloutdb.store.errors import RunMismatch
    from rolloutdb.store.restore.apply import restore_snapshot

    config = load_config(REPO / "examples" / "quickstart.yaml")
    snap = _run_with_snapshot(tmp_path, "c63b555bd3a5dfb6")  # EARLIER: quickstart.yaml
    live = tmp_path / "live" / "rollout_state.sqlite"
    live.parent.mkdir()
    with pytest.raises(RunMismatch, match="config fingerprint c63b555bd3a5dfb6"):  # the current formula alone
        restore_snapshot(snap, live, config_fingerprint=config.fingerprint(), dataset_fingerprint="data",
                         forest_training={"enabled": False}, groups_per_step=1)
    plan = _resume(snap, live, config)
    assert plan.config_fingerprint_was == "c63b555bd3a5dfb6"
    assert _stored_fingerprint(live) == config.fingerprint()  # the run's later snapshots carry the current one
    # Another config is still refused, whichever formula it is hashed with.
    other = load_config(REPO / "examples" / "quickstart.yaml", ["algorithm.group_size=4"])
    with pytest.raises(RunMismatch, match="config fingerprint"):
        _resume(snap, tmp_path / "live" / "again.sqlite", other)
