"""Hostile: a user's own code failing, and inputs too big to train on, through the real
`rolloutdb train` in a subprocess (tmp_path holds the config, the prompts and the
plugin files; the tiny CPU policy).

The user's code failing (a reward that raises or returns NaN, a string, a bool; an
environment or trainer factory that raises; an environment whose `start` cannot read its
record) is the user's error: exit 2, their traceback printed, and one last `error:` line
naming their file:line and the record, never "a defect in rolloutdb". What can be
checked before the run directory is created is (the reward on the first record, the
model directory's config, the prompts' sizes against the policy's context): such a
mistake leaves no run directory behind. A 50 MB prompt line is refused, naming its line,
before anything is written and without tokenizing it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# A hang detector, not a speed test: a loaded 2-core machine needs 20-60 s for a run.
TIMEOUT = 240
PROMPTS = [{"prompt": f"{i} plus 1 is", "answer": i + 1} for i in range(8)]
BASE = {
    "run": {"name": "hostile_plugins", "seed": 0},
    "algorithm": {"total_steps": 2, "groups_per_step": 2, "group_size": 2, "max_staleness": 1,
                  "replay_capacity": 4},
    "generation": {"max_tokens": 4},
    "policy": {"hidden_size": 16, "num_layers": 1},
    "dataset": {"path": "./prompts.jsonl", "reward_fields": ["answer"]},
    "reward": {"function": "./reward.py:score"},
}
GOOD_REWARD = """
    def score(record, reply, token_ids):
        return 1.0 if reply.strip() == str(record["answer"]) else 0.0
"""


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source).lstrip("\n"), encoding="utf-8")
    return path


def line_of(path: Path, marker: str = "# <- here") -> int:
    """The 1-based line of `path` that holds `marker`."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), start=1) if marker in line)


def task(tmp_path: Path, *, reward: str = GOOD_REWARD, prompts: list[dict] | None = None, **sections) -> Path:
    """A config in tmp_path with its prompts and reward file; `sections` replace BASE's."""
    write(tmp_path / "reward.py", reward)
    with open(tmp_path / "prompts.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(p) + "\n" for p in prompts or PROMPTS)
    config = {**BASE, **sections}
    (tmp_path / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    return tmp_path / "config.yaml"


def train(config: Path, run_dir: Path, *overrides: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLOUTDB_FAULT", "ROLLOUTDB_TRACEBACK")}
    env["RAY_AUTH_MODE"] = "disabled"
    return subprocess.run([sys.executable, "-m", "rolloutdb", "train", "--config", str(config), "--run-dir",
                           str(run_dir), *overrides], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=config.parent)


def assert_users_error(proc: subprocess.CompletedProcess, file: Path, *needles: str, marker: str = "# <- here") -> str:
    """Exit 2; their traceback, then one `error:` line, the last, naming file:line (the
    line of `marker`)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "defect in rolloutdb" not in proc.stderr, proc.stderr[-3000:]
    assert lines and lines[-1].startswith("error: "), proc.stderr[-3000:]
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], proc.stderr[-3000:]
    at = f"{file.resolve()}:{line_of(file, marker)}"
    assert re.search(re.escape(at) + r"(\D|$)", lines[-1]), (at, lines[-1])
    for needle in needles:
        assert needle in lines[-1], (needle, lines[-1])
    return lines[-1]


def assert_traceback_shown(proc: subprocess.CompletedProcess, file: Path) -> None:
    assert "Traceback (most recent call last):" in proc.stderr, proc.stderr[-3000:]
    assert f'File "{file.resolve()}", line {line_of(file)}' in proc.stderr, proc.stderr[-3000:]


# --------------------------------------------------------------- the reward function


def test_a_reward_that_raises_mid_run_is_the_users_error_naming_their_line_and_the_record(tmp_path):
    config = task(tmp_path, reward="""
        CALLS = [0]

        def score(record, reply, token_ids):
            CALLS[0] += 1
            if CALLS[0] > 3:  # the check before the run and two replies pass
                return parse(reply)
            return 0.0

        def parse(reply):
            return {}["missing"]  # <- here
    """)
    done = train(config, tmp_path / "run")
    assert_users_error(done, tmp_path / "reward.py", "raised KeyError: 'missing'", "of prompts.jsonl (prompt ",
                       "(in parse)")
    assert_traceback_shown(done, tmp_path / "reward.py")


def test_a_reward_that_returns_nan_mid_run_is_refused_naming_the_value_and_the_record(tmp_path):
    config = task(tmp_path, reward="""
        CALLS = [0]

        def score(record, reply, token_ids):  # <- here
            CALLS[0] += 1
            return float("nan") if CALLS[0] > 3 else 0.5
    """)
    done = train(config, tmp_path / "run")
    assert_users_error(done, tmp_path / "reward.py", "returned nan, not a finite number", "of prompts.jsonl (prompt ")


@pytest.mark.parametrize(("value", "shown"), [("float('nan')", "returned nan, not a finite number"),
                                              ("float('inf')", "returned inf, not a finite number"),
                                              ("'1.0'", "returned '1.0', not a number"),
                                              ("True", "returned True, not a number"),
                                              ("10 ** 400", "not a finite number")],
                         ids=["nan", "inf", "str", "bool", "huge-int"])
def test_a_reward_returning_what_is_not_a_number_is_refused_before_the_run_directory_exists(tmp_path, value, shown):
    config = task(tmp_path, reward=f"""
        def score(record, reply, token_ids):  # <- here
            return {value}
    """)
    run = tmp_path / "run"
    done = train(config, run)
    assert_users_error(done, tmp_path / "reward.py", shown, "on line 1 of prompts.jsonl (prompt 0)",
                       "called once before the run")
    assert not run.exists()


def test_a_reward_that_cannot_score_the_first_record_is_refused_with_its_traceback_and_nothing_written(tmp_path):
    config = task(tmp_path, reward="""
        def score(record, reply, token_ids):
            return float(int(reply.split()[0]) == record["answer"])  # <- here
    """)
    run = tmp_path / "run"
    done = train(config, run)
    assert_users_error(done, tmp_path / "reward.py", "raised IndexError", "on line 1 of prompts.jsonl (prompt 0)")
    assert_traceback_shown(done, tmp_path / "reward.py")
    assert not run.exists()


# ------------------------------------------------------------------------ factories

ENV_FACTORY = """
    from rolloutdb.controller.protocols import Turn


    class Arithmetic:
        max_turns = 1

        def __init__(self, dataset, tokenizer):
            self.dataset, self.tokenizer = dataset, tokenizer

        def start(self, prompt_id):
            record = self.dataset.record(prompt_id)
            question = record["question"]  # <- here
            return self.tokenizer.encode(question), {"done": False}

        def step(self, state, reply_ids):
            return Turn(observation_ids=[], done=True, info={}), {"done": True}

        def score(self, state):
            return 0.0


    def make(context, fail=False):
        if fail:
            raise RuntimeError("no such arithmetic level")  # <- factory
        return Arithmetic(context.dataset, context.tokenizer)
"""


def test_an_environment_factory_that_raises_is_the_users_error_with_their_traceback(tmp_path):
    write(tmp_path / "envs.py", ENV_FACTORY)
    config = task(tmp_path, environment={"factory": "./envs.py:make", "options": {"fail": True}})
    done = train(config, tmp_path / "run")
    assert_users_error(done, tmp_path / "envs.py", "environment.factory", "raised RuntimeError: no such "
                       "arithmetic level", "(in make)", marker="# <- factory")
    assert 'in make\n    raise RuntimeError("no such arithmetic level")' in done.stderr


def test_an_environment_that_cannot_read_its_record_mid_run_is_the_users_error(tmp_path):
    write(tmp_path / "envs.py", ENV_FACTORY)
    config = task(tmp_path, environment={"factory": "./envs.py:make"})
    done = train(config, tmp_path / "run")
    assert_users_error(done, tmp_path / "envs.py", "your code raised KeyError: 'question'", "(in start)")
    assert_traceback_shown(done, tmp_path / "envs.py")


def test_a_trainer_factory_that_raises_is_the_users_error_with_their_traceback(tmp_path):
    write(tmp_path / "trainers.py", """
        def make(context, lr=0.001):
            return build(context.policy_dir, lr)

        def build(policy_dir, lr):
            raise ValueError(f"learning rate {lr} too small for {policy_dir.name}")  # <- here
    """)
    config = task(tmp_path, trainer={"factory": "./trainers.py:make"})
    done = train(config, tmp_path / "run")
    assert_users_error(done, tmp_path / "trainers.py", "trainer.factory", "raised ValueError: learning rate",
                       "(in build)")
    assert_traceback_shown(done, tmp_path / "trainers.py")


def test_a_model_directory_transformers_cannot_build_is_refused_before_the_run_directory_exists(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 30,
                                                   "num_attention_heads": 4, "num_hidden_layers": 1,
                                                   "vocab_size": 100}))
    config = task(tmp_path, policy={"model_dir": str(model)})
    run = tmp_path / "run"
    done = train(config, run)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"error: policy.model_dir: {model / 'config.json'} does not build"), lines
    assert not run.exists()


# ----------------------------------------------------------------- inputs too big


def test_a_50_mb_prompt_line_is_refused_naming_its_line_in_seconds_with_nothing_written(tmp_path):
    config = task(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w", encoding="utf-8") as f:
        f.write(json.dumps(PROMPTS[0]) + "\n")
        f.write('{"answer": 1, "prompt": "' + "7 plus 1 is " * (50 * 2**20 // 12) + '"}\n')
    assert prompts.stat().st_size > 50 * 2**20
    run = tmp_path / "run"
    done = train(config, run, timeout=120)  # a hang detector: the 5 minutes of today would fail here
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"error: dataset.path: {prompts.resolve()} line 2 is longer than "), lines
    assert not run.exists()


def test_a_prompt_too_long_for_the_context_is_refused_by_its_length_before_tokenizing(tmp_path):
    config = task(tmp_path, prompts=[*PROMPTS, {"prompt": "1 plus 1 is " * 5000, "answer": 2}])
    run = tmp_path / "run"
    done = train(config, run)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0] == (f"error: dataset.path: {(tmp_path / 'prompts.jsonl').resolve()} line 9: the prompt is 60000 "
                        "characters, more than fit the policy's context of 256 tokens (at most 32 characters a "
                        "token); shorten it")
    assert not run.exists()


@pytest.mark.parametrize("digits", [5000, 200_000])
def test_a_number_too_long_for_python_is_refused_naming_the_dataset_line(tmp_path, digits):
    config = task(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "a", encoding="utf-8") as f:
        f.write('{"prompt": "big", "answer": ' + "9" * digits + "}\n")
    run = tmp_path / "run"
    done = train(config, run)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"error: dataset.path: {prompts.resolve()} line 9 holds a value JSON cannot be read "
                               "into (Exceeds the limit"), lines
    assert not run.exists()
