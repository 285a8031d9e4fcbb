"""The task a run learns, built from its config in one place: the rollout pump's driver,
every agent server (`agent_server/env_server.py`) and every Ray environment worker
(`rollout/ray_environments.py`) call `build_task`, so they build the same dataset and
environment from the same config.

The built-in tasks are one table, `TASKS`: a name, how its prompts are built from the
config, and its single-turn and multi-turn environments. The config accepts exactly the
names `rolloutdb.config.TASK_NAMES` declares (the config may not import the controller);
tests/test_tasks.py keeps the two equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutdb.config import Config, EnvironmentSection
from rolloutdb.controller.protocols import Environment, PromptDataset
from rolloutdb.controller.tasks import plugins
from rolloutdb.controller.tasks.digits import (
    DigitPromptDataset,
    DigitPrompts,
    LongTailDigitDataset,
    LongTailMultiTurnEnv,
    LongTailSingleTurnEnv,
    MultiTurnDigitEnv,
    SingleTurnDigitEnv,
)

MULTI_TURN = "_multiturn"  # make_environment's name of a task's multi-turn environment


@dataclass(frozen=True)
class BuiltInTask:
    """One built-in task: its prompts (from the environment section and the run's
    seed) and the environment for one turn and for several (`turns` > 1)."""

    name: str
    prompts: Callable[[EnvironmentSection, int], DigitPromptDataset | LongTailDigitDataset]
    single_turn: type[SingleTurnDigitEnv]
    multi_turn: type[MultiTurnDigitEnv]


TASKS: dict[str, BuiltInTask] = {task.name: task for task in (
    BuiltInTask("digits", lambda env, seed: DigitPromptDataset(size=env.dataset_size, n_digits=env.n_digits, seed=seed),
                SingleTurnDigitEnv, MultiTurnDigitEnv),
    BuiltInTask("digits_longtail",
                lambda env, seed: LongTailDigitDataset(size=env.dataset_size, max_digits=env.max_digits,
                                                       tail_alpha=env.tail_alpha, seed=seed),
                LongTailSingleTurnEnv, LongTailMultiTurnEnv),
)}
# Every environment `make_environment` builds: each task's, and its multi-turn one.
ENVIRONMENTS = tuple(name for task in TASKS for name in (task, task + MULTI_TURN))


def make_environment(name: str, dataset: DigitPrompts, tokenizer: Any, kind: str = "copy", turns: int = 3):
    """Build an environment by name (`ENVIRONMENTS`): a task's name for its single-turn
    environment, with `_multiturn` for its `turns`-turn one; the long-tail ones want a
    `LongTailDigitDataset`."""
    task = TASKS.get(name.removesuffix(MULTI_TURN))
    if task is None:
        raise ValueError(f"unknown environment {name!r}; choose one of {', '.join(ENVIRONMENTS)}")
    if name.endswith(MULTI_TURN):
        return task.multi_turn(dataset, tokenizer, kind=kind, turns=turns)
    return task.single_turn(dataset, tokenizer, kind=kind)


def check_plugins(config: Config):
    """The policy's config, the dataset file and every import path, checked before
    anything is written."""
    return plugins.check_config(config)


def build_task(config: Config, policy_dir: Path, found=None) -> tuple[PromptDataset, Environment]:
    """(dataset, environment) for the configured task."""
    from transformers import AutoTokenizer

    env_cfg = config.environment
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    task = TASKS[env_cfg.task]
    dataset = task.prompts(env_cfg, config.run.seed)
    if found is not None:
        context = plugins.PluginContext(config=config, policy_dir=policy_dir)
        custom = plugins.build_task(found, config.dataset, tokenizer=tokenizer, context=context,
                                    default_dataset=dataset, environment_options=env_cfg.options)
        if custom is not None:
            if isinstance(custom[1], plugins.RewardEnvironment):
                from transformers import AutoConfig

                context_len = AutoConfig.from_pretrained(policy_dir).max_position_embeddings
                custom[1].check_context(context_len, config.generation.max_tokens)
            return custom
    name = task.name if env_cfg.turns == 1 else task.name + MULTI_TURN
    return dataset, make_environment(name, dataset, tokenizer, kind=env_cfg.kind, turns=env_cfg.turns)
