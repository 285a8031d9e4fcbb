"""The config schema: one YAML file is the trainer integration.

Every section is a pydantic model that refuses unknown keys, so a misspelt key fails
fast with its section named. `docs/config.md` explains every key; `load_config` applies
``KEY=VALUE`` overrides (dotted paths, values parsed as YAML) before validation.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config file or override the schema refuses; the message is one line."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunSection(Section):
    name: str | None = Field(None, description="Run name; defaults to the config file's stem.")
    seed: int = Field(0, description="Seeds the policy init, sampler order and sampling.")


class AlgorithmSection(Section):
    name: Literal["grpo"] = "grpo"
    total_steps: int = Field(30, ge=1)
    groups_per_step: int = Field(8, ge=1, description="Prompt groups trained per optimizer step.")
    group_size: int = Field(8, ge=2, description="Generations per prompt (GRPO needs >= 2).")
    max_staleness: int = Field(
        1, ge=0, description="A group generated under policy version v trains no later than step v + 1 + max_staleness."
    )
    learning_rate: float = Field(3e-3, gt=0)
    clip_eps: float = Field(0.2, gt=0)
    replay_capacity: int = Field(64, ge=1, description="Replay permits: sealed groups waiting to be trained.")
    discard_zero_variance: bool = Field(True, description="Discard groups whose rewards are all equal.")
    max_flat_groups_in_a_row: int = Field(
        256, ge=1, description="After this many zero-variance groups in a row, train on them instead of discarding."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus: keeps a tiny policy from collapsing.")


class PolicySection(Section):
    model_dir: str | None = Field(None, description="A HF Llama directory; null builds the tiny policy in the run dir.")
    hidden_size: int = Field(64, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)


class GenerationSection(Section):
    backend: Literal["reference", "vllm"] = "reference"

    @model_validator(mode="after")
    def _backend_landed(self):
        if self.backend == "vllm":
            raise ValueError("backend 'vllm' is not available yet (the vLLM engine lands later); use 'reference'")
        return self
    max_tokens: int = Field(8, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: list[str] = Field(default_factory=list)
    max_batch_size: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _limits(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self


class EnvironmentSection(Section):
    task: Literal["digits"] = Field("digits", description="The verifiable digit-string task.")
    kind: Literal["copy", "successor", "reverse"] = Field("copy", description="What the answer does to the digits.")
    n_digits: int = Field(3, ge=1, le=12, description="Digits per prompt.")
    turns: int = Field(1, ge=1, le=8, description="1 = single-turn; more = multi-turn episodes.")
    dataset_size: int = Field(512, ge=1)


class CheckpointingSection(Section):
    enabled: bool = True
    interval_steps: int = Field(5, ge=1, description="Publish a trainer checkpoint step_<N>/ every N steps.")
    keep_last: int = Field(2, ge=1, description="Trainer checkpoints kept.")
    resume: str | None = Field(None, description="null: fresh run; 'latest' or a snapshot directory: resume.")


class RolloutRecoverySection(Section):
    target_level: Literal["none", "group", "turn", "prefix"] = Field(
        "group", description="none: no ledger; group: ledger dispatch, unfinished groups redone."
    )

    @model_validator(mode="after")
    def _landed(self):
        if self.target_level in ("turn", "prefix"):
            raise ValueError(
                f"target_level {self.target_level!r} is not available yet (it lands with turn/prefix recovery); use 'group' or 'none'"
            )
        return self


class RolloutCheckpointingSection(Section):
    enabled: bool = Field(False, description="Take rollout snapshots between trainer checkpoints.")
    interval_s: float = Field(5.0, gt=0)
    keep_last: int = Field(3, ge=1)
    trace: bool = Field(False, description="Record trace events in logs/rollout_trace.sqlite.")


class LoggingSection(Section):
    progress: bool = Field(True, description="Show a progress bar on stderr.")
    plot: bool = Field(True, description="Write plots/reward_curve.png at the end.")


class ClusterSection(Section):
    backend: Literal["local", "ray"] = "local"
    torch_threads: int = Field(1, ge=1, description="Torch threads per pump (trainer and engine each).")

    @model_validator(mode="after")
    def _landed(self):
        if self.backend == "ray":
            raise ValueError("backend 'ray' is not available yet (Ray rollout workers land later); use 'local'")
        return self


class Config(Section):
    run: RunSection = Field(default_factory=RunSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    policy: PolicySection = Field(default_factory=PolicySection)
    generation: GenerationSection = Field(default_factory=GenerationSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    checkpointing: CheckpointingSection = Field(default_factory=CheckpointingSection)
    rollout_recovery: RolloutRecoverySection = Field(default_factory=RolloutRecoverySection)
    rollout_checkpointing: RolloutCheckpointingSection = Field(default_factory=RolloutCheckpointingSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)

    @property
    def ledger_dispatch(self) -> bool:
        """Ledger dispatch records every group; with target_level none nothing is recorded."""
        return self.rollout_recovery.target_level != "none"

    def fingerprint(self) -> str:
        """Hash of what a restore must match: the settings that shape rollout state."""
        keyed = {k: getattr(self, k).model_dump() for k in ("algorithm", "policy", "generation", "environment")}
        keyed["algorithm"].pop("total_steps")  # a resumed run may train for longer
        keyed["run"] = {"seed": self.run.seed}
        return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = [str(p) for p in err["loc"]]
    if err["type"] == "extra_forbidden":
        section = ".".join(loc[:-1]) or "top level"
        return f"unknown key {loc[-1]!r} in section {section!r}; see docs/config.md for the keys"
    where = ".".join(loc) or "config"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}"


def apply_override(data: dict, override: str) -> None:
    """Apply one ``a.b.c=VALUE`` override in place; VALUE is parsed as YAML."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not KEY=VALUE (e.g. algorithm.total_steps=5)")
    key, _, raw = override.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r}: empty key part")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part!r} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: value is not valid YAML ({e.problem})") from e


def config_from_dict(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_first_error(e)) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read a YAML config, apply overrides, validate. Errors are one-line ConfigErrors."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; pass --config examples/quickstart.yaml or another file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for override in overrides:
        apply_override(data, override)
    config = config_from_dict(data)
    if config.run.name is None:
        config.run.name = path.stem
    return config
