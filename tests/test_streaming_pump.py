"""The streaming rollout pump: episodes advance on their own, calls stream to a continuously
batching engine, and the store sees finished work in group-commit batches.

The pump runs here against real parts: a real store file, the reference engine on the tiny
policy, the digit environments, ledger dispatch. Only the trainer is absent (the pump never
calls it: it reads the trainer's progress through `read_progress`). What the store holds is
read through a second connection.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence

import pytest

from rolloutdb.config import Config
from rolloutdb.controller.run.dispatch import LedgerDispatch
from rolloutdb.controller.rollout.group_commit import CommitBatch
from rolloutdb.controller.protocols import Turn
from rolloutdb.controller.rollout.pump import RolloutPump
from rolloutdb.controller.run.runtime import Progress, RolloutParts, RuntimeState
from rolloutdb.controller.run.sampler import PromptOrder, StalenessBound
from rolloutdb.controller.tasks.digits import DigitPromptDataset, MultiTurnDigitEnv
from rolloutdb.gpu_capture import ReferenceEngine, build_tiny_policy
from rolloutdb.store import Store, pools


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from rolloutdb.controller.tasks.digits import TASK_ALPHABET

    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "tiny", seed=0, alphabet=TASK_ALPHABET)


class LengthEnv:
    """Single turn; prompt `long_prompt` asks for a `long` reply, every other prompt for
    a 1-token one (the engine is told so through `reply_limits`)."""

    max_turns = 1

    def __init__(self, long: int = 80, long_prompt: int | None = 0):
        self.long, self.long_prompt = long, long_prompt  # long_prompt None: every prompt is long

    def start(self, prompt_id: int) -> tuple[list[int], dict]:
        return [1, 3 + prompt_id % 5], {"prompt_id": prompt_id, "reply": None}

    def reply_limits(self, state: dict) -> tuple[int, int]:
        n = self.long if self.long_prompt in (None, state["prompt_id"]) else 1
        return n, n

    def step(self, state: dict, reply_ids: Sequence[int]) -> tuple[Turn, dict]:
        return Turn([], True), dict(state, reply=list(reply_ids))

    def score(self, state: dict) -> float:
        return float(sum(state["reply"]) % 7)


def make_parts(tmp_path, policy_dir, env, *, overrides: dict, engine_slots: int = 16):
    cfg = Config.model_validate({
        "algorithm": {"total_steps": 1, "groups_per_step": 4, "group_size": 2, "max_staleness": 0,
                      "discard_zero_variance": False, **overrides.get("algorithm", {})},
        "generation": {"max_tokens": 96, "max_batch_size": engine_slots, **overrides.get("generation", {})},
        "rollout_recovery": overrides.get("rollout_recovery", {}),
    })
    store = Store.create(tmp_path / "store.sqlite", replay_capacity=cfg.algorithm.replay_capacity)
    engine = ReferenceEngine(policy_dir, max_batch_size=engine_slots, num_threads=1)
    events: list[dict] = []
    parts = RolloutParts(
        config=cfg, store=store, order=PromptOrder(64, seed=0),
        bound=StalenessBound(cfg.algorithm.max_staleness, cfg.algorithm.total_steps),
        engine=engine, env=env, trainer=None, dispatcher=LedgerDispatch(), runtime=RuntimeState(),
        read_progress=lambda: Progress(step=0, policy_version=0), log_event=events.append,
    )
    return parts, events


def run_pump(parts, timeout: float = 120.0, stepper=None) -> RolloutPump:
    pump = RolloutPump(parts, stepper=stepper)
    thread = threading.Thread(target=pump.run, name="rollout-pump")
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the pump did not finish its step in time"
    assert parts.runtime.error is None, parts.runtime.error
    return pump


def close(parts) -> None:
    parts.engine.close()
    parts.store.close()


def test_a_long_reply_holds_only_its_own_group_and_the_others_reach_replay_first(tmp_path, policy_dir):
    first = [r.prompt_id for r in PromptOrder(64, seed=0).take(0, 4)]
    parts, _ = make_parts(tmp_path, policy_dir, LengthEnv(long=80, long_prompt=first[0]), overrides={})
    try:
        run_pump(parts)
    finally:
        close(parts)
    db = sqlite3.connect(tmp_path / "store.sqlite")
    entered = dict(db.execute("SELECT prompt_id, published_at FROM replay_groups").fetchall())
    lengths = dict(db.execute("SELECT prompt_id, max(num_tokens) FROM samples GROUP BY prompt_id").fetchall())
    assert sorted(entered) == sorted(first) and lengths[first[0]] == 80
    long_prompts, short_prompts = [first[0]], first[1:]
    assert all(lengths[p] == 1 for p in short_prompts)
    # A wave would seal every group of the wave in one transaction after the long call;
    # streaming commits the short groups while the long call is still decoding.
    assert max(entered[p] for p in short_prompts) < min(entered[p] for p in long_prompts)


def test_finished_calls_reach_the_store_in_batches_not_one_transaction_per_call(tmp_path, policy_dir):
    parts, events = make_parts(
        tmp_path, policy_dir, LengthEnv(long=1),
        overrides={"algorithm": {"groups_per_step": 16, "group_size": 4},
                   "generation": {"max_inflight_calls": 64},
                   "rollout_recovery": {"commit_window_ms": 200.0}},
        engine_slots=64,
    )
    try:
        pump = run_pump(parts)
        calls = pump.meter.calls
    finally:
        close(parts)
    db = sqlite3.connect(tmp_path / "store.sqlite")
    commits = db.execute("SELECT mutation_counter FROM run_meta").fetchone()[0]
    assert calls == 64
    # 64 one-token calls finish within a few engine steps; a 200 ms window holds them.
    assert commits <= 8, f"{commits} transactions for {calls} calls: the pump does not batch its commits"
    batches = sum(e["batches"] for e in events if e["kind"] == "rollout")
    assert batches == commits


def test_no_more_calls_than_max_inflight_calls_are_in_flight_and_the_pump_fills_that_room(tmp_path, policy_dir):
    parts, _ = make_parts(
        tmp_path, policy_dir, LengthEnv(long=6, long_prompt=None),
        overrides={"algorithm": {"groups_per_step": 12, "group_size": 2},
                   "generation": {"max_inflight_calls": 6}},
        engine_slots=16,
    )
    seen: list[int] = []
    parts.engine.step_callback = lambda step: seen.append(len(parts.engine.running_tokens()))
    try:
        run_pump(parts)
    finally:
        close(parts)
    assert seen and max(seen) == 6, f"calls in flight per step: {seen}"


def test_a_multi_turn_episode_steps_its_environment_between_calls_and_trains_on_its_policy_tokens(tmp_path, policy_dir):
    from rolloutdb.gpu_capture import load_policy

    _, tokenizer = load_policy(policy_dir)
    env = MultiTurnDigitEnv(DigitPromptDataset(size=64, n_digits=2), tokenizer, turns=3)
    parts, events = make_parts(tmp_path, policy_dir, env, overrides={"generation": {"max_tokens": 4}})
    try:
        run_pump(parts)
    finally:
        close(parts)
    db = sqlite3.connect(tmp_path / "store.sqlite")
    assert db.execute("SELECT count(*) FROM samples").fetchone()[0] == 8
    assert db.execute("SELECT count(*) FROM env_episodes").fetchone()[0] == 0  # finished attempts keep none
    windows = [e for e in events if e["kind"] == "rollout" and e["attempts_finished"]]
    assert sum(e["attempts_finished"] for e in windows) == 8
    assert all(e["tokens"] > e["policy_tokens"] > 0 for e in windows)  # environment tokens between turns


def test_each_turn_save_names_what_the_attempts_last_committed_save_wrote_so_only_new_tokens_are_written(
        tmp_path, policy_dir, monkeypatch):
    """Turn level, 4 turns an episode: every save the pump hands the store says how many
    of the transcript's tokens the attempt's previous save wrote (`saved_tokens`), so the
    store appends the rest (revision v1_11_a); the first save of an attempt says 0. The
    pieces left behind are checked against this in test_episode_transcripts.py."""
    from rolloutdb.gpu_capture import load_policy

    _, tokenizer = load_policy(policy_dir)
    env = MultiTurnDigitEnv(DigitPromptDataset(size=64, n_digits=2), tokenizer, turns=4)
    saves: dict[int, list[tuple[int, int]]] = {}
    real = pools.put_episodes

    def recording(conn, rows):
        real(conn, rows)
        for p in rows:
            saves.setdefault(p.attempt_id, []).append((p.saved_tokens, len(p.token_ids)))

    monkeypatch.setattr(pools, "put_episodes", recording)
    parts, _ = make_parts(tmp_path, policy_dir, env, overrides={
        "generation": {"max_tokens": 3, "max_inflight_calls": 4},
        "rollout_recovery": {"target_level": "turn", "commit_window_ms": 1.0}})
    try:
        run_pump(parts)
    finally:
        close(parts)
    assert any(len(s) >= 2 for s in saves.values()), f"no attempt saved twice: {saves}"
    for attempt_id, seq in saves.items():
        assert seq[0][0] == 0, (attempt_id, seq)
        assert all(now == before[1] for before, (now, _) in zip(seq, seq[1:])), (attempt_id, seq)


# ---- the commit batch on its own ----------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_batch_is_due_once_its_window_has_passed_since_its_first_event():
    clock = Clock()
    batch = CommitBatch(window_s=0.015, max_events=100, clock=clock)
    assert not batch.due() and batch.time_left() is None
    batch.add_finished("a", 1)
    clock.now = 0.010
    batch.add_finished("b", 2)
    assert not batch.due() and batch.time_left() == pytest.approx(0.005)
    clock.now = 0.015
    assert batch.due()
    taken = batch.take()
    assert [x for x, _ in taken.finished] == ["a", "b"] and batch.empty and not batch.due()


def test_a_batch_is_due_early_once_it_holds_max_events():
    batch = CommitBatch(window_s=10.0, max_events=3, clock=Clock())
    batch.add_finished("a", 1)
    batch.add_progress(("g", 1), "turn 1")
    assert not batch.due()
    batch.add_completed("group")
    assert batch.due() and batch.time_left() == 0.0


def test_only_an_attempts_latest_turn_is_written_and_none_once_it_finished():
    batch = CommitBatch(window_s=1.0, max_events=100, clock=Clock())
    batch.add_progress(("g", 1), "turn 1")
    batch.add_progress(("g", 1), "turn 2")
    batch.add_progress(("g", 2), "turn 1")
    batch.drop_progress(("g", 2))
    assert batch.take().progress == {("g", 1): "turn 2"}


def test_a_batch_refuses_a_window_or_size_that_would_never_close():
    with pytest.raises(ValueError, match="window_s > 0"):
        CommitBatch(window_s=0.0, max_events=1)
    with pytest.raises(ValueError, match="max_events >= 1"):
        CommitBatch(window_s=1.0, max_events=0)


# ---- turn-level recovery ------------------------------------------------------------------


class CountingEngine:
    """The reference engine, recording the request id of every call submitted."""

    def __init__(self, engine):
        self.engine, self.submitted = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, request):
        self.submitted.append(request.request_id)
        return self.engine.submit(request)


def _samples(path) -> dict[tuple[int, int], tuple]:
    db = sqlite3.connect(path)
    rows = db.execute("SELECT prompt_id, generation_index, token_ids, logprobs, reward, version_token_counts "
                      "FROM samples").fetchall()
    db.close()
    return {(p, i): rest for p, i, *rest in rows}


def test_an_episode_restored_at_its_last_committed_turn_redoes_no_earlier_turn_and_ends_as_its_never_stopped_twin(
        tmp_path, policy_dir):
    from rolloutdb.controller.run.dispatch import GroupHandle
    from rolloutdb.gpu_capture import load_policy
    from rolloutdb.store import Publisher
    from rolloutdb.store.restore.apply import restore_snapshot

    _, tokenizer = load_policy(policy_dir)
    env = MultiTurnDigitEnv(DigitPromptDataset(size=64, n_digits=2), tokenizer, turns=4)
    overrides = {"generation": {"max_tokens": 3, "max_inflight_calls": 4},
                 "rollout_recovery": {"target_level": "turn", "commit_window_ms": 1.0}}
    # The twin: the same step, never stopped.
    twin, _ = make_parts(tmp_path / "twin", policy_dir, env, overrides=overrides)
    try:
        run_pump(twin)
    finally:
        close(twin)
    # The stopped run: stop once two episodes have a committed turn saved with its tokens.
    live = tmp_path / "run" / "store.sqlite"
    parts, _ = make_parts(tmp_path / "run", policy_dir, env, overrides=overrides)

    def stop_when_turns_are_saved(step):
        db = sqlite3.connect(live)
        saved = db.execute("SELECT count(*) FROM env_episodes WHERE transcript_tokens IS NOT NULL AND turn >= 1").fetchone()[0]
        db.close()
        if saved >= 2:
            parts.runtime.stop.set()

    parts.engine.step_callback = stop_when_turns_are_saved
    try:
        run_pump(parts)
    finally:
        close(parts)
    pub = Publisher(tmp_path / "ckpt")
    pub.publish_trainer_checkpoint(None, lambda d: (d / "weights.bin").write_bytes(b"w"))
    with Store.open(live) as store:
        snap = pub.publish_rollout_snapshot("bootstrap", lambda p: store.capture(p), config_text="algorithm: {}\n").path
    pub.close()
    plan = restore_snapshot(snap, live, config_fingerprint="", dataset_fingerprint="", forest_training={},
                            groups_per_step=4)
    saved = {k: s for k, s in plan.saved_episodes.items() if s.token_ids is not None}
    assert len(saved) >= 2 and all(s.turn >= 1 for s in saved.values())

    # The resumed pump: restored groups first, each saved episode from its saved turn.
    resumed, _ = make_parts_on(live, policy_dir, env, overrides=overrides)
    resumed.engine = CountingEngine(resumed.engine)
    groups = [(GroupHandle(g.group_id, g.reservation, g.target_step, g.num_generations, attempts={}),
               list(g.generations_to_run))
              for g in sorted(plan.redispatch + plan.to_finalize, key=lambda g: g.sample_seq)]
    pump = RolloutPump(resumed, groups, plan.saved_episodes)
    thread = threading.Thread(target=pump.run, name="rollout-pump")
    thread.start()
    thread.join(120)
    try:
        assert not thread.is_alive() and resumed.runtime.error is None, resumed.runtime.error
    finally:
        close(resumed)
    for (group, index), episode in saved.items():
        turns = sorted(int(rid.rsplit("-t", 1)[1]) for rid in resumed.engine.submitted
                       if rid.startswith(f"g{group}.{index}-"))
        assert turns == list(range(episode.turn, 4)), (group, index, episode.turn, turns)
    # Every generation, restored at a turn or redone from the start, ends as in the twin.
    assert _samples(live) == _samples(tmp_path / "twin" / "store.sqlite")


def make_parts_on(path, policy_dir, env, *, overrides: dict):
    """Parts over an existing store file (a restored one)."""
    parts, events = make_parts(path.parent / "unused", policy_dir, env, overrides=overrides)
    parts.store.close()
    parts.store = Store.open(path)
    return parts, events
