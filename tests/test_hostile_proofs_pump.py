"""Proofs that can fail: the rollout pump's and the prefix cut's promises, each checked by
a test that a small, realistic planted bug fails (tests/mutation/run_mutations.py plants
them). Real parts throughout: a real store file, the reference engine on the tiny policy,
a real Publisher and snapshot pump, a real trace file; what was saved is read back
through a second connection (sqlite3, decoded here with numpy, not by the code under test).

- a cut saves exactly what the engine decoded: for every call the cut saved, the same
  token ids, logprobs and versions, no token more or less, and no call left out (a
  seeded continuation would re-decode a dropped last token to the same value, so only a
  direct comparison notices a cut that loses it);
- a cut saves prefixes only of attempts the ledger runs at the cut: the engine still
  reports calls whose attempts the ledger has already finished or abandoned;
- the trace holds every committed finish: the store's finished attempts and the trace's
  `rollout_finished` events are the same set, and so are sealed groups and `group_sealed`;
- a resume hands out the restored groups first and within `generation.max_inflight_calls`;
- the trace holds a finish event for every generation of every sealed group, across a
  stop and a resume (the restored groups' earlier generations finished in the first run).
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from test_streaming_pump import LengthEnv, close, make_parts, make_parts_on, policy_dir, run_pump  # noqa: F401 - fixture

from rolloutdb.controller.run.dispatch import GroupHandle
from rolloutdb.controller.recovery.env_checkpoint import NoEnvironmentCheckpoint
from rolloutdb.controller.rollout.pump import RolloutPump
from rolloutdb.controller.run.sampler import PromptOrder
from rolloutdb.controller.recovery.snapshot_pump import SnapshotPump
from rolloutdb.controller.tasks.digits import DigitPromptDataset, MultiTurnDigitEnv
from rolloutdb.gpu_capture import ReferenceEngine
from rolloutdb.store import FinishedGeneration, Publisher, Store, codec, open_tracer
from rolloutdb.store.checkpoints.layout import SNAPSHOT_DB
from rolloutdb.store.trace.writer import TRACE_FILENAME

DEADLINE_S = 120  # a hang, not speed: generous on a loaded 2-core machine


def _rows(db: Path, sql: str, *args) -> list[tuple]:
    """A second, read-only connection (the trace file is left in rollback-journal mode
    once closed, so a read-only reader is fine)."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return conn.execute(sql, args).fetchall()


class RecordingEngine(ReferenceEngine):
    """The reference engine, which also remembers what it told the last cut
    (`running_calls`, read under its lock: exactly what it had decoded then), every
    future it handed out, and the most calls it ever had in progress at once (submitted,
    not yet finished)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.at_cut: dict | None = None
        self.futures: dict[str, object] = {}
        self.submitted: list[str] = []
        self._count_lock = threading.Lock()
        self.in_progress = 0
        self.most_in_progress = 0

    def running_calls(self, since=None):
        self.at_cut = super().running_calls(since)
        return self.at_cut

    def submit(self, request):
        with self._count_lock:
            self.in_progress += 1
            self.most_in_progress = max(self.most_in_progress, self.in_progress)
        self.submitted.append(request.request_id)
        future = super().submit(request)
        self.futures[request.request_id] = future
        future.add_done_callback(self._call_done)
        return future

    def _call_done(self, _future) -> None:
        with self._count_lock:
            self.in_progress -= 1


def _with_engine(parts, policy_dir, slots: int = 16) -> RecordingEngine:  # noqa: F811
    parts.engine.close()
    parts.engine = RecordingEngine(policy_dir, max_batch_size=slots, num_threads=1)
    return parts.engine


class StepGate:
    """Holds the engine's worker right after its `at`-th step (outside the engine lock:
    a cut reads the engine meanwhile, and nothing is decoded until `release`)."""

    def __init__(self, eng, at: int):
        self.at, self.reached, self.release = at, threading.Event(), threading.Event()
        eng.step_callback = self._callback

    def _callback(self, step: int) -> None:
        if step == self.at:
            self.reached.set()
            self.release.wait(DEADLINE_S)


class Weights:
    def save_checkpoint(self, path: Path) -> None:
        (path / "weights.bin").write_bytes(b"w" * 64)


def _cut_while_gated(tmp_path, policy_dir, before_cut: Callable | None = None):  # noqa: F811
    """A prefix-level pump with one long call per group's first prompt and one-token
    calls for the others, its engine held after step 6 (the long calls have decoded 6
    tokens, the short ones finished at step 1 and wait, in transit, for the pump), then
    a real snapshot attempt cut there. Returns (snapshot file, engine, pump)."""
    first = [r.prompt_id for r in PromptOrder(64, seed=0).take(0, 4)]
    parts, _ = make_parts(tmp_path, policy_dir, LengthEnv(long=40, long_prompt=first[0]),
                          overrides={"algorithm": {"groups_per_step": 4, "group_size": 2},
                                     "rollout_recovery": {"target_level": "prefix"}})
    eng = _with_engine(parts, policy_dir)
    gate = StepGate(eng, at=6)
    publisher = Publisher(tmp_path / "checkpoints")
    try:
        pump = RolloutPump(parts)
        pump._commit()  # dispatches the step's groups and submits their calls; the pump's loop never runs
        assert gate.reached.wait(DEADLINE_S), "the engine did not reach its sixth step"
        if before_cut is not None:
            before_cut(parts, pump)
        publisher.publish_bootstrap(Weights().save_checkpoint)
        snapshots = SnapshotPump(parts, publisher, interval_s=60.0, config_text="a: 1\n",
                                 env_checkpoint=NoEnvironmentCheckpoint())
        snapshots.uncommitted_calls = pump.uncommitted_calls
        result = snapshots.attempt(force=True)
        assert result.outcome == "published", result
    finally:
        parts.runtime.stop.set()
        gate.release.set()
        parts.engine.close()
        parts.store.close()
        publisher.close()
    snap = tmp_path / "checkpoints" / "bootstrap" / "rollout_snapshots" / f"snapshot_{result.sequence}" / SNAPSHOT_DB
    return snap, eng, pump


def _saved_calls(snap: Path) -> dict[str, tuple[list[int], list[float], list[int]]]:
    """The snapshot's `token_chunks`, decoded by hand, by the engine request id of the
    call they belong to (single-turn episodes: turn 0)."""
    keys = {a: f"g{g}.{i}-a{n}-t0" for a, g, i, n in _rows(
        snap, "SELECT attempt_id, group_id, generation_index, attempt FROM rollouts")}
    saved: dict[str, tuple[list[int], list[float], list[int]]] = {}
    segments = snap.parents[3] / "payload_segments"  # CHECKPOINT_DIR/<anchor>/rollout_snapshots/snapshot_<n>/
    for attempt_id, ids, lps, version, file_name, row in _rows(
            snap, "SELECT c.attempt_id, c.token_ids, c.logprobs, c.policy_version, p.file_name, c.segment_row "
                  "FROM token_chunks c LEFT JOIN payload_segments p ON p.segment_id = c.segment_id "
                  "ORDER BY c.attempt_id, c.chunk_index"):
        if file_name is not None:  # written once into a segment by this cut or an earlier one
            ((ids, lps),) = _rows(segments / file_name, "SELECT token_ids, logprobs FROM payload WHERE sample_id = ?", row)
        tokens, logprobs, versions = saved.setdefault(keys[attempt_id], ([], [], []))
        ids_now = np.frombuffer(ids, "<i4").tolist()
        tokens += ids_now
        logprobs += np.frombuffer(lps, "<f4").tolist()
        versions += [version] * len(ids_now)
    return saved


def _f32(values) -> list[float]:
    return np.asarray(values, dtype="<f4").tolist()  # what the chunks store


# ---- (a) a cut saves exactly what the engine decoded ---------------------------------------


def test_a_cut_saves_exactly_the_tokens_logprobs_and_versions_the_engine_had_decoded_for_each_call(
        tmp_path, policy_dir):  # noqa: F811
    snap, eng, _ = _cut_while_gated(tmp_path, policy_dir)
    assert eng.at_cut is not None, "the cut never asked the engine what it had decoded"
    # What the engine had decoded at the cut: its running calls as it reported them under
    # its lock, and the calls it had finished before (their results: nothing decodes
    # while the engine is held, so these are exactly what was done at the cut).
    decoded = {rid: (c.token_ids, _f32(c.logprobs), c.token_versions) for rid, c in eng.at_cut.items() if c.token_ids}
    finished = {rid: f.result() for rid, f in eng.futures.items() if f.done() and rid not in eng.at_cut}
    decoded.update({rid: (r.token_ids, _f32(r.logprobs), r.token_versions) for rid, r in finished.items()})
    running_lengths = sorted(len(ids) for rid, (ids, _, _) in decoded.items() if rid in eng.at_cut)
    assert running_lengths == [6, 6], "two long calls, six tokens each at the cut"
    assert finished and all(len(r.token_ids) == 1 for r in finished.values()), "one-token calls done in transit"
    saved = _saved_calls(snap)
    assert sorted(saved) == sorted(decoded), "the cut saved other calls than the engine had decoded"
    for rid, (ids, logprobs, versions) in decoded.items():
        got = saved[rid]
        assert len(got[0]) == len(ids), f"{rid}: {len(got[0])} tokens saved, the engine had decoded {len(ids)}"
        assert got == (ids, logprobs, versions), rid


# ---- (c) a cut saves prefixes only of attempts the ledger runs at the cut ------------------


def test_a_cut_saves_no_prefix_of_a_call_the_engine_still_runs_whose_attempt_the_ledger_finished_or_abandoned(
        tmp_path, policy_dir):  # noqa: F811
    ended: dict[str, str] = {}

    def end_two_attempts(parts, pump):
        """The race: the ledger has ended these attempts (one finished, one abandoned and
        started again, as an agent server's lost episode is) while the engine still runs
        their calls; written by the pump's own dispatcher, in one transaction."""
        long_group = next(run.handle for run in pump._groups.values()
                          if any(rid.startswith(f"g{run.handle.group_id}.") and len(c.token_ids) == 6
                                 for rid, c in parts.engine.running_calls().items()))
        g = long_group
        ended[f"g{g.group_id}.0-a0-t0"], ended[f"g{g.group_id}.1-a0-t0"] = "finished", "abandoned"
        with parts.store.atomic() as tx:
            parts.dispatcher.finish(tx, [(g, {0: FinishedGeneration([5], [-1.0], 1.0, codec.version_runs([0]))})])
            parts.dispatcher.retry(tx, [(g, 1, "error")], policy_version=0)

    snap, eng, _ = _cut_while_gated(tmp_path, policy_dir, before_cut=end_two_attempts)
    running = {rid for rid, c in eng.at_cut.items() if c.token_ids}
    assert set(ended) <= running, "the engine still reported both calls at the cut"
    states = {f"g{g}.{i}-a{n}-t0": s for g, i, n, s in _rows(
        snap, "SELECT group_id, generation_index, attempt, state FROM rollouts")}
    assert {rid: states[rid] for rid in ended} == ended
    saved = _saved_calls(snap)
    assert not set(saved) & set(ended), f"prefixes of ended attempts were saved: {sorted(set(saved) & set(ended))}"
    assert saved, "the other calls running at the cut were still saved"
    assert all(states[rid] == "running" for rid in saved)


# ---- (b) the trace holds every committed finish ---------------------------------------------


def _traced(parts, trace_dir: Path):
    parts.tracer = open_tracer(trace_dir, enabled=True)
    return parts.tracer


def test_the_trace_holds_exactly_the_finishes_and_seals_a_real_pump_committed(tmp_path, policy_dir):  # noqa: F811
    from rolloutdb.gpu_capture import load_policy

    _, tokenizer = load_policy(policy_dir)
    env = MultiTurnDigitEnv(DigitPromptDataset(size=64, n_digits=2), tokenizer, turns=2)
    # Many small batches (a 1 ms window) of calls that finish at different times.
    parts, _ = make_parts(tmp_path, policy_dir, env,
                          overrides={"algorithm": {"groups_per_step": 6, "group_size": 3},
                                     "generation": {"max_tokens": 6, "temperature": 1.0, "max_inflight_calls": 9},
                                     "rollout_recovery": {"commit_window_ms": 1.0}})
    tracer = _traced(parts, tmp_path / "logs")
    try:
        run_pump(parts, timeout=DEADLINE_S)
    finally:
        tracer.close()
        close(parts)
    store, trace = tmp_path / "store.sqlite", tmp_path / "logs" / TRACE_FILENAME
    committed = {(g, i, n): (t, r) for g, i, n, t, r in _rows(
        store, "SELECT r.group_id, r.generation_index, r.attempt, s.num_tokens, s.reward FROM rollouts r "
               "JOIN samples s ON s.group_id = r.group_id AND s.generation_index = r.generation_index "
               "WHERE r.state = 'finished'")}
    traced = _rows(trace, "SELECT group_id, generation_index, attempt, tokens, reward FROM rollout_finished")
    assert len(committed) == 18
    assert len(traced) == len({(g, i, n) for g, i, n, _, _ in traced}), "a finish traced twice"
    assert {(g, i, n): (t, r) for g, i, n, t, r in traced} == committed
    sealed = {g for (g,) in _rows(store, "SELECT group_id FROM replay_groups")}
    assert len(sealed) == 6
    assert {g for (g,) in _rows(trace, "SELECT group_id FROM group_sealed")} == sealed
    assert {g for (g,) in _rows(trace, "SELECT group_id FROM group_published")} == sealed


# ---- (d), (e) a stopped run, restored and resumed -------------------------------------------

# Below what the first run leaves to redo: it is stopped once its first calls finished,
# but on a loaded machine more finish before it stops (3 of 8 left in a CI run, when the
# limit was 3 and the stop waited for 2 finished: the fixture had nothing to test).
RESUMED_INFLIGHT = 2


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, policy_dir):  # noqa: F811
    """A pump stopped while its four groups of two have their calls in flight (some
    generations already finished), its store snapshotted, restored (the running attempts
    abandoned with reason `restart`) and resumed by a new pump with room for only
    RESUMED_INFLIGHT calls and a second step to open, on an engine that records how many
    calls it had at once and the order they came in.
    Both runs write the same trace file. Returns (live store, trace file, restore plan,
    resumed engine)."""
    from rolloutdb.gpu_capture import load_policy
    from rolloutdb.store.restore.apply import restore_snapshot

    tmp = tmp_path_factory.mktemp("resumed")
    _, tokenizer = load_policy(policy_dir)
    env = MultiTurnDigitEnv(DigitPromptDataset(size=64, n_digits=2), tokenizer, turns=3)
    first = {"algorithm": {"groups_per_step": 4, "group_size": 2},
             "generation": {"max_tokens": 8, "temperature": 1.0, "max_inflight_calls": 8},
             "rollout_recovery": {"commit_window_ms": 1.0}}
    live = tmp / "run" / "store.sqlite"
    parts, _ = make_parts(tmp / "run", policy_dir, env, overrides=first)
    tracer = _traced(parts, tmp / "logs")

    def stop_once_some_finished(step):
        with contextlib.closing(sqlite3.connect(live)) as db:
            done = db.execute("SELECT count(*) FROM rollouts WHERE state = 'finished'").fetchone()[0]
        if done >= 1:
            parts.runtime.stop.set()

    parts.engine.step_callback = stop_once_some_finished
    try:
        pump = RolloutPump(parts)
        thread = threading.Thread(target=pump.run, name="rollout-pump")
        thread.start()
        thread.join(DEADLINE_S)
        assert not thread.is_alive() and parts.runtime.error is None, parts.runtime.error
    finally:
        tracer.close()
        close(parts)
    pub = Publisher(tmp / "ckpt")
    pub.publish_trainer_checkpoint(None, lambda d: (d / "weights.bin").write_bytes(b"w"))
    with Store.open(live) as store:
        snap = pub.publish_rollout_snapshot("bootstrap", lambda p: store.capture(p), config_text="algorithm: {}\n").path
    pub.close()
    plan = restore_snapshot(snap, live, config_fingerprint="", dataset_fingerprint="", forest_training={},
                            groups_per_step=4)
    restored_calls = sum(len(g.generations_to_run) for g in plan.redispatch)
    assert restored_calls > RESUMED_INFLIGHT, f"only {restored_calls} calls to redo: no limit to test"

    # The resumed run may also open step 2 (four new groups), which must wait for the restored ones.
    second = {**first, "algorithm": {**first["algorithm"], "total_steps": 2, "max_staleness": 1},
              "generation": {**first["generation"], "max_inflight_calls": RESUMED_INFLIGHT}}
    resumed, _ = make_parts_on(live, policy_dir, env, overrides=second)
    eng = _with_engine(resumed, policy_dir)
    tracer = _traced(resumed, tmp / "logs")
    groups = [(GroupHandle(g.group_id, g.reservation, g.target_step, g.num_generations, attempts={}),
               list(g.generations_to_run))
              for g in sorted(plan.redispatch + plan.to_finalize, key=lambda g: g.sample_seq)]
    pump = RolloutPump(resumed, groups, plan.saved_episodes)
    thread = threading.Thread(target=pump.run, name="rollout-pump")
    thread.start()
    thread.join(DEADLINE_S)
    try:
        assert not thread.is_alive() and resumed.runtime.error is None, resumed.runtime.error
    finally:
        tracer.close()
        close(resumed)
    return live, tmp / "logs" / TRACE_FILENAME, plan, eng


def test_a_resume_hands_out_the_restored_groups_first_and_never_more_calls_than_max_inflight_calls(resumed_run):
    live, _, plan, eng = resumed_run
    assert eng.most_in_progress <= RESUMED_INFLIGHT, (
        f"{eng.most_in_progress} calls in the engine at once; generation.max_inflight_calls is {RESUMED_INFLIGHT}")
    restored = {g.group_id for g in plan.redispatch}
    groups = [int(rid[1:].split(".", 1)[0]) for rid in eng.submitted]
    assert restored <= set(groups)
    new = set(groups) - restored
    assert len(new) == 4, f"the resumed run opened step 2: {groups}"
    first_call = {g: groups.index(g) for g in set(groups)}
    assert max(first_call[g] for g in restored) < min(first_call[g] for g in new), (
        f"a new group's call was handed out before a restored group's first call: {groups}")


def test_the_trace_holds_a_finish_event_for_every_generation_of_every_sealed_group_across_a_resume(resumed_run):
    live, trace, plan, _ = resumed_run
    sealed = {g: n for g, n in _rows(live, "SELECT group_id, num_generations FROM prompt_groups "
                                           "WHERE group_id IN (SELECT group_id FROM replay_groups)")}
    assert len(sealed) == 8  # four restored, four new
    finished_in_store = {(g, i): n for g, i, n in _rows(
        live, "SELECT group_id, generation_index, attempt FROM rollouts WHERE state = 'finished'")}
    traced = {}
    for g, i, n in _rows(trace, "SELECT group_id, generation_index, attempt FROM rollout_finished"):
        assert (g, i) not in traced, f"generation {(g, i)} finished twice in the trace"
        traced[(g, i)] = n
    for group, generations in sealed.items():
        for i in range(generations):
            assert (group, i) in traced, f"sealed group {group}: no finish event for generation {i}"
            assert traced[(group, i)] == finished_in_store[(group, i)], (group, i)
    assert {g for (g,) in _rows(trace, "SELECT group_id FROM group_sealed")} == set(sealed)
    # Some generations finished in the first run, the rest in the resumed one.
    assert {run for (run,) in _rows(trace, "SELECT run FROM rollout_finished")} == {1, 2}
