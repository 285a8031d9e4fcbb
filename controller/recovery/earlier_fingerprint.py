"""The config fingerprint as runs written before `Config.fingerprint` hashed the config
minus one declared list carry it in their stores and snapshots (run_meta.config_fingerprint).

A resume computes both: a snapshot that carries this value is accepted, with a notice,
and the restored store is stamped with the current value (store/restore/apply.py
`restore_snapshot`'s `earlier_config_fingerprint`), so the run's later snapshots carry
the current one. Frozen as it was: its key lists are copies, not the config's, so a key
declared resumable later does not change what this returns.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rolloutdb.config import Config, leaf_keys

# The keys this formula left out: the resumable ones and those a check of their own
# refused at resume (the packing, the servers' modes, the dataset's file and fields).
_LEFT_OUT = frozenset({
    "run.name", "algorithm.total_steps", "generation.max_inflight_calls",
    *(f"environment.servers[].{k}" for k in ("url", "lease_s", "start_timeout_s", "episode_timeout_s", "token_file",
                                             "max_agents", "mode")),
    *(f"checkpointing.{k}" for k in ("enabled", "async", "interval_steps", "keep_last", "resume")),
    *(f"rollout_recovery.{k}" for k in ("target_level", "commit_window_ms", "commit_max_events")),
    *(f"rollout_checkpointing.{k}" for k in ("enabled", "interval_s", "keep_last")),
    "trace.enabled", "logging.progress", "logging.plot", "logging.backends",
    *(f"cluster.{k}" for k in ("backend", "torch_threads", "engine_workers", "address", "ray_num_cpus", "worker_gpus",
                               "environment_workers")),
    "algorithm.shared_prefix_packing", "dataset.path", "dataset.prompt_field", "dataset.reward_fields",
})
# Hashed at any value; every other key only away from its default.
_HASHED_AT_ANY_VALUE = frozenset({
    "run.seed",
    *(f"algorithm.{k}" for k in ("name", "groups_per_step", "group_size", "max_staleness", "learning_rate",
                                 "clip_eps", "replay_capacity", "discard_zero_variance", "max_flat_groups_in_a_row",
                                 "entropy_coef")),
    *(f"policy.{k}" for k in ("model_dir", "hidden_size", "num_layers", "num_heads")),
    *(f"generation.{k}" for k in ("backend", "max_tokens", "min_tokens", "temperature", "top_p", "stop",
                                  "max_batch_size")),
    *(f"environment.{k}" for k in ("task", "kind", "n_digits", "turns", "dataset_size")),
})


def _in_use(key: str, config: Config) -> bool | None:
    """Whether a key hashed only in some configurations is in use here; None for the
    others."""
    if key in ("environment.max_digits", "environment.tail_alpha"):
        return config.environment.task != "digits"
    if key == "dataset.chat_template":
        return config.dataset.path is not None
    return None


def earlier_config_fingerprint(config: Config) -> str:
    """`config`'s fingerprint under the earlier formula (see the module docstring)."""
    dumped, defaults = config.model_dump(), Config().model_dump()
    hashed: dict[str, dict[str, Any]] = {}
    for key in leaf_keys(Config):
        # generation.vllm: a section the formula's runs did not have (it hashed sections' own keys).
        if key in _LEFT_OUT or key.startswith(("environment.servers", "generation.vllm.")):
            continue
        section, name = key.split(".", 1)
        value = dumped[section][name]
        in_use = _in_use(key, config)
        if in_use if in_use is not None else key in _HASHED_AT_ANY_VALUE or value != defaults[section][name]:
            hashed.setdefault(section, {})[name] = _canonical(value)
    env = config.environment
    if env.servers:  # which server a prompt meets and its task, kind and turns resolved
        hashed.setdefault("environment", {})["servers"] = [[s.name, env.kind_of(s), env.turns_of(s)]
                                                           for s in env.servers]
    return hashlib.sha256(json.dumps(hashed, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return {k if isinstance(k, str) else f"{type(k).__name__}:{k!r}": _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value
