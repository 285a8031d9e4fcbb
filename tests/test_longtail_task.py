"""The long-tail digit task: its length distribution against the formula computed here,
prompts as a pure function of (seed, index, part), the reply limits the environment
sets, a multi-turn episode resumed from its JSON state, the config keys that choose it,
and the example that runs it."""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import settled

from rolloutdb.config import Config, ConfigError, load_config
from rolloutdb.controller.protocols import Environment, PromptDataset, ReplyLimits
from rolloutdb.controller.tasks.digits import (
    LENGTH_BONUS,
    TASK_ALPHABET,
    DigitPromptDataset,
    LongTailDigitDataset,
    LongTailMultiTurnEnv,
    LongTailSingleTurnEnv,
    MultiTurnDigitEnv,
    SingleTurnDigitEnv,
    target_for,
)
from rolloutdb.controller.tasks.registry import make_environment
from rolloutdb.gpu_capture.tiny_policy import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
N = 4096


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TASK_ALPHABET)


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def survival(k: int, max_digits: int = 96, alpha: float = 1.2) -> float:
    """P(L >= k), written out from the definition: the untruncated tail k^-alpha
    conditioned on L <= max_digits."""
    if k <= 1:
        return 1.0
    if k > max_digits:
        return 0.0
    return (k ** -alpha - (max_digits + 1) ** -alpha) / (1 - (max_digits + 1) ** -alpha)


def within_binomial(observed: int, n: int, p: float, sigmas: float = 4.5) -> bool:
    return abs(observed - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


@pytest.fixture(scope="module")
def lengths():
    data = LongTailDigitDataset(size=N, seed=11)  # defaults: max_digits 96, alpha 1.2
    return [len(data.digits(i)) for i in range(N)]


# ---------------------------------------------------------------------------- the lengths


def test_target_lengths_follow_the_truncated_power_law_over_4096_prompts(lengths):
    assert min(lengths) == 1
    assert 64 <= max(lengths) <= 96  # expected count >= 64 is ~11 of 4096; none beyond 96
    # The formula's median: the smallest k with P(L <= k) >= 1/2; 57% of targets are 1 digit.
    median = next(k for k in range(1, 97) if 1 - survival(k + 1) >= 0.5)
    assert median == 1 and statistics.median(lengths) == median
    assert within_binomial(sum(n >= 32 for n in lengths), N, survival(32))
    assert survival(32) == pytest.approx(0.01154, abs=1e-5)  # the figure the docstring quotes
    for k in (2, 3, 4, 8, 16, 64):  # the whole shape, not one point of it
        assert within_binomial(sum(n >= k for n in lengths), N, survival(k)), k


def test_the_law_is_truncated_at_max_digits_not_clipped_there():
    # Clipping the untruncated law k^-alpha at 96 would put P(L >= 64) at 0.0068, 2.5x
    # the truncated 0.0027, and shift every other k by ~0.004: 65536 draws tell them apart.
    n = 65536
    data = LongTailDigitDataset(size=n, seed=12)
    lengths = [data.length(i) for i in range(n)]
    for k in (2, 8, 32, 64, 90):
        assert within_binomial(sum(x >= k for x in lengths), n, survival(k), sigmas=4), k
    assert not within_binomial(sum(x >= 64 for x in lengths), n, 64 ** -1.2, sigmas=4)


def test_a_heavier_exponent_and_a_lower_cap_shift_the_lengths_as_the_formula_says():
    data = LongTailDigitDataset(size=N, max_digits=24, tail_alpha=0.5, seed=3)
    lengths = [data.length(i) for i in range(N)]
    assert max(lengths) == 24 and min(lengths) == 1
    for k in (2, 4, 12, 24):
        assert within_binomial(sum(n >= k for n in lengths), N, survival(k, 24, 0.5)), k


def test_each_sub_problem_draws_its_own_length():
    data = LongTailDigitDataset(size=N, seed=11)
    first = [data.length(i, part=0) for i in range(N)]
    second = [data.length(i, part=1) for i in range(N)]
    assert all(data.length(i, 1) == len(data.digits(i, 1)) for i in range(200))
    # Independent draws agree on L only as often as two draws of the law do: sum P(L=k)^2.
    same = sum(a == b for a, b in zip(first, second))
    p_same = sum((survival(k) - survival(k + 1)) ** 2 for k in range(1, 97))
    assert within_binomial(same, N, p_same)


# ---------------------------------------------------------------------------- the prompts


def test_the_same_seed_index_and_part_always_give_the_same_prompt_and_another_seed_another():
    a, b = LongTailDigitDataset(size=300, seed=5), LongTailDigitDataset(size=300, seed=5)
    assert isinstance(a, PromptDataset) and len(a) == 300
    assert [a.digits(i, p) for i in range(300) for p in range(3)] == [b.digits(i, p) for i in range(300) for p in range(3)]
    assert all(a[i].isdigit() for i in range(300))
    assert a.fingerprint() == b.fingerprint()
    other = LongTailDigitDataset(size=300, seed=6)
    assert sum(a[i] != other[i] for i in range(300)) > 250  # a one-digit prompt matches 1 time in 10
    assert other.fingerprint() != a.fingerprint()
    assert LongTailDigitDataset(size=300, seed=5, tail_alpha=1.3).fingerprint() != a.fingerprint()
    assert LongTailDigitDataset(size=300, seed=5, max_digits=95).fingerprint() != a.fingerprint()
    # Not the plain digit task's prompts under another name.
    assert DigitPromptDataset(size=300, n_digits=3, seed=5).fingerprint() != a.fingerprint()
    with pytest.raises(IndexError):
        a[300]


def test_a_dataset_with_impossible_parameters_is_refused():
    with pytest.raises(ValueError, match="tail_alpha"):
        LongTailDigitDataset(size=4, tail_alpha=0)
    with pytest.raises(ValueError, match="max_digits"):
        LongTailDigitDataset(size=4, max_digits=0)


# ------------------------------------------------------------------------ the environments


def an_index_with_length(data, at_least: int, part: int = 0) -> int:
    return next(i for i in range(len(data)) if data.length(i, part) >= at_least)


def test_a_perfect_reply_scores_one_and_the_reply_limits_are_the_target_length_and_one_more(tokenizer):
    data = LongTailDigitDataset(size=2000, seed=1)
    env = make_environment("digits_longtail", data, tokenizer, kind="successor")
    assert isinstance(env, LongTailSingleTurnEnv)
    assert isinstance(env, Environment) and isinstance(env, ReplyLimits)
    i = an_index_with_length(data, 20)
    digits = data[i]
    prompt, state = env.start(i)
    assert tokenizer.decode(prompt) == f"{digits}:"
    assert env.reply_limits(state) == (len(digits), len(digits) + 1)
    right = "".join(str((int(c) + 1) % 10) for c in digits)  # successor, by hand
    _, done = env.step(state, enc(tokenizer, right) + [tokenizer.eos_token_id])
    assert env.score(done) == 1.0
    _, one_more = env.step(state, enc(tokenizer, right + "0"))  # the L + 1 reply: loses the length bonus
    assert env.score(one_more) == pytest.approx(1 - LENGTH_BONUS)


def test_the_plain_digit_environments_leave_reply_limits_to_generation(tokenizer):
    # The pump asks only environments that offer reply_limits; the quickstart's must not.
    data = DigitPromptDataset(size=5)
    assert not isinstance(SingleTurnDigitEnv(data, tokenizer), ReplyLimits)
    assert not isinstance(MultiTurnDigitEnv(data, tokenizer), ReplyLimits)


def test_the_multi_turn_reply_limits_follow_the_current_sub_problem(tokenizer):
    data = LongTailDigitDataset(size=4000, seed=2)
    env = make_environment("digits_longtail_multiturn", data, tokenizer, kind="copy", turns=3)
    assert isinstance(env, LongTailMultiTurnEnv) and isinstance(env, ReplyLimits)
    # A prompt whose three sub-problems have three different lengths.
    i = next(i for i in range(4000) if len({data.length(i, p) for p in range(3)}) == 3)
    _, state = env.start(i)
    for part in range(3):
        expected = data.length(i, part)
        assert env.reply_limits(state) == (expected, expected + 1)
        turn, state = env.step(state, enc(tokenizer, data.digits(i, part)))
        if part < 2:
            assert tokenizer.decode(turn.observation_ids) == f" ok\n{data.digits(i, part + 1)}:"
    assert turn.done and env.score(state) == 1.0


def test_a_multi_turn_episode_json_round_tripped_mid_episode_ends_with_the_identical_reward(tokenizer):
    data = LongTailDigitDataset(size=4000, seed=4)
    i = an_index_with_length(data, 8, part=1)
    replies = [target_for("reverse", data.digits(i, 0)), "12", target_for("reverse", data.digits(i, 2))[:-1]]

    def play(roundtrip_after):
        env = LongTailMultiTurnEnv(data, tokenizer, kind="reverse", turns=3)
        observations, rewards = [], []
        _, state = env.start(i)
        for k, reply in enumerate(replies):
            if k == roundtrip_after:  # export at a cut, continue on a fresh environment
                state = json.loads(json.dumps(state))
                env = LongTailMultiTurnEnv(LongTailDigitDataset(size=4000, seed=4), tokenizer, kind="reverse", turns=3)
                assert env.reply_limits(state) == (data.length(i, k), data.length(i, k) + 1)
            turn, state = env.step(state, enc(tokenizer, reply))
            observations.append(turn.observation_ids)
        return observations, state, env.score(state)

    straight, resumed = play(None), play(2)
    assert resumed == straight
    # By hand: turn 0 perfect; turn 1 "12" against a target of >= 8 digits; turn 2 one digit short.
    n1, n2, t1 = data.length(i, 1), data.length(i, 2), target_for("reverse", data.digits(i, 1))
    turn1 = (1 - LENGTH_BONUS) * sum(a == b for a, b in zip("12", t1)) / n1
    turn2 = (1 - LENGTH_BONUS) * (n2 - 1) / n2
    assert straight[2] == pytest.approx((1.0 + turn1 + turn2) / 3)


# ------------------------------------------------------------------------------ the config


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_a_digit_config_with_the_long_tail_keys_at_their_defaults_keeps_its_fingerprint():
    # A key at its default is not hashed, so the long-tail keys' arrival moved no digit
    # run's fingerprint (the values runs of that time carry: tests/test_hostile_fingerprint.py).
    explicit = load_config(REPO / "examples" / "quickstart.yaml",
                           ["environment.max_digits=96", "environment.tail_alpha=1.2"])
    assert explicit.fingerprint() == load_config(REPO / "examples" / "quickstart.yaml").fingerprint()


def test_the_long_tail_keys_are_part_of_the_fingerprint_when_the_task_is_long_tail(tmp_path):
    base = ["environment.task=digits_longtail", "generation.max_tokens=97"]
    a = load_config(_write(tmp_path, "{}\n"), base)
    assert a.fingerprint() != Config().fingerprint()
    assert load_config(_write(tmp_path, "{}\n"), base + ["environment.tail_alpha=1.5"]).fingerprint() != a.fingerprint()
    assert load_config(_write(tmp_path, "{}\n"), base + ["environment.max_digits=90"]).fingerprint() != a.fingerprint()


@pytest.mark.parametrize("overrides,key,words", [
    (["generation.max_tokens=96"], "generation.max_tokens", "max_digits + 1 = 97"),
    (["generation.max_tokens=97", "environment.turns=3"], "environment.max_digits", "lower max_digits or turns"),
    (["generation.max_tokens=97", "environment.tail_alpha=0"], "environment.tail_alpha", "greater than 0"),
    (["generation.max_tokens=98", "environment.max_digits=97"], "environment.max_digits", "less than or equal to 96"),
], ids=["max_tokens below max_digits + 1", "conversation beyond the context", "zero exponent", "max_digits 97"])
def test_a_long_tail_config_that_cannot_run_is_one_line_naming_the_key(tmp_path, overrides, key, words):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "{}\n"), ["environment.task=digits_longtail", *overrides])
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{key}: ") and words in message, message


def test_the_longest_long_tail_conversation_that_fits_is_accepted_and_one_digit_more_is_not(tmp_path):
    # 3 turns: 1 + (n + 1) + 2 x ((n + 1) + 4 + n + 1) = 5n + 14 <= 256, so n <= 48.
    ok = ["environment.task=digits_longtail", "environment.turns=3", "generation.max_tokens=49"]
    assert load_config(_write(tmp_path, "{}\n"), [*ok, "environment.max_digits=48"]).environment.max_digits == 48
    with pytest.raises(ConfigError, match="up to 259 tokens"):
        load_config(_write(tmp_path, "{}\n"), [*ok, "environment.max_digits=49", "generation.max_tokens=50"])


def test_the_train_command_refuses_a_short_max_tokens_in_one_line_and_makes_no_run_dir(tmp_path):
    p = _write(tmp_path, "environment:\n  task: digits_longtail\n  max_digits: 30\ngeneration:\n  max_tokens: 30\n")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rolloutdb", "train", "--config", str(p), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: generation.max_tokens: 30 ") and "raise max_tokens" in lines[0], lines[0]
    assert not run_dir.exists()


def test_the_multiturn_example_is_the_long_tail_task_at_turn_level_and_validates():
    cfg = load_config(REPO / "examples" / "multiturn.yaml")
    assert cfg.run.name == "multiturn"
    env = cfg.environment
    assert env.task == "digits_longtail" and env.turns > 1
    assert cfg.rollout_recovery.target_level == "turn"
    assert cfg.rollout_checkpointing.enabled and cfg.trace.enabled
    assert cfg.generation.max_tokens >= env.max_digits + 1


# ------------------------------------------------------------------------------ the wiring


def test_train_builds_the_long_tail_task_from_the_config(tmp_path):
    from rolloutdb.controller.job import build
    from rolloutdb.controller.tasks import registry

    cfg = load_config(REPO / "examples" / "multiturn.yaml", ["environment.dataset_size=64"])
    policy = build.build_policy(cfg, tmp_path / "policy")
    dataset, env = registry.build_task(cfg, policy)
    assert isinstance(env, LongTailMultiTurnEnv) and env.max_turns == cfg.environment.turns
    assert isinstance(dataset, LongTailDigitDataset)
    assert (dataset.max_digits, dataset.tail_alpha, len(dataset)) == (24, 1.2, 64)
    single = cfg.model_copy(update={"environment": cfg.environment.model_copy(update={"turns": 1})})
    plain = cfg.model_copy(update={"environment": cfg.environment.model_copy(update={"task": "digits", "turns": 1})})
    assert isinstance(registry.build_task(single, policy)[1], LongTailSingleTurnEnv)
    plain_dataset, plain_env = registry.build_task(plain, policy)
    assert type(plain_env) is SingleTurnDigitEnv
    assert plain_dataset.fingerprint() != dataset.fingerprint()


def test_the_cli_reports_an_error_from_a_long_tail_override_without_a_traceback(tmp_path):
    from rolloutdb import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["train", "--config", str(REPO / "examples" / "multiturn.yaml"), "--run-dir",
                         str(tmp_path / "run"), "environment.max_digits=60"])
    lines = err.getvalue().splitlines()
    assert code == 2 and len(lines) == 1 and "generation.max_tokens" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_the_multiturn_example_trains_end_to_end_on_the_long_tail_task(tmp_path):
    import sqlite3

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rolloutdb", "train", "--config", str(REPO / "examples" / "multiturn.yaml"),
                           "--run-dir", str(run_dir), "algorithm.total_steps=6", "logging.plot=false"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "steps=6 " in proc.stdout + proc.stderr
    resolved = load_config(run_dir / "config.yaml")
    assert resolved.environment.task == "digits_longtail" and resolved.rollout_recovery.target_level == "turn"
    conn = sqlite3.connect(run_dir / "rollout_state.sqlite")  # a second connection, after the run
    try:
        trained = settled.states(conn)["trained"]
    finally:
        conn.close()
    assert trained == 6 * resolved.algorithm.groups_per_step
