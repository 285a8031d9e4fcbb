"""Build the parts a run needs from its config: policy, trainer, engine, the
environment's checkpoint backend and the trainer-checkpoint publisher. Backend choices
(reference engine or vLLM, environment checkpoint backends) are made here and nowhere
else. The task is built by `controller/tasks/registry.py`, where agent servers and Ray
environment workers build it too."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rolloutdb.config import Config, tiny_policy_heads
from rolloutdb.controller.recovery.env_checkpoint import EnvironmentCheckpoint, NoEnvironmentCheckpoint
from rolloutdb.controller.protocols import Environment, Trainer
from rolloutdb.store import Publisher

if TYPE_CHECKING:  # aiohttp is imported only when a run has agent servers
    from rolloutdb.controller.agent_server.client import AgentPool


def set_threads(n: int) -> None:
    """Torch's intra-op pool is process-wide; both pumps share it. One thread each keeps
    the two pumps from fighting over two cores."""
    torch.set_num_threads(n)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our progress line is the one a user reads


def build_policy(config: Config, dest: Path, dataset=None) -> Path:
    """The initial policy directory: the configured one, or the tiny Llama built (once)
    into the run directory."""
    if config.policy.model_dir:
        path = Path(config.policy.model_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"policy.model_dir {path} is not a Hugging Face model directory (no config.json)")
        return path
    if (dest / "config.json").is_file():
        return dest
    from rolloutdb.controller.tasks.datasets import tiny_policy_alphabet
    from rolloutdb.controller.tasks.digits import TASK_ALPHABET
    from rolloutdb.gpu_capture.tiny_policy import DEFAULT_ALPHABET, build_tiny_policy

    # A tokenizer over the task's own characters: a random policy then writes a digit
    # half the time instead of one time in nine, which is what lets it start learning.
    return build_tiny_policy(
        dest,
        seed=config.run.seed,
        hidden_size=config.policy.hidden_size,
        num_layers=config.policy.num_layers,
        num_heads=tiny_policy_heads(config.policy, config.generation.backend),  # vLLM: head dimension >= 32
        intermediate_size=2 * config.policy.hidden_size,
        alphabet=TASK_ALPHABET if dataset is None else tiny_policy_alphabet(dataset, DEFAULT_ALPHABET),
    )


def build_env_checkpoint(config: Config, agents=None) -> EnvironmentCheckpoint:
    """The snapshot's environment phase: the agent servers' HTTP backend when the run has
    servers (`agents`, from `build_agents`), else `NoEnvironmentCheckpoint` (the embedded
    tasks keep nothing between snapshots: turn-level progress is in the store)."""
    if config.environment.servers:
        if agents is None:
            raise ValueError("a run with environment.servers needs its AgentPool (build_agents) for its checkpoints")
        return agents.checkpoint()
    return NoEnvironmentCheckpoint()


def build_agents(config: Config, engine, *, config_path: Path, policy_dir: Path, log_dir: Path, token_path: Path,
                 log_event=None) -> AgentPool | None:
    """The run's agent servers and its policy endpoint (not started), or None without
    `environment.servers`; the run's token is written to `token_path` when a server needs
    it. aiohttp is imported only here."""
    if not config.environment.servers:
        return None
    from rolloutdb.controller.agent_server.client import AgentPool

    return AgentPool(config, engine, config_path=config_path, policy_dir=policy_dir, log_dir=log_dir,
                     token_path=token_path, log_event=log_event)


def build_trainer(config: Config, policy_dir: Path) -> Trainer:
    from rolloutdb.controller.training.grpo import GRPOConfig, GRPOTrainer

    if config.trainer.factory is not None:
        from rolloutdb.controller.tasks.plugins import PluginContext, make_trainer

        return make_trainer(config.trainer.factory, PluginContext(config=config, policy_dir=policy_dir),
                            config.trainer.options)
    algo = config.algorithm
    return GRPOTrainer(
        policy_dir,
        GRPOConfig(lr=algo.learning_rate, clip_eps=algo.clip_eps, entropy_coef=algo.entropy_coef, seed=config.run.seed,
                   shared_prefix_packing=algo.shared_prefix_packing, temperature=logprob_temperature(config)),
    )


def logprob_temperature(config: Config) -> float:
    """The temperature at which the run's engine reports the logprobs of the tokens it
    samples, which the trainer's importance ratio must match: the reference engine reports
    log-softmax(logits / temperature) at the call's temperature; vLLM reports its raw
    logprobs (temperature 1, vllm_engine.py); greedy calls report at 1."""
    t = config.generation.temperature
    return t if config.generation.backend == "reference" and t > 0 else 1.0


def build_engine(config: Config, policy_dir: Path, work_dir: Path | None = None):
    """The run's one engine: in this process, or (cluster.backend: ray) a pool of Ray
    actors each running `build_local_engine` with the same arguments."""
    cluster = config.cluster
    if cluster.backend == "ray":
        from functools import partial

        from rolloutdb.gpu_capture.ray_workers import RayEnginePool

        # A local cluster offers one CPU per worker of either kind (each reserves one).
        cpus = cluster.ray_num_cpus or cluster.engine_workers + cluster.environment_workers
        return RayEnginePool(partial(build_local_engine, config, policy_dir, work_dir), workers=cluster.engine_workers,
                             address=cluster.address, num_cpus=cpus, worker_gpus=cluster.worker_gpus,
                             placement=cluster.worker_placement)
    return build_local_engine(config, policy_dir, work_dir)


def build_env_stepper(config: Config, env: Environment, policy_dir: Path):
    """Where the environment steps: in the driver on `env` (LocalStepper), or with
    `cluster.environment_workers` on that many Ray actors, each building its own
    environment from the config (after `build_engine`, which starts or joins Ray)."""
    from rolloutdb.controller.rollout.env_steps import LocalStepper

    workers = config.cluster.environment_workers
    if config.cluster.backend != "ray" or not workers:
        return LocalStepper(env)
    from rolloutdb.controller.rollout.ray_environments import EnvironmentWorkerPool

    return EnvironmentWorkerPool(config, policy_dir, workers=workers, placement=config.cluster.worker_placement)


def build_local_engine(config: Config, policy_dir: Path, work_dir: Path | None = None):
    """One engine in this process (in a Ray worker: in that actor's process)."""
    gen = config.generation  # the config refuses backends that have not landed
    if gen.backend == "vllm":
        from rolloutdb.gpu_capture.vllm_engine import VLLMEngine

        return VLLMEngine(policy_dir, max_batch_size=gen.max_batch_size, seed=config.run.seed, work_dir=work_dir,
                          kv_cache_bytes=gen.vllm.kv_cache_mib * 2**20, max_model_len=gen.vllm.max_model_len,
                          prefix_exactness=config.rollout_recovery.prefix_exactness)
    from rolloutdb.gpu_capture.reference_engine import ReferenceEngine

    return ReferenceEngine(policy_dir, max_batch_size=gen.max_batch_size, num_threads=config.cluster.torch_threads,
                           prefix_exactness=config.rollout_recovery.prefix_exactness)


def build_publisher(config: Config, checkpoint_dir: Path) -> Publisher:
    """The one publisher of the run's checkpoint directory, with retention from config."""
    from rolloutdb.store import (
        KeepNewestSnapshotPerAnchor,
        KeepNewestSnapshots,
        KeepNewestTrainerCheckpoints,
        PruneBootstrap,
        Retention,
    )

    retention = Retention(
        KeepNewestSnapshots(config.rollout_checkpointing.keep_last),
        KeepNewestSnapshotPerAnchor(1),
        KeepNewestTrainerCheckpoints(config.checkpointing.keep_last),
        PruneBootstrap(),
    )
    return Publisher(checkpoint_dir, retention=retention)
