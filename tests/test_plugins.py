"""A user's code by import path (controller/tasks/plugins.py): real modules and real files in
tmp_path, a real tiny policy and tokenizer, the reference engine playing episodes
against the reward adapter, and the examples/custom_task files."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from rolloutdb.config import DatasetSection, FactoryFields, RewardSection
from rolloutdb.controller.tasks.datasets import DatasetError, FileDataset
from rolloutdb.controller.tasks.plugins import (
    PluginContext,
    PluginError,
    RewardEnvironment,
    RewardError,
    build_task,
    check_plugins,
    load_callable,
    load_reward,
    make_environment,
    make_trainer,
    protocol_members,
)
from rolloutdb.plugin_specs import resolve_relative_paths
from rolloutdb.controller.protocols import Environment, StagedTrainer, Trainer
from rolloutdb.controller.tasks.digits import DigitPromptDataset
from rolloutdb.gpu_capture.tiny_policy import DEFAULT_ALPHABET, build_tiny_policy, build_tokenizer

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_task"


def write(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


def refused(call, key: str) -> str:
    with pytest.raises(PluginError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message and message.startswith(key + ": ")
    return message


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(DEFAULT_ALPHABET)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", hidden_size=32, num_layers=1, num_heads=2,
                             intermediate_size=64)


@pytest.fixture
def plugin_dir(tmp_path):
    write(tmp_path, "rewards.py", """
        CONSTANT = 3

        def score(record, reply, token_ids):
            return 1.0 if reply.strip() == str(record["answer"]) else 0.0

        def one_arg(record):
            return 0.0

        class Scorer:
            @staticmethod
            def score(record, reply, token_ids):
                return 0.5
    """)
    return tmp_path


# ----------------------------------------------------------------------- loading


def test_a_module_path_loads_an_installed_callable():
    assert load_callable("json:dumps", key="reward.function") is json.dumps


def test_a_relative_file_is_read_from_the_config_directory_not_the_working_directory(plugin_dir, monkeypatch):
    monkeypatch.chdir("/")
    score = load_reward("./rewards.py:score", base_dir=plugin_dir)
    assert score({"answer": 7}, " 7", [1]) == 1.0 and score({"answer": 7}, "8", [1]) == 0.0


def test_a_dotted_name_reaches_an_attribute_of_a_class(plugin_dir):
    assert load_reward("rewards.py:Scorer.score", base_dir=plugin_dir)({}, "", []) == 0.5


def test_a_file_is_imported_once_for_every_spec_that_names_it(tmp_path):
    log = tmp_path / "imports.log"
    write(tmp_path, "both.py", f"""
        with open({str(log)!r}, "a") as f:
            f.write("imported\\n")

        def score(record, reply, token_ids):
            return 0.0

        def make_env(context):
            return None
    """)
    load_reward("./both.py:score", base_dir=tmp_path)
    load_callable("./both.py:make_env", key="environment.factory", base_dir=tmp_path)
    assert log.read_text() == "imported\n"


def test_a_file_can_import_a_module_beside_it(tmp_path):
    write(tmp_path, "helper_for_plugin_test.py", "ANSWER = 42\n")
    write(tmp_path, "uses_helper.py", """
        from helper_for_plugin_test import ANSWER

        def score(record, reply, token_ids):
            return float(ANSWER)
    """)
    assert load_reward("./uses_helper.py:score", base_dir=tmp_path)({}, "", []) == 42.0


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("score", "is not 'module:callable' or './file.py:callable'"),
        ("rewards.py:", "is not 'module:callable'"),
        ("no_such_module_for_plugins:score", "module 'no_such_module_for_plugins' not found"),
        ("./missing.py:score", "file ./missing.py not found (relative paths are read from"),
        ("./rewards.py:scor", "rewards.py has no attribute 'scor'; it defines Scorer, one_arg, score"),
        ("./rewards.py:CONSTANT", "is a int, not callable"),
        ("json:dumps.nope", "json:dumps has no attribute 'nope'"),
        ("./broken.py:score", "broken.py line 2: "),
        ("./needs_dep.py:score", "it imports 'no_such_dependency_xyz', which is not installed"),
        ("./raises.py:score", "raised RuntimeError: boom at import"),
        ("./exits.py:score", "called sys.exit(3)"),
        ("./rewards.py:one_arg", "cannot be called as reward(record, reply, token_ids)"),
    ],
)
def test_a_bad_reward_spec_is_refused_in_one_line_saying_what_is_wrong(plugin_dir, spec, expected):
    write(plugin_dir, "broken.py", "def score(record, reply, token_ids):\nreturn 1\n")
    write(plugin_dir, "needs_dep.py", "import no_such_dependency_xyz\n")
    write(plugin_dir, "raises.py", "raise RuntimeError('boom at import')\n")
    write(plugin_dir, "exits.py", "import sys\nsys.exit(3)\n")
    assert expected in refused(lambda: load_reward(spec, base_dir=plugin_dir), "reward.function")


def test_a_failed_import_can_be_retried_once_the_file_is_fixed(tmp_path):
    write(tmp_path, "fixme.py", "raise RuntimeError('not yet')\n")
    refused(lambda: load_reward("./fixme.py:score", base_dir=tmp_path), "reward.function")
    write(tmp_path, "fixme.py", "def score(record, reply, token_ids):\n    return 2.0\n")
    assert load_reward("./fixme.py:score", base_dir=tmp_path)({}, "", []) == 2.0


def test_relative_paths_in_a_config_become_absolute_against_its_directory(tmp_path):
    data = {"dataset": {"path": "data/p.jsonl"}, "reward": {"function": "./r.py:score"},
            "environment": {"factory": "mypkg.envs:make"}, "trainer": {"factory": "../t.py:make"}}
    resolve_relative_paths(data, tmp_path / "cfg")
    assert data == {"dataset": {"path": str(tmp_path / "cfg" / "data" / "p.jsonl")},
                    "reward": {"function": f"{tmp_path / 'cfg' / 'r.py'}:score"},
                    "environment": {"factory": "mypkg.envs:make"},
                    "trainer": {"factory": f"{tmp_path / 't.py'}:make"}}


# --------------------------------------------------------------------- factories


def test_factory_options_without_a_factory_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="options: given without a factory"):
        FactoryFields.model_validate({"options": {"turns": 2}})
    assert FactoryFields.model_validate({"factory": "m:f", "options": {"turns": 2}}).options == {"turns": 2}


def test_the_protocol_members_are_read_from_the_protocols():
    assert protocol_members(Environment) == ["max_turns", "score", "start", "step"]
    assert protocol_members(Trainer) == ["export_weights", "load_checkpoint", "save_checkpoint", "step", "train_step"]


def test_an_environment_factory_gets_the_context_and_its_options(tmp_path, tokenizer):
    write(tmp_path, "envs.py", """
        from rolloutdb.controller.tasks.digits import SingleTurnDigitEnv

        def make(context, kind="copy"):
            return SingleTurnDigitEnv(context.dataset, context.tokenizer, kind=kind)
    """)
    context = PluginContext(tokenizer=tokenizer, dataset=DigitPromptDataset(size=4))
    env = make_environment("./envs.py:make", context, {"kind": "reverse"}, base_dir=tmp_path)
    assert isinstance(env, Environment) and env.kind == "reverse"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("return object()", "returned object, which is not a(n) Environment: lacks max_turns, score, start, step"),
        ("return Half()", "returned Half, which is not a(n) Environment: lacks score, step"),
        ("return Uncallable()", "score, step not callable"),
        ("return ZeroTurns()", "the environment's max_turns (ZeroTurns) is 0; it must be an integer >= 1"),
        ("raise KeyError('no such task')", "make raised KeyError: 'no such task'"),
    ],
)
def test_an_environment_factory_whose_result_is_not_an_environment_is_refused(tmp_path, body, expected):
    write(tmp_path, "envs.py", f"""
        class Half:
            max_turns = 1
            def start(self, prompt_id):
                return [1], {{}}

        class Uncallable(Half):
            score = 1
            step = None

        class ZeroTurns(Half):
            max_turns = 0
            def step(self, state, reply_ids):
                pass
            def score(self, state):
                return 0.0

        def make(context):
            {body}
    """)
    message = refused(lambda: make_environment("./envs.py:make", PluginContext(), base_dir=tmp_path),
                      "environment.factory")
    assert expected in message


def test_a_factory_that_cannot_take_the_context_or_an_option_is_refused_without_being_called(tmp_path):
    called = tmp_path / "called"
    write(tmp_path, "envs.py", f"""
        def no_context():
            open({str(called)!r}, "w").close()

        def make(context, kind="copy"):
            open({str(called)!r}, "w").close()
    """)
    assert "cannot be called as factory(context, **options)" in refused(
        lambda: make_environment("./envs.py:no_context", PluginContext(), base_dir=tmp_path), "environment.factory")
    assert "unexpected keyword argument 'turns'" in refused(
        lambda: make_environment("./envs.py:make", PluginContext(), {"turns": 2}, base_dir=tmp_path),
        "environment.factory")
    assert not called.exists()


def test_the_example_trainer_factory_builds_a_trainer_from_the_policy_and_its_options(policy_dir):
    context = PluginContext(policy_dir=policy_dir)
    trainer = make_trainer(f"{EXAMPLE / 'trainer.py'}:make_trainer", context, {"lr": 0.01})
    assert isinstance(trainer, Trainer) and trainer.step == 0
    assert isinstance(trainer, StagedTrainer)  # the train pump holds the commit lock only for its commit
    assert trainer.config.lr == 0.01


def test_a_trainer_with_half_of_the_staged_form_is_refused_and_one_with_train_step_alone_is_not(tmp_path):
    write(tmp_path, "trainers.py", """
        class Whole:
            step = 0
            def train_step(self, groups): return {}
            def export_weights(self): return {}
            def save_checkpoint(self, directory): return []
            def load_checkpoint(self, directory): pass

        class HalfStaged(Whole):
            def prepare_step(self, groups): return None

        class Staged(HalfStaged):
            def commit_step(self, prepared): return {}

        def make(context, kind):
            return {"whole": Whole, "half": HalfStaged, "staged": Staged}[kind]()
    """)
    made = {kind: make_trainer("./trainers.py:make", PluginContext(), {"kind": kind}, base_dir=tmp_path)
            for kind in ("whole", "staged")}
    assert not isinstance(made["whole"], StagedTrainer) and isinstance(made["staged"], StagedTrainer)
    message = refused(lambda: make_trainer("./trainers.py:make", PluginContext(), {"kind": "half"}, base_dir=tmp_path),
                      "trainer.factory")
    assert "HalfStaged, which is not a(n) StagedTrainer: lacks commit_step" in message


def test_a_trainer_factory_returning_something_that_cannot_train_is_refused(tmp_path):
    write(tmp_path, "trainers.py", """
        class NotQuite:
            step = 0
            def train_step(self, groups):
                return {}

        def make(context):
            return NotQuite()
    """)
    message = refused(lambda: make_trainer("./trainers.py:make", PluginContext(), base_dir=tmp_path), "trainer.factory")
    assert "NotQuite, which is not a(n) Trainer: lacks export_weights, load_checkpoint, save_checkpoint" in message


# -------------------------------------------------------------- reward environment


@pytest.fixture
def answers(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a} plus {b} is", "answer": a + b}) + "\n"
                            for a, b in [(1, 2), (3, 4), (5, 5)]))
    return FileDataset(path, reward_fields=["answer"])


def test_the_reward_gets_the_record_the_reply_up_to_eos_and_the_token_ids(answers, tokenizer, tmp_path):
    seen = []

    def reward(record, reply, token_ids):
        seen.append((record, reply, token_ids))
        return 0.25

    env = RewardEnvironment(answers, tokenizer, reward)
    prompt, state = env.start(1)
    assert prompt[0] == tokenizer.bos_token_id and tokenizer.decode(prompt[1:]) == "3 plus 4 is"
    reply = tokenizer.encode(" 7", add_special_tokens=False) + [tokenizer.eos_token_id] + tokenizer.encode("9", add_special_tokens=False)
    turn, state = env.step(state, reply)
    assert turn.done and turn.observation_ids == [] and turn.info == {"score": 0.25}
    assert seen == [({"prompt": "3 plus 4 is", "answer": 7}, " 7", reply)]
    assert env.score(state) == 0.25 and len(seen) == 1  # the score is kept, not recomputed
    assert json.loads(json.dumps(state)) == state  # exportable at a cut
    assert isinstance(env, Environment)


@pytest.mark.parametrize(("value", "expected"), [(float("nan"), "returned nan, not a finite number"),
                                                 ("1.0", "returned '1.0', not a number"),
                                                 (True, "returned True, not a number")])
def test_a_reward_that_is_not_a_finite_number_is_refused_naming_the_record(answers, tokenizer, value, expected):
    def reward(record, reply, ids):
        return value

    env = RewardEnvironment(answers, tokenizer, reward, name="./r.py:score")
    _, state = env.start(2)
    with pytest.raises(RewardError) as e:
        env.step(state, [3])
    assert str(e.value) == (f"./r.py:score on line 3 of answers.jsonl (prompt 2) {expected}; the function is at "
                            f"{__file__}:{reward.__code__.co_firstlineno}")


def test_a_reward_that_raises_is_reported_naming_the_record_with_the_cause_kept(answers, tokenizer):
    def reward(record, reply, token_ids):
        return 1 / 0

    env = RewardEnvironment(answers, tokenizer, reward)
    _, state = env.start(0)
    with pytest.raises(RewardError, match=r"reward on line 1 of answers.jsonl \(prompt 0\) raised ZeroDivisionError: "
                                          r"division by zero at .*test_plugins.py:\d+ \(in reward\); its traceback") as e:
        env.step(state, [3])
    assert isinstance(e.value.__cause__, ZeroDivisionError)
    assert "return 1 / 0" in e.value.user_traceback


def test_a_prompt_that_leaves_no_room_for_the_reply_is_refused_at_start_naming_its_line(tmp_path, tokenizer):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "short"}) + "\n" + json.dumps({"prompt": "x" * 60}) + "\n")
    env = RewardEnvironment(FileDataset(path), tokenizer, lambda record, reply, ids: 0.0)
    env.check_context(context_len=70, max_tokens=8)  # BOS + 60 characters + 8 fit in 70
    with pytest.raises(DatasetError) as e:
        env.check_context(context_len=64, max_tokens=8)
    assert str(e.value) == (f"dataset.path: {path} line 2: the prompt is 61 tokens; with generation.max_tokens 8 it "
                            "does not fit the policy's context of 64; shorten it or lower max_tokens")


def test_the_reference_engine_plays_episodes_against_the_reward_environment(answers, policy_dir):
    from transformers import AutoTokenizer

    from rolloutdb.controller.rollout.episodes import Episode
    from rolloutdb.gpu_capture.protocol import SamplingParams
    from rolloutdb.gpu_capture.reference_engine import ReferenceEngine

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    replies = []

    def reward(record, reply, token_ids):
        replies.append((record["answer"], reply, token_ids))
        return float(len(token_ids))

    env = RewardEnvironment(answers, tokenizer, reward)
    engine = ReferenceEngine(policy_dir, max_batch_size=8, num_threads=1)
    results = [Episode.start(env, i % 3, key=f"g{i}-a0", seed=i) for i in range(6)]
    params = SamplingParams(max_tokens=4, temperature=1.0)
    for episode in results:  # one call each, in order, so the rewards line up with `replies`
        episode.absorb(env, engine.submit(episode.request(env, params)).result())
    assert len(results) == 6 and len(replies) == 6 and all(e.done for e in results)
    for result, (answer, reply, token_ids) in zip(results, replies):
        assert result.token_ids == token_ids and result.reward == float(len(token_ids))
        assert tokenizer.decode(result.prompt_ids[1:]).endswith(" is")


# ------------------------------------------------------------------ a task, checked


def test_check_plugins_refuses_a_reward_without_prompts_and_prompts_without_a_reward(answers, plugin_dir):
    message = refused(lambda: check_plugins(DatasetSection(), "./rewards.py:score", None, base_dir=plugin_dir),
                      "reward.function")
    assert "set dataset.path too" in message
    message = refused(lambda: check_plugins(DatasetSection(path=str(answers.path)), None, None), "dataset.path")
    assert "set reward.function too" in message


def test_check_plugins_refuses_a_bad_dataset_before_importing_anything(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        check_plugins(DatasetSection(path="absent.jsonl"), "./nothing_here.py:score", None, base_dir=tmp_path)


def test_check_plugins_refuses_a_bad_trainer_factory_spec(plugin_dir):
    message = refused(lambda: check_plugins(DatasetSection(), None, None, trainer_factory="./rewards.py:nope",
                                            base_dir=plugin_dir), "trainer.factory")
    assert "has no attribute 'nope'" in message


def test_without_custom_keys_build_task_leaves_the_digit_task_to_the_caller(tokenizer):
    found = check_plugins(DatasetSection(), None, None)
    assert build_task(found, DatasetSection(), tokenizer=tokenizer, context=PluginContext(),
                      default_dataset=DigitPromptDataset(size=4)) is None


def test_an_environment_factory_gets_the_file_dataset_and_the_reward(answers, plugin_dir, tokenizer):
    write(plugin_dir, "envs.py", """
        from rolloutdb.controller.tasks.plugins import RewardEnvironment

        def make(context):
            return RewardEnvironment(context.dataset, context.tokenizer, context.reward)
    """)
    section = DatasetSection(path=str(answers.path))
    found = check_plugins(section, "./rewards.py:score", "./envs.py:make", base_dir=plugin_dir)
    data, env = build_task(found, section, tokenizer=tokenizer, context=PluginContext(),
                           default_dataset=DigitPromptDataset(size=4), base_dir=plugin_dir)
    assert data is found.dataset and env.dataset is data and env.reward is found.reward


# ------------------------------------------------------------------- the example


def test_the_example_scores_a_right_and_a_wrong_reply_through_the_proposed_config(tokenizer):
    config = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    resolve_relative_paths(config, EXAMPLE)
    section = DatasetSection.model_validate(config["dataset"])
    reward_spec = RewardSection.model_validate(config["reward"]).function
    trainer = FactoryFields.model_validate(config["trainer"])
    found = check_plugins(section, reward_spec, None, trainer_factory=trainer.factory,
                          trainer_options=trainer.options)
    data, env = build_task(found, section, tokenizer=tokenizer, context=PluginContext(),
                           default_dataset=DigitPromptDataset(size=4))
    assert len(data) == 200 and data.record(0) == {"prompt": data[0], "answer": 42}
    for reply, expected in [(" 42", 1.0), (" 41", None), (" no idea", 0.0)]:
        _, state = env.start(0)
        turn, state = env.step(state, tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id])
        if expected is None:
            assert 0.0 < turn.info["score"] < 1.0  # close but wrong: partial credit
        else:
            assert turn.info["score"] == expected


def test_the_committed_prompts_are_what_the_generator_writes_and_fit_the_tiny_policy():
    from rolloutdb.controller.tasks.datasets import tiny_policy_alphabet

    spec = importlib.util.spec_from_file_location("make_prompts_under_test", EXAMPLE / "make_prompts.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.render() == (EXAMPLE / "prompts.jsonl").read_text()
    data = FileDataset(EXAMPLE / "prompts.jsonl")
    assert tiny_policy_alphabet(data, DEFAULT_ALPHABET) == DEFAULT_ALPHABET  # every character has a token
    assert max(len(data[i]) for i in range(len(data))) < 200  # prompt + reply fit the 256-token context
