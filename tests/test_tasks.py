"""The digit task: its reward on hand-written answers, the dataset, and both environments
with the embedded default tokenizer (a real PreTrainedTokenizerFast)."""

from __future__ import annotations

import json

import pytest

from rolloutdb.controller.protocols import Environment, PromptDataset
from rolloutdb.controller.tasks.digits import (
    LENGTH_BONUS,
    TASK_ALPHABET,
    DigitPromptDataset,
    MultiTurnDigitEnv,
    SingleTurnDigitEnv,
    score_reply,
    target_for,
)
from rolloutdb.controller.tasks.registry import make_environment
from rolloutdb.gpu_capture.tiny_policy import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TASK_ALPHABET)


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------------- reward


@pytest.mark.parametrize(
    ("reply", "target", "expected"),
    [
        ("371", "371", 1.0),
        (" 371\n", "371", 1.0),  # surrounding whitespace is not part of the answer
        ("", "371", 0.0),
        ("37", "371", (1 - LENGTH_BONUS) * 2 / 3),  # two right, wrong length
        ("381", "371", (1 - LENGTH_BONUS) * 2 / 3 + LENGTH_BONUS),  # one wrong digit
        ("3710", "371", 1 - LENGTH_BONUS),  # all right, one character too many
        ("173", "371", (1 - LENGTH_BONUS) * 1 / 3 + LENGTH_BONUS),  # only the middle
        ("abc", "371", LENGTH_BONUS),
        ("1", "371", 0.0),
    ],
)
def test_the_reward_gives_per_character_credit_on_hand_written_answers(reply, target, expected):
    assert score_reply(reply, target) == pytest.approx(expected)


def test_targets_of_each_task_kind_are_computed_from_the_digits():
    assert target_for("copy", "3071") == "3071"
    assert target_for("successor", "3079") == "4180"
    assert target_for("reverse", "3071") == "1703"
    with pytest.raises(ValueError, match="unknown task kind"):
        target_for("sort", "31")


# ------------------------------------------------------------------------------ dataset


def test_the_dataset_is_a_pure_function_of_its_parameters_and_index():
    a, b = DigitPromptDataset(size=50, n_digits=4, seed=3), DigitPromptDataset(size=50, n_digits=4, seed=3)
    assert isinstance(a, PromptDataset)
    assert len(a) == 50
    assert [a[i] for i in range(50)] == [b[i] for i in range(50)]
    assert all(len(a[i]) == 4 and a[i].isdigit() for i in range(50))
    assert len({a[i] for i in range(50)}) > 40  # not one prompt repeated
    assert a.fingerprint() == b.fingerprint()
    assert DigitPromptDataset(size=50, n_digits=4, seed=4).fingerprint() != a.fingerprint()
    assert DigitPromptDataset(size=51, n_digits=4, seed=3).fingerprint() != a.fingerprint()
    with pytest.raises(IndexError):
        a[50]


# ---------------------------------------------------------------------- single turn


def test_a_single_turn_episode_scores_the_decoded_reply(tokenizer):
    data = DigitPromptDataset(size=10, n_digits=3, seed=0)
    env = SingleTurnDigitEnv(data, tokenizer, kind="successor")
    assert isinstance(env, Environment)
    prompt, state = env.start(4)
    digits = data[4]
    assert tokenizer.decode(prompt) == f"{digits}:"
    right = target_for("successor", digits)
    turn, done_state = env.step(state, enc(tokenizer, right) + [tokenizer.eos_token_id])
    assert turn.done and turn.observation_ids == []
    assert env.score(done_state) == 1.0
    assert env.score(state) == 0.0  # the state passed in is not changed
    with pytest.raises(ValueError, match="already finished"):
        env.step(done_state, enc(tokenizer, right))


def test_tokens_after_eos_do_not_count_and_special_tokens_are_not_free(tokenizer):
    data = DigitPromptDataset(size=10, n_digits=3, seed=0)
    env = SingleTurnDigitEnv(data, tokenizer, kind="copy")
    _, state = env.start(0)
    answer = enc(tokenizer, data[0])
    _, after_eos = env.step(state, answer + [tokenizer.eos_token_id] + enc(tokenizer, "999"))
    assert env.score(after_eos) == 1.0
    # "<bos>" decodes to text of its own: interleaving it must not pass for the answer.
    bos = tokenizer.bos_token_id
    padded = [t for a in answer for t in (bos, a)]
    _, gamed = env.step(state, padded)
    assert env.score(gamed) < 0.5


# ----------------------------------------------------------------------- multi turn


def play(env, prompt_id, replies, tokenizer, roundtrip_after=None, fresh_env=None):
    """Play `replies` (texts); optionally export the state as JSON after that many turns
    and continue on `fresh_env` from the parsed copy. Returns (observations, env, state)."""
    prompt, state = env.start(prompt_id)
    observations = [tokenizer.decode(prompt)]
    for i, reply in enumerate(replies):
        if roundtrip_after is not None and i == roundtrip_after:
            state = json.loads(json.dumps(state))
            env = fresh_env
        turn, state = env.step(state, enc(tokenizer, reply))
        observations.append(tokenizer.decode(turn.observation_ids))
        if turn.done:
            break
    return observations, env, state


def test_the_multi_turn_environment_keeps_state_and_poses_the_next_sub_problem(tokenizer):
    data = DigitPromptDataset(size=20, n_digits=3, seed=1)
    env = MultiTurnDigitEnv(data, tokenizer, kind="copy", turns=3)
    assert isinstance(env, Environment) and env.max_turns == 3
    prompt, state = env.start(7)
    first = data.digits(7, part=0)
    assert tokenizer.decode(prompt) == f"{first}:"
    turn, state = env.step(state, enc(tokenizer, first))
    second = data.digits(7, part=1)
    assert not turn.done
    assert tokenizer.decode(turn.observation_ids) == f" ok\n{second}:"
    assert state["turn"] == 1 and state["scores"] == [1.0]
    wrong = "".join(str((int(c) + 5) % 10) for c in second)
    turn, state = env.step(state, enc(tokenizer, wrong))
    third = data.digits(7, part=2)
    assert tokenizer.decode(turn.observation_ids) == f" no\n{third}:"
    assert state["scores"][1] == pytest.approx(LENGTH_BONUS)
    turn, state = env.step(state, enc(tokenizer, third))
    assert turn.done and turn.observation_ids == []
    assert env.score(state) == pytest.approx((1.0 + LENGTH_BONUS + 1.0) / 3)


def test_unanswered_turns_count_zero_in_the_multi_turn_reward(tokenizer):
    data = DigitPromptDataset(size=20, n_digits=3, seed=1)
    env = MultiTurnDigitEnv(data, tokenizer, turns=3)
    _, state = env.start(2)
    _, state = env.step(state, enc(tokenizer, data.digits(2, part=0)))
    assert env.score(state) == pytest.approx(1 / 3)


def test_a_multi_turn_episode_resumed_from_its_json_state_ends_with_the_same_reward(tokenizer):
    data = DigitPromptDataset(size=20, n_digits=3, seed=2)
    replies = ["123", data.digits(5, part=1), "0"]
    env = make_environment("digits_multiturn", data, tokenizer, kind="reverse", turns=3)
    straight_obs, _, straight_state = play(env, 5, replies, tokenizer)

    fresh = make_environment("digits_multiturn", DigitPromptDataset(size=20, n_digits=3, seed=2),
                             tokenizer, kind="reverse", turns=3)
    resumed_obs, resumed_env, resumed_state = play(env, 5, replies, tokenizer, roundtrip_after=1,
                                                   fresh_env=fresh)
    assert resumed_env is fresh
    assert resumed_obs == straight_obs
    assert resumed_state == straight_state
    assert fresh.score(resumed_state) == env.score(straight_state)
    assert 0 < env.score(straight_state) < 1  # partial credit, not a trivial 0 or 1


def test_an_unknown_environment_or_kind_is_refused_when_built(tokenizer):
    data = DigitPromptDataset(size=5)
    with pytest.raises(ValueError, match="unknown environment"):
        make_environment("chess", data, tokenizer)
    with pytest.raises(ValueError, match="unknown task kind"):
        make_environment("digits", data, tokenizer, kind="sort")


# ---------------------------------------------------------------- one registry of task kinds


def test_the_registry_builds_exactly_the_tasks_and_kinds_the_config_accepts(tokenizer):
    from rolloutdb.config import TASK_KINDS, TASK_NAMES, ConfigError, config_from_dict
    from rolloutdb.controller.tasks.registry import ENVIRONMENTS, TASKS

    # The config may not import the controller, so it declares the names and the registry
    # builds them: a task in one and not the other fails here.
    assert tuple(TASKS) == TASK_NAMES
    assert set(ENVIRONMENTS) == {name + suffix for name in TASK_NAMES for suffix in ("", "_multiturn")}
    for name in TASK_NAMES:
        config = config_from_dict({"environment": {"task": name, "dataset_size": 7}, "generation": {"max_tokens": 97}})
        dataset = TASKS[name].prompts(config.environment, config.run.seed)
        assert len(dataset) == 7
        for kind in TASK_KINDS:
            for env_name, turns in ((name, 1), (name + "_multiturn", 2)):
                env = make_environment(env_name, dataset, tokenizer, kind=kind, turns=turns)
                assert isinstance(env, Environment) and env.max_turns == turns
                observation, _ = env.start(0)
                assert observation, env_name
    with pytest.raises(ConfigError, match="environment.task: 'chess' is not one of the accepted values: "
                                          + ", ".join(repr(n) for n in TASK_NAMES)):
        config_from_dict({"environment": {"task": "chess"}})
    with pytest.raises(ConfigError, match="environment.kind: 'sort' is not one of the accepted values"):
        config_from_dict({"environment": {"kind": "sort"}})
