"""The task a run learns, built from its config in one place: the rollout pump's driver,
every agent server (`agent_server/env_server.py`) and every Ray environment worker
(`rollout/ray_environments.py`) call `build_task`, so they build the same dataset and
environment from the same config."""

from __future__ import annotations

from pathlib import Path

from rolloutdb.config import Config
from rolloutdb.controller.protocols import Environment, PromptDataset
from rolloutdb.controller.tasks import plugins
from rolloutdb.controller.tasks.digits import DigitPromptDataset, LongTailDigitDataset, make_environment


def check_plugins(config: Config):
    """The policy's config, the dataset file and every import path, checked before
    anything is written."""
    return plugins.check_config(config)


def build_task(config: Config, policy_dir: Path, found=None) -> tuple[PromptDataset, Environment]:
    """(dataset, environment) for the configured task."""
    from transformers import AutoTokenizer

    env_cfg = config.environment
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    dataset: DigitPromptDataset | LongTailDigitDataset
    if env_cfg.task == "digits_longtail":
        dataset = LongTailDigitDataset(size=env_cfg.dataset_size, max_digits=env_cfg.max_digits,
                                       tail_alpha=env_cfg.tail_alpha, seed=config.run.seed)
    else:
        dataset = DigitPromptDataset(size=env_cfg.dataset_size, n_digits=env_cfg.n_digits, seed=config.run.seed)
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
    name = env_cfg.task if env_cfg.turns == 1 else f"{env_cfg.task}_multiturn"
    env = make_environment(name, dataset, tokenizer, kind=env_cfg.kind, turns=env_cfg.turns)
    return dataset, env
