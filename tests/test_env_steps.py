"""The rollout pump with the environment's steps off its thread (controller/rollout/env_steps.py,
controller/rollout/calls.py), without Ray: the same real parts as tests/test_streaming_pump.py
(a real store file, the reference engine on the tiny policy, the multi-turn digit task,
ledger dispatch), with a stepper whose steps run the real environment on another thread
after a delay, as an environment worker's round trip would (tests/test_ray_environments.py
and tests/test_ray_real_run.py run the Ray workers themselves). The store is read through
a second connection."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

from transcripts import saved_transcripts
from test_streaming_pump import _samples, close, make_parts, policy_dir, run_pump  # noqa: F401  (fixture)

from rolloutdb.controller.rollout.env_steps import EnvironmentStepper, EnvironmentWorkerLost, LocalStepper
from rolloutdb.controller.rollout.pump import RolloutPump
from rolloutdb.controller.tasks.digits import DigitPromptDataset, MultiTurnDigitEnv
from rolloutdb.gpu_capture import load_policy

TURNS = 3


class DelayedStepper:
    """Each step runs `LocalStepper`'s (the environment, in full) on a timer thread after
    `delay_s`: the pump sees a future that is not done yet, as from a remote worker."""

    def __init__(self, env, delay_s: float, lose: frozenset[int] = frozenset()):
        self.local, self.delay_s = LocalStepper(env), delay_s
        self.lose = lose  # the steps (1-based) whose worker dies under them, as the Ray pool reports it
        self.steps = 0

    def step(self, state: dict, reply_ids: Sequence[int], *, last: bool) -> Future:
        self.steps += 1
        future: Future = Future()
        lost = self.steps in self.lose

        def later():
            if lost:
                future.set_exception(EnvironmentWorkerLost(f"environment worker 0 is gone (step {self.steps})"))
                return
            answer = self.local.step(state, reply_ids, last=last)
            future.set_result(answer.result())

        threading.Timer(self.delay_s, later).start()
        return future

    def close(self) -> None:
        pass


def multiturn_parts(tmp_path, policy_dir, stepper_delay: float | None, window_ms: int = 5, level: str = "turn"):
    """The parts and the stepper (None: the environment steps inline, `LocalStepper`)."""
    _, tokenizer = load_policy(policy_dir)
    env = MultiTurnDigitEnv(DigitPromptDataset(size=64, n_digits=2), tokenizer, turns=TURNS)
    parts, _ = make_parts(tmp_path, policy_dir, env, overrides={
        "generation": {"max_tokens": 4},
        "rollout_recovery": {"target_level": level, "commit_window_ms": window_ms}})
    return parts, (DelayedStepper(env, stepper_delay) if stepper_delay is not None else None)


def test_a_delayed_stepper_is_an_environment_stepper():
    assert isinstance(DelayedStepper(None, 0.0), EnvironmentStepper)


def test_steps_that_come_back_later_give_the_samples_of_steps_run_inline(tmp_path, policy_dir):
    (tmp_path / "inline").mkdir()
    (tmp_path / "later").mkdir()
    inline, _ = multiturn_parts(tmp_path / "inline", policy_dir, None)
    try:
        run_pump(inline)
    finally:
        close(inline)
    later, stepper = multiturn_parts(tmp_path / "later", policy_dir, 0.02)
    try:
        pump = run_pump(later, stepper=stepper)
    finally:
        close(later)
    assert stepper.steps >= 8 * 1  # every episode stepped through it, off the pump thread
    assert not pump.calls.stepping
    got, expected = _samples(tmp_path / "later" / "store.sqlite"), _samples(tmp_path / "inline" / "store.sqlite")
    assert len(expected) == 8 and got == expected


def test_a_step_whose_worker_died_has_its_attempt_abandoned_as_error_and_redone_to_the_end(tmp_path, policy_dir):
    parts, stepper = multiturn_parts(tmp_path, policy_dir, 0.01)
    stepper.lose = frozenset({3, 11})
    pump = RolloutPump(parts, stepper=stepper)
    thread = threading.Thread(target=pump.run, name="rollout-pump")
    thread.start()
    thread.join(30)  # a lost step left unhandled would hold its group, and the pump, forever
    finished = not thread.is_alive()
    parts.runtime.stop.set()
    thread.join(60)
    close(parts)
    assert finished and parts.runtime.error is None, f"the pump did not finish: {parts.runtime.error}"
    db = sqlite3.connect(f"file:{tmp_path / 'store.sqlite'}?mode=ro", uri=True)
    abandoned = db.execute("SELECT count(*) FROM rollouts WHERE state = 'abandoned' AND abandon_reason = 'error'")
    samples = db.execute("SELECT count(*) FROM samples").fetchone()[0]
    assert abandoned.fetchone()[0] == 2 and samples == 8  # each lost attempt redone; every generation finished
    db.close()


def saved_turns(path) -> list[tuple]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        db.execute("BEGIN")  # one read: the episodes and their pieces as of one commit
        transcripts = saved_transcripts(db)
        return [(turn, state, transcripts[a].version_token_counts)
                for turn, state, a in db.execute("SELECT turn, state, attempt_id FROM env_episodes")]
    except sqlite3.OperationalError:  # not created yet
        return []
    finally:
        db.close()


def test_a_turn_saved_while_the_next_turns_step_runs_is_the_last_whole_turn(tmp_path, policy_dir):
    """Turn level: a commit that comes while an episode's next step runs saves the turn
    before it, ending with that turn's observation, never with a reply whose step has
    not come back. The window (150 ms) keeps a turn's save pending while the episode's
    next call finishes and its step (250 ms) runs."""
    parts, stepper = multiturn_parts(tmp_path, policy_dir, 0.25, window_ms=150)
    pump = RolloutPump(parts, stepper=stepper)
    thread = threading.Thread(target=pump.run, name="rollout-pump")
    thread.start()
    try:  # stop once episodes are between their first and last turns
        deadline = time.monotonic() + 30
        while not saved_turns(tmp_path / "store.sqlite") and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # a few more commits while steps run
    finally:
        parts.runtime.stop.set()
        thread.join(60)
        close(parts)
    assert not thread.is_alive() and parts.runtime.error is None, parts.runtime.error
    rows = saved_turns(tmp_path / "store.sqlite")
    assert rows, "no episode was saved between turns: the test proves nothing"
    for turn, state, counts in rows:
        runs = json.loads(counts)
        assert 1 <= turn < TURNS and json.loads(state)["turn"] == turn
        # After `turn` whole turns: `turn` replies, each followed by its observation.
        assert [v == -1 for v, _ in runs] == [False, True] * turn, (turn, runs)


def test_at_prefix_level_a_call_whose_step_runs_stays_in_the_cuts_view_across_commits(tmp_path, policy_dir):
    """A snapshot's cut reads `uncommitted_calls` (another thread): a call whose step is
    still running is in no engine and its turn in no store row, so it must be there,
    whole, however many commits pass meanwhile (5 ms windows, 250 ms steps)."""
    parts, stepper = multiturn_parts(tmp_path, policy_dir, 0.25, level="prefix")
    pump = RolloutPump(parts, stepper=stepper)
    thread = threading.Thread(target=pump.run, name="rollout-pump")
    thread.start()
    looks, missing = 0, []
    try:
        deadline = time.monotonic() + 60
        while thread.is_alive() and time.monotonic() < deadline:
            stepping = list(dict(pump.calls.stepping).items())  # as a cut would look: the steps running ...
            seen = pump.uncommitted_calls()  # ... then what it saves
            for future, (_, result) in stepping:
                if not future.done():  # still running after the read: the pump cannot have applied it
                    looks += 1
                    if result.request_id not in seen or seen[result.request_id].token_ids != result.token_ids:
                        missing.append(result.request_id)
            time.sleep(0.01)
    finally:
        parts.runtime.stop.set()
        thread.join(60)
        close(parts)
    assert parts.runtime.error is None, parts.runtime.error
    assert looks > 10, "no step was seen running: the test proves nothing"
    assert not missing, missing
