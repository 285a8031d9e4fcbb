"""A user's own code by import path: reward functions, environment and trainer factories.

A spec is ``"module:callable"`` (an installed or importable module) or
``"./path.py:callable"`` (a file, relative to the config file's directory; absolute
paths work too). The callable may be dotted (``"mod:Class.make"``).

- A reward is called as ``reward(record, reply, token_ids) -> float``: the prompt record
  (`FileDataset.record`), the decoded reply (up to its EOS) and the reply's token ids.
- A factory is called as ``factory(context, **options)``: `PluginContext` carries what a
  run has built (config, policy directory, tokenizer, dataset, reward); `options` is the
  section's free-form ``options:`` mapping. An environment factory returns an
  `Environment`, a trainer factory a `Trainer` (`controller/protocols.py`), which may
  also be a `StagedTrainer` (then with both of its methods).

Everything is checked at start, before the run directory is touched where it can be
(`check_plugins`): the module imports, the attribute exists and is callable, it accepts
the arguments it will get (`inspect.signature(...).bind`, without calling it), and a
factory's result has every member of its Protocol. Each failure is one `PluginError`
line naming the key.

`RewardEnvironment` is the adapter that turns a reward function and a `FileDataset` into
a single-turn `Environment`, the way `tasks.SingleTurnDigitEnv` is one for digits.

A file is imported once per absolute path (also when the reward and a factory live in
the same file), under a private module name. Its directory is appended to `sys.path`,
so it can import its sibling modules, as a script run from that directory could;
appended, not prepended, so a sibling named like an installed package does not shadow
it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from rolloutdb.plugin_specs import is_file_target
from rolloutdb.controller.tasks.datasets import DatasetError, DatasetSection, FileDataset, PromptFormatter
from rolloutdb.controller.protocols import Environment, PromptDataset, StagedTrainer, Trainer, Turn
from rolloutdb.controller.tasks.digits import as_codec
from rolloutdb.controller.tasks.user_code import (
    USER_ROOTS,
    PluginError,
    UserCodeError,
    defined_at,
    frames_of,
    remember_user_code,
    safe_str,
    their_traceback,
    user_code_raised,
    where_theirs,
)

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
RewardFunction = Callable[[dict, str, list[int]], float]


class RewardError(UserCodeError):
    """A reward function that raised or returned something that is not a finite number."""


# --------------------------------------------------------------------------- loading


def _one_line(text: object) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= 160 else text[:157] + "..."


def split_spec(spec: str, *, key: str) -> tuple[str, str]:
    """("module or file", "attribute path"), refusing anything else with one line."""
    if not isinstance(spec, str) or ":" not in spec:
        raise PluginError(f"{key}: {spec!r} is not 'module:callable' or './file.py:callable'")
    target, _, attr = spec.rpartition(":")
    if not target or not _DOTTED.fullmatch(attr):
        raise PluginError(f"{key}: {spec!r} is not 'module:callable' or './file.py:callable' "
                          f"({'no module or file' if not target else f'{attr!r} is not a Python name'})")
    if not is_file_target(target) and not _DOTTED.fullmatch(target):
        raise PluginError(f"{key}: {target!r} in {spec!r} is neither a module name nor a path to a .py file")
    return target, attr


def _import_file(target: str, *, key: str, base_dir: Path | None) -> ModuleType:
    given = Path(target)
    path = given if given.is_absolute() or base_dir is None else base_dir / given
    path = path.resolve()
    where = "" if given.is_absolute() else f" (relative paths are read from {base_dir or Path.cwd()})"
    if path.suffix != ".py":
        raise PluginError(f"{key}: {target} is not a .py file{where}")
    if not path.is_file():
        raise PluginError(f"{key}: file {target} not found{where}")
    name = "_rolloutdb_plugin_" + re.sub(r"\W", "_", path.stem) + "_" + hashlib.sha256(str(path).encode()).hexdigest()[:10]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"{key}: cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    sys.modules[name] = module  # before exec: dataclasses and typing look themselves up there
    USER_ROOTS.add(str(path.parent))  # a failure while importing it is already theirs
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's file failed to import
        del sys.modules[name]
        raise _import_failure(key, str(path), e) from e
    return module


def _import_failure(key: str, what: str, e: BaseException) -> PluginError:
    if isinstance(e, SyntaxError):
        return PluginError(f"{key}: {e.filename or what} line {e.lineno}: {e.msg}")
    if isinstance(e, ModuleNotFoundError):
        return PluginError(f"{key}: importing {what} failed: it imports {e.name!r}, which is not installed "
                           f"({_one_line(e)})")
    if isinstance(e, SystemExit):
        return PluginError(f"{key}: importing {what} called sys.exit({e.code!r}); guard script code with "
                           "if __name__ == '__main__':")
    frames = frames_of(e.__traceback__)
    return UserCodeError(f"{key}: importing {what} raised {type(e).__name__}: {safe_str(e)} at "
                         f"{where_theirs(frames)}; its traceback is above", their_traceback(e, frames[1:]))


def _import_module(target: str, *, key: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is not None and (target == e.name or target.startswith(e.name + ".")):
            raise PluginError(f"{key}: module {target!r} not found; install it, put it on PYTHONPATH, or give a "
                              f"file ('./{target.replace('.', '/')}.py:...')") from None
        raise _import_failure(key, f"module {target!r}", e) from e
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        raise _import_failure(key, f"module {target!r}", e) from e


def load_callable(spec: str, *, key: str, base_dir: str | Path | None = None) -> Callable[..., Any]:
    """The callable a spec names, imported and checked; one-line PluginError otherwise."""
    target, attr = split_spec(spec, key=key)
    base = None if base_dir is None else Path(base_dir)
    module = _import_file(target, key=key, base_dir=base) if is_file_target(target) else _import_module(target, key=key)
    remember_user_code(module, is_file=is_file_target(target))
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = target if i == 0 else f"{target}:{'.'.join(attr.split('.')[:i])}"
            defined = sorted(n for n, v in vars(obj).items() if callable(v) and not n.startswith("_")
                             and getattr(v, "__module__", module.__name__) == module.__name__)
            hint = f"; it defines {', '.join(defined[:8])}" if defined else ""
            raise PluginError(f"{key}: {owner} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(f"{key}: {spec} is a {type(obj).__name__}, not callable")
    return obj


def _check_call(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], *, key: str,
                expected: str) -> None:
    """Refuse a callable that cannot take these arguments, without calling it."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins have no signature; the call itself will tell
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        name = getattr(fn, "__qualname__", repr(fn))
        raise PluginError(f"{key}: {name}{signature} cannot be called as {expected} ({_one_line(e)})") from None


def load_reward(spec: str, *, key: str = "reward.function", base_dir: str | Path | None = None) -> RewardFunction:
    fn = load_callable(spec, key=key, base_dir=base_dir)
    _check_call(fn, ({}, "", []), {}, key=key, expected="reward(record, reply, token_ids)")
    return fn


@dataclass
class PluginContext:
    """What a factory receives: the run's parts built so far."""

    config: Any = None  # the validated rolloutdb Config
    base_dir: Path | None = None  # the config file's directory
    policy_dir: Path | None = None
    tokenizer: Any = None
    dataset: PromptDataset | None = None
    reward: RewardFunction | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # anything a caller wants to hand on


def protocol_members(proto: type) -> list[str]:
    """The names a Protocol requires: its annotated attributes and its public methods
    and properties (read from the class, so a member added there is checked here)."""
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n, v in vars(proto).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return sorted(names)


def check_protocol(obj: Any, proto: type, *, key: str, made_by: str) -> None:
    """Refuse `obj` unless it has every member of `proto` (methods callable)."""
    missing = [n for n in protocol_members(proto) if not hasattr(obj, n)]
    methods = [n for n, v in vars(proto).items() if not n.startswith("_") and inspect.isfunction(v)]
    not_callable = sorted(n for n in methods if hasattr(obj, n) and not callable(getattr(obj, n)))
    if missing or not_callable or not isinstance(obj, proto):
        problems = ([f"lacks {', '.join(missing)}"] if missing else []) + \
                   ([f"{', '.join(not_callable)} not callable"] if not_callable else [])
        raise PluginError(f"{key}: {made_by} returned {_one_line(type(obj).__name__)}, which is not a(n) "
                          f"{proto.__name__}: {'; '.join(problems) or 'not an instance'} "
                          f"(see rolloutdb.controller.protocols.{proto.__name__})")


def _count(value: Any, *, key: str, what: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise PluginError(f"{key}: {what} is {value!r}; it must be an integer >= {least}")


def load_factory(spec: str, context: PluginContext, options: Mapping[str, Any], *, key: str,
                 base_dir: str | Path | None = None) -> Callable[..., Any]:
    factory = load_callable(spec, key=key, base_dir=base_dir)
    _check_call(factory, (context,), options, key=key, expected="factory(context, **options)")
    return factory


def _call_factory(factory: Callable[..., Any], context: PluginContext, options: Mapping[str, Any], *, key: str) -> Any:
    try:
        return factory(context, **options)
    except (PluginError, DatasetError):
        raise
    except Exception as e:  # noqa: BLE001 - the user's factory failed: their error, with their traceback
        raise user_code_raised(e, f"{key}: {getattr(factory, '__qualname__', factory)}") from e


def make_environment(spec: str, context: PluginContext, options: Mapping[str, Any] | None = None, *,
                     key: str = "environment.factory", base_dir: str | Path | None = None) -> Environment:
    options = dict(options or {})
    factory = load_factory(spec, context, options, key=key, base_dir=base_dir)
    env = _call_factory(factory, context, options, key=key)
    check_protocol(env, Environment, key=key, made_by=spec)
    _count(env.max_turns, key=key, what=f"the environment's max_turns ({type(env).__name__})", least=1)
    return env


def make_trainer(spec: str, context: PluginContext, options: Mapping[str, Any] | None = None, *,
                 key: str = "trainer.factory", base_dir: str | Path | None = None) -> Trainer:
    options = dict(options or {})
    factory = load_factory(spec, context, options, key=key, base_dir=base_dir)
    trainer = _call_factory(factory, context, options, key=key)
    check_protocol(trainer, Trainer, key=key, made_by=spec)
    if hasattr(trainer, "prepare_step") or hasattr(trainer, "commit_step"):  # half a staged trainer is a mistake
        check_protocol(trainer, StagedTrainer, key=key, made_by=spec)
    _count(trainer.step, key=key, what=f"the trainer's step ({type(trainer).__name__})", least=0)
    return trainer


# -------------------------------------------------------------- reward -> Environment


def reward_value(value: Any, *, what: str) -> float:
    """A reward as a float, refusing what is not a real finite number (a bool too:
    `True` as a reward is a bug, not 1.0)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        try:
            import numpy as np

            if isinstance(value, np.generic) and np.issubdtype(type(value), np.number) \
                    and not np.issubdtype(type(value), np.complexfloating):
                value = value.item()
        except ImportError:  # pragma: no cover - numpy is a dependency
            pass
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(f"{what} returned {_safe_repr(value)}, not a number")
    try:
        result = float(value)
    except OverflowError:  # an int past 1e308
        result = math.inf
    if not math.isfinite(result):
        raise RewardError(f"{what} returned {result if isinstance(value, float) else _safe_repr(value)}, "
                          "not a finite number")
    return result


def _safe_repr(value: Any) -> str:
    """repr for a message: a user's object whose __repr__ raises, or an int too long for
    Python to print, does not replace the error being reported."""
    try:
        return _one_line(repr(value))
    except Exception:  # noqa: BLE001 - only the message is at stake
        return f"a {type(value).__name__}"


def call_reward(reward: RewardFunction, dataset: FileDataset, prompt_id: int, reply: str, token_ids: list[int], *,
                name: str) -> float:
    """The user's reward on one reply as a float; a raise or a value that is not a finite
    number is their error (`RewardError`), naming the record and their file:line."""
    what = f"{name} on {dataset.location(prompt_id)} of {dataset.file_of(prompt_id).name} (prompt {prompt_id})"
    try:
        raw = reward(dataset.record(prompt_id), reply, token_ids)
    except Exception as e:  # noqa: BLE001 - the user's reward failed: their error, with their traceback
        failure = user_code_raised(e, what)
        raise RewardError(str(failure), failure.user_traceback) from e
    try:
        return reward_value(raw, what=what)
    except RewardError as e:  # a value has no frame: name where the function is defined
        raise RewardError(f"{e}; the function is at {defined_at(reward)}") from None


class RewardEnvironment:
    """A single-turn `Environment` from a dataset and a reward function.

    State (JSON-able, exported at a cut): {"prompt_id", "reply", "reward", "done"}. The
    reward is computed once, in `step`, and kept in the state: `score` does not call the
    user's function again (it may be slow, or not deterministic)."""

    # Prompt ids of recently started prompts: a group starts the same prompt group_size
    # times in a row, and a chat template renders in about a millisecond.
    _CACHE = 4096

    def __init__(self, dataset: FileDataset, tokenizer: Any, reward: RewardFunction, *,
                 formatter: PromptFormatter | None = None, name: str = "reward"):
        self.dataset = dataset
        self.codec = as_codec(tokenizer)
        self.reward = reward
        self.formatter = formatter or PromptFormatter(tokenizer)
        self.formatter.check(dataset)
        self.name = name
        self.max_turns = 1
        self._ids: dict[int, list[int]] = {}

    def check_context(self, context_len: int, max_tokens: int) -> None:
        """Refuse, at start, a prompt that leaves no room for `max_tokens` of reply in the
        policy's context: the engine would refuse its first call mid-run instead. Encodes
        every prompt once (about 30 us each with a fast tokenizer)."""
        room = context_len - max_tokens
        for i in range(len(self.dataset)):
            n = len(self.formatter.encode(self.dataset[i]))
            if n > room:
                raise DatasetError(f"dataset.path: {self.dataset.file_of(i)} {self.dataset.location(i)}: the prompt is {n} "
                                   f"tokens; with generation.max_tokens {max_tokens} it does not fit the policy's "
                                   f"context of {context_len}; shorten it or lower max_tokens")

    def start(self, prompt_id: int) -> tuple[list[int], dict]:
        ids = self._ids.get(prompt_id)
        if ids is None:
            if len(self._ids) >= self._CACHE:
                self._ids.clear()
            ids = self._ids[prompt_id] = self.formatter.encode(self.dataset[prompt_id])
        return list(ids), {"prompt_id": prompt_id, "reply": None, "reward": None, "done": False}

    def step(self, state: dict, reply_ids: Sequence[int]) -> tuple[Turn, dict]:
        if state["done"]:
            raise ValueError("episode already finished")
        reply = self.codec.decode(reply_ids)
        prompt_id = state["prompt_id"]
        value = call_reward(self.reward, self.dataset, prompt_id, reply, [int(t) for t in reply_ids], name=self.name)
        return Turn(observation_ids=[], done=True, info={"score": value}), dict(state, reply=reply, reward=value,
                                                                               done=True)

    def score(self, state: dict) -> float:
        return 0.0 if state.get("reward") is None else float(state["reward"])


# ------------------------------------------------------------------- building a task


@dataclass
class TaskPlugins:
    """What `check_plugins` found, for `build_task` to use."""

    dataset: FileDataset | None
    reward: RewardFunction | None
    reward_spec: str | None
    environment_factory: str | None


def check_plugins(dataset: DatasetSection, reward_function: str | None, environment_factory: str | None,
                  environment_options: Mapping[str, Any] | None = None, trainer_factory: str | None = None,
                  trainer_options: Mapping[str, Any] | None = None, *,
                  base_dir: str | Path | None = None, max_positions: int | None = None) -> TaskPlugins:
    """Every check that needs no policy: the dataset loads (each prompt within
    `max_positions`, the policy's context, by its length), each spec imports and takes its
    arguments, the reward scores the first record, and the combination makes a task. Run
    before the run directory is created, so a bad path or file refuses the run with
    nothing written."""
    data = None
    if dataset.path is not None:
        data = FileDataset(dataset.path, prompt_field=dataset.prompt_field, reward_fields=dataset.reward_fields,
                           base_dir=base_dir, max_positions=max_positions)
    reward = None if reward_function is None else load_reward(reward_function, base_dir=base_dir)
    if reward is not None and data is not None:
        # Once on the first record with an empty reply (a policy may end its reply at once):
        # a reward that cannot score it fails here, with nothing written, not steps later.
        call_reward(reward, data, 0, "", [], name=f"{reward_function} (called once before the run, on an empty reply)")
    if environment_factory is not None:
        load_factory(environment_factory, PluginContext(), environment_options or {}, key="environment.factory",
                     base_dir=base_dir)
    if trainer_factory is not None:
        load_factory(trainer_factory, PluginContext(), trainer_options or {}, key="trainer.factory", base_dir=base_dir)
    if environment_factory is None:
        if reward is not None and data is None:
            raise PluginError("reward.function: set dataset.path too (the prompts the reward scores)")
        if data is not None and reward is None:
            raise PluginError("dataset.path: set reward.function too (how a reply is scored), or "
                              "environment.factory for an environment of your own")
    return TaskPlugins(data, reward, reward_function, environment_factory)


def check_config(config: Any) -> TaskPlugins:
    """`check_plugins` for a validated Config, with the policy's model directory and
    context checked first."""
    env, trainer = config.environment, config.trainer
    positions = None
    if config.policy.model_dir is not None or config.dataset.path is not None:
        positions = policy_context(config.policy.model_dir, engine=config.generation.backend,
                                   packing=config.algorithm.shared_prefix_packing)
    return check_plugins(config.dataset, config.reward.function, env.factory, env.options, trainer.factory,
                         trainer.options, max_positions=positions)


def policy_context(model_dir: str | None, *, engine: str = "reference", packing: bool = False) -> int | None:
    """The policy's context (its max positions), checked before the run directory is made.
    A model directory is checked whole (`model_dirs.check_model_dir`: a config
    transformers builds, safetensors weights, a tokenizer, an architecture `engine`
    runs), so a directory that cannot be a policy is refused now in one line, not once
    the run has started. With `packing` (algorithm.shared_prefix_packing), a model with
    sliding-window attention is refused: the tree mask is passed to the model as a 4D
    mask, which transformers applies instead of the window (measured: logits moved by
    0.06 on a window of 8), so the trainer's log-probabilities would not be the engine's.
    The tiny policy's context is its builder's default (without importing torch: a
    refusal on a loaded machine waited a minute for that import)."""
    if model_dir is None:
        from rolloutdb.config import TINY_POLICY_CONTEXT

        return TINY_POLICY_CONTEXT
    from rolloutdb.gpu_capture.model_dirs import ModelDirError, check_model_dir

    try:
        config = check_model_dir(model_dir, engine=engine)
    except ModelDirError as e:
        raise PluginError(str(e)) from None
    positions = getattr(config, "max_position_embeddings", None)
    if packing:
        from rolloutdb.gpu_capture.invariant_forward import sliding_windows

        windows = [w for w in sliding_windows(config) if w is not None and (positions is None or w < positions)]
        if windows:
            raise PluginError(f"algorithm.shared_prefix_packing: {model_dir} has sliding-window attention (window "
                              f"{min(windows)}), which the packed layout's tree mask would replace; set "
                              "algorithm.shared_prefix_packing: false for this model")
    return positions if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0 else None


def build_task(found: TaskPlugins, dataset: DatasetSection, *, tokenizer: Any, context: PluginContext,
               default_dataset: PromptDataset, environment_options: Mapping[str, Any] | None = None,
               base_dir: str | Path | None = None) -> tuple[PromptDataset, Environment] | None:
    """(dataset, environment) for a custom task, or None when nothing custom is set (the
    caller builds the digit task). An environment factory gets the file dataset when
    `dataset.path` is set, else `default_dataset` (the digit prompts)."""
    if found.environment_factory is None and found.dataset is None:
        return None
    data: PromptDataset = found.dataset if found.dataset is not None else default_dataset
    if found.environment_factory is not None:
        context.dataset, context.reward, context.tokenizer = data, found.reward, tokenizer
        env = make_environment(found.environment_factory, context, environment_options, base_dir=base_dir)
        return data, env
    assert found.dataset is not None and found.reward is not None  # check_plugins refused the rest
    formatter = PromptFormatter(tokenizer, dataset.chat_template)
    return found.dataset, RewardEnvironment(found.dataset, tokenizer, found.reward, formatter=formatter,
                                            name=found.reward_spec or "reward.function")
