"""Rollout snapshots: the snapshot pump and one attempt's order of work.

An attempt, in order:
1. take the save lock (the Publisher's: shared with trainer checkpoints, retention and
   deferred publication; runtime.py has the lock order); skip
   if the train pump is committing an optimizer step (`skipped_commit`), or if the
   store's mutation counter has not moved since the last published snapshot
   (`skipped_unchanged`), unless forced;
2. resolve the anchor: `bootstrap` before the first step, else `step_<N>`; skip unless
   that trainer checkpoint is durable (`skipped_not_durable`);
2b. seal the payload still inline into a new immutable payload segment (checkpoints/
   segments.py), so the cut copies references: a snapshot writes new payload once. Not
   while the train pump waits for the cut: the pump seals right after (`seal_payload`);
3. the environment phase (retire, prepare, commit, drain, export), for backends that
   hold rollout state (controller/agent_server/client.py); a server that fails it fails
   the attempt, never the run; abort if an optimizer commit starts meanwhile
   (`aborted_commit`);
4. the cut: take the commit lock without waiting, begin the read transaction, re-check
   the trainer has not moved and the environment's export against the ledger as of the
   cut, release the commit lock, and copy the store as of that cut (the checked export
   goes into the copy's `env_episodes`: the snapshot's own file). The pumps are never
   stopped: the only exclusive hold is the commit lock, for the time it takes to begin a
   read transaction;
5. leave the environment phase (resume) before any fsync;
6. publish through the one commit protocol (`stage.publish`, store/checkpoints/publish.py),
   outside every lock but the save lock.

Every attempt records its outcome here and only here (`attempt`): one `AttemptResult`
becomes one row in the store (`snapshot_attempts`) and one `snapshot` line in the
metrics. The Publisher records nothing; publication is about files.

Asynchronous trainer checkpoints (`checkpointing.async`): a snapshot anchored to
`step_<N>` must be cut while the trainer is at step N, but `step_<N>` is published only
at a later step boundary. So the train pump's forced attempt at boundary N takes its
cut into a stage *held* inside the checkpoint's temporary directory
(`Publisher.begin_snapshot(anchor, pending=...)`), and step 6 waits: the held stage is
published, and its attempt recorded, once the checkpoint is (`publish_held`); if the
checkpoint is never published the attempt is recorded `failed`. While a checkpoint is
pending, other attempts find no durable anchor (`skipped_not_durable`): a snapshot never
anchors to an unpublished checkpoint.

Words: a pump's write transaction is a *mutation* (the store's `mutation_counter` counts
them); a snapshot's read transaction, the one consistent state it copies, is its *cut*
(`cut_time`, `at_cut`). A "commit" here is the train pump's optimizer commit.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from rolloutdb.controller.recovery.env_checkpoint import EnvironmentCheckpoint
from rolloutdb.controller.run.runtime import RolloutParts
from rolloutdb.controller.run.tracing import RolloutTrace
from rolloutdb.gpu_capture.protocol import PrefixCapture
from rolloutdb.store import (CallPrefix, EpisodeProgress, Publisher, PublishError, anchor_name, faults, pools, queries,
                             scan, seal_inline_payload, segments_dir_of)

log = logging.getLogger("rolloutdb.controller")

# How long a snapshot waits for the rollout pump to commit what finished before its cut
# (turn and prefix level); past it the cut goes ahead without (one loop turn is ~ms).
FLUSH_WAIT_S = 0.1

# How long the train pump waits for the cut of the snapshot anchored to a new trainer
# checkpoint before it gives the wait up (`anchor_new_checkpoint`).
ANCHOR_WAIT_S = 30.0


@dataclass(eq=False)  # compared by identity
class _CutWaiter:
    step: int
    event: threading.Event = field(default_factory=threading.Event)
    cut_taken: bool = False


class AbortedCommit(Exception):
    """An optimizer commit started between resolving the anchor and the cut."""


class ExportMismatch(RuntimeError):
    """The environment's export disagrees with the ledger at the cut."""


@dataclass
class _AtCut:
    """What the cut adds to the snapshot's file, and the engine's decode count at it."""

    episodes: list[EpisodeProgress] = field(default_factory=list)
    prefixes: list[CallPrefix] = field(default_factory=list)
    decoded: int | None = None
    hold_s: float | None = None  # how long the prefix read held the engine's output step
    cut_calls: list[dict] = field(default_factory=list)  # the trace's call_cut events, once published
    fallbacks: list[dict] = field(default_factory=list)  # the trace's call_fallback events, once published


def _into_copy(out, at: _AtCut) -> dict[str, int]:
    """The checked export into the snapshot's own `env_episodes`, the running calls'
    prefixes into its `token_chunks` (capture's `into_copy`)."""
    if at.episodes:
        pools.put_episodes(out, at.episodes)
    chunks = pools.put_prefixes(out, at.prefixes) if at.prefixes else 0
    return {"env_episodes": len(at.episodes), "token_chunks": chunks}


# The engine request id of an in-process episode's call: `g<group>.<generation>-a<attempt>-t<turn>`
# (controller/rollout/pump.py `_live`, episodes.Episode.request), and of an agent server's
# call (`<group>.<generation>-a<attempt>-t<turn>`, no `g`: the policy endpoint's `<key>-t<turn>`).
_IN_PROCESS_CALL = re.compile(r"^g([0-9]+)\.([0-9]+)-a([0-9]+)-t([0-9]+)$")
_AGENT_CALL = re.compile(r"^([0-9]+)\.([0-9]+)-a([0-9]+)-t([0-9]+)$")


@dataclass
class AttemptResult:
    """One attempt's outcome: the source of its `snapshot_attempts` row and its metrics line."""

    outcome: str
    anchor: str | None = None
    sequence: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    # The store's mutation counter at the cut, once a cut was taken; else the row takes
    # the counter when it is written.
    mutation_counter: int | None = None


@dataclass(eq=False)
class _Held:
    """A cut anchored to a pending checkpoint, published once the checkpoint is."""

    stage: Any  # SnapshotStage inside the pending checkpoint's temporary directory
    capture: Any
    result: AttemptResult


HELD = "held"  # not an outcome: the attempt is recorded when its held stage resolves


class SnapshotPump:
    """The snapshot pump. Reached only through `run` (its thread), `attempt`, `wake` and
    `anchor_new_checkpoint` (the train pump)."""

    def __init__(
        self,
        parts: RolloutParts,
        publisher: Publisher,
        *,
        interval_s: float,
        config_text: str,
        env_checkpoint: EnvironmentCheckpoint,
    ):
        self.p = parts
        self.publisher = publisher
        self.interval_s = interval_s
        self.config_text = config_text
        self.env = env_checkpoint  # build.build_env_checkpoint: the environment phase of step 3
        # Step 2b: segments are read from, and kept in, the checkpoint directory.
        parts.store.segments_dir = segments_dir_of(publisher.root)
        publisher.live_references = parts.store.segment_references
        self._wake = threading.Event()
        self._force = False
        self._waiters: list[_CutWaiter] = []
        self._waiters_lock = threading.Lock()
        self._last_counter: int | None = None
        self._pending: Any = None  # store.TrainerStage: an async checkpoint not yet published
        self._held: list[_Held] = []  # touched under the save lock only
        self._retired: set[str] = set()  # the keys this attempt's retire named
        self._seal_owed = False  # an attempt skipped its seal: `seal_payload` seals after it
        # Prefix level: every cut saves the running calls' prefixes, and a snapshot whose
        # store did not change is still due when the engine decoded since the last one.
        engine = parts.engine
        cfg = parts.config
        self.capture: PrefixCapture | None = (
            engine if cfg is not None and cfg.rollout_recovery.target_level == "prefix"
            and isinstance(engine, PrefixCapture) else None)
        self.prefix = self.capture is not None
        self._last_decoded: int | None = None
        self.trace = RolloutTrace(parts.tracer)
        # Turn and prefix level: the rollout pump's `flush`, set by the controller.
        self.flush_rollouts: Callable[[float], bool] | None = None
        # Prefix level: the rollout pump's `uncommitted_calls`, set by the controller.
        self.uncommitted_calls: Callable[[], dict] | None = None
        self._export: dict[str, dict] = {}  # this attempt's export, read after drain
        self._expected: set[str] = set()
        # The latest attempts, for tests and benchmarks; bounded for runs of days.
        self.results: deque[AttemptResult] = deque(maxlen=1024)

    # ------------------------------------------------------------ the pump

    def run(self) -> None:
        rt = self.p.runtime
        try:
            while not rt.stop.is_set():
                self._wake.wait(self.interval_s)
                self._wake.clear()
                if rt.stop.is_set():
                    return
                force, self._force = self._force, False
                self.attempt(force=force)
                self.publish_held()
                self.seal_payload()
        except BaseException as e:  # noqa: BLE001 - handed to the controller
            rt.fail(e)

    def seal_payload(self) -> None:
        """After an attempt that skipped its seal (the train pump waited for its cut), seal; after
        one that sealed, nothing (one segment per interval). A failure: logged, sealed later."""
        if not self._seal_owed:
            return
        self._seal_owed = False
        try:
            with self.publisher.lock:
                seal_inline_payload(self.p.store, self.publisher.root)
        except Exception as e:  # noqa: BLE001 - the payload stays inline and is sealed later
            log.warning("rolloutdb: sealing payload failed (%s); the next snapshot retries", _one_line(e))

    def wake(self, *, force: bool = False) -> None:
        """Take an attempt now."""
        self._force = self._force or force
        self._wake.set()

    def anchor_new_checkpoint(self, step: int, *, pending: Any = None, timeout: float = ANCHOR_WAIT_S) -> bool:
        """Called by the train pump right after it published `step_<step>`: a forced
        attempt anchored to it, and a wait until that attempt's *cut* is taken (or the
        attempt ended). The copy and the fsyncs then run on the snapshot pump while
        training goes on; the wait keeps the next optimizer commit from landing before
        the cut, so every durable checkpoint gets its snapshot. Returns whether a cut
        anchored to `step` was taken.

        A wait past `timeout` is given up, not raised: the trainer checkpoint is durable
        whatever happens to its snapshot, and a slow snapshot (a slow environment drain,
        a slow disk) must not stall training. Giving up costs at most that snapshot (the
        next optimizer commit may land first: the attempt then ends `aborted_commit`,
        and a resume starts from an earlier snapshot). So it is said, not hidden: a
        `snapshot_wait` line with outcome `timed_out` in the metrics and a warning.

        `pending` (async checkpoints): the `TrainerStage` of `step_<step>`, begun but not
        published; the cut is held inside it until it is (module docstring)."""
        waiter = _CutWaiter(step)
        with self._waiters_lock:
            self._pending = pending
            self._waiters.append(waiter)
        self.wake(force=True)
        if not waiter.event.wait(timeout):
            with self._waiters_lock:
                answered = waiter.event.is_set()  # the cut may have landed just now
                if not answered:
                    self._waiters.remove(waiter)
            if not answered:
                self._wait_timed_out(step, timeout)
        return waiter.cut_taken

    def _wait_timed_out(self, step: int, timeout: float) -> None:
        anchor = anchor_name(step or None)
        log.warning("rolloutdb: no snapshot cut anchored to %s within %.1f s; training goes on without waiting "
                    "(that snapshot may be skipped; a resume would start from an earlier one)", anchor, timeout)
        self.p.log_event({"kind": "snapshot_wait", "outcome": "timed_out", "step": step, "anchor": anchor,
                          "waited_s": timeout, "t": time.time()})

    def _release_waiters(self, step: int | None, cut_taken: bool, only: list | None = None) -> None:
        with self._waiters_lock:
            keep = []
            for w in self._waiters:
                if (step is None or w.step == step) and (only is None or w in only):
                    w.cut_taken = w.cut_taken or cut_taken
                    w.event.set()
                else:
                    keep.append(w)
            self._waiters = keep

    # ------------------------------------------------------------ one attempt

    def attempt(self, *, force: bool = False) -> AttemptResult:
        t0 = time.perf_counter()
        with self._waiters_lock:
            seen = list(self._waiters)  # waiters this attempt can answer
        try:
            with self.publisher.lock:  # the save lock, for the whole attempt
                result = self._attempt_locked(force, t0)
        finally:
            self._release_waiters(None, False, only=seen)  # nobody waits past an attempt it saw
        if result.outcome != HELD:
            self.results.append(result)
            self._record(result)
        return result

    def publish_held(self) -> None:
        """Publish (and record) every held cut whose checkpoint is now published; record
        `failed` for one whose checkpoint was aborted. On the snapshot pump, and once on
        the main thread at the end of a run, after the pumps stopped."""
        if not self._held:  # appended only by this thread's attempts (or after it stopped)
            return
        done: list[AttemptResult] = []
        with self.publisher.lock:
            for held in [h for h in self._held if h.stage.pending.done]:
                self._held.remove(held)
                done.append(self._publish_one(held))
        for result in done:
            self.results.append(result)
            self._record(result)

    def _publish_one(self, held: _Held) -> AttemptResult:
        r = held.result
        held_at = r.timings.pop("_held_at")
        trainer = held.stage.pending
        if trainer.published is None or held.stage.done:
            return AttemptResult("failed", r.anchor, r.sequence, r.timings,
                                 f"its trainer checkpoint {r.anchor} was never published: {trainer.error}",
                                 r.mutation_counter)
        t_pub = time.perf_counter()
        try:
            # The environment's export is in the snapshot's own file (env_episodes).
            published = held.stage.publish(held.capture, self.config_text)
        except Exception as e:  # noqa: BLE001 - a failed publish is an outcome, the run goes on
            return AttemptResult("failed", r.anchor, r.sequence, r.timings, f"{type(e).__name__}: {e}",
                                 r.mutation_counter)
        timings = {**r.timings, "held_s": t_pub - held_at, "publish": time.perf_counter() - t_pub}
        self._last_counter = held.capture.mutation_counter
        self._last_decoded = held.capture.check_result.decoded
        self.trace.snapshot_cut(cut_time=held.capture.cut_time, snapshot_seq=published.sequence, anchor=r.anchor,
                                step=trainer.step, snapshot=str(published.path), group_states=held.capture.group_states)
        self.trace.cut(held.capture.check_result.cut_calls, held.capture.cut_time)
        self.trace.fallback(held.capture.check_result.fallbacks, held.capture.cut_time)
        return AttemptResult("published", r.anchor, published.sequence, timings, None, r.mutation_counter)

    def _record(self, result: AttemptResult) -> None:
        """The one place a snapshot attempt's outcome is recorded: its row, then its
        metrics line, both from `result`."""
        self.p.store.record_snapshot_attempt(
            result.outcome, anchor=result.anchor, snapshot_seq=result.sequence,
            mutation_counter=result.mutation_counter, timings=result.timings or None, error=result.error,
        )
        self.p.log_event({"kind": "snapshot", "outcome": result.outcome, "anchor": result.anchor,
                          "sequence": result.sequence, "mutation_counter": result.mutation_counter,
                          "timings": result.timings, "error": result.error, "t": time.time()})

    def _attempt_locked(self, force: bool, t0: float) -> AttemptResult:
        rt = self.p.runtime
        if rt.commit_lock.locked():
            return AttemptResult("skipped_commit")
        counter = self.p.store.mutation_counter
        if not force and counter == self._last_counter and (
                self.capture is None or self.capture.decoded_rows == self._last_decoded):
            return AttemptResult("skipped_unchanged")
        step = self.p.read_progress().step
        anchor = anchor_name(step or None)
        pending = self._pending
        if pending is not None and (pending.done or pending.anchor != anchor):
            pending = None
        if pending is None and anchor not in scan(self.publisher.root).durable_anchor_names():
            return AttemptResult("skipped_not_durable", anchor)
        # One held cut per pending checkpoint: the one its step boundary asked for.
        if pending is not None and (not force or any(h.stage.pending is pending for h in self._held)):
            return AttemptResult("skipped_not_durable", anchor)
        timings = {"lock_and_anchor": time.perf_counter() - t0}

        # 2b. Seal before the environment phase (dispatch stays open meanwhile) and the cut
        # (which then copies references). Not while the train pump waits for this cut: it
        # copies what finished since the last seal inline, sealed right after (`seal_payload`).
        waited_for = bool(self._waiters)  # unlocked read: a waiter arriving just after waits out this one seal
        self._seal_owed = self._seal_owed or waited_for
        if not waited_for:
            t_seal = time.perf_counter()
            try:
                sealed = seal_inline_payload(self.p.store, self.publisher.root)
            except Exception as e:  # noqa: BLE001 - a full disk fails this attempt, not the run; the payload stays inline
                return AttemptResult("failed", anchor, timings=timings, error=f"sealing payload: {_one_line(e)}")
            if sealed is not None:
                timings.update(sealed.timings, seal=time.perf_counter() - t_seal)

        t_env = time.perf_counter()
        try:
            self._retired = set(self._abandoned_episode_keys())
            self.env.retire(sorted(self._retired))
        except Exception as e:  # noqa: BLE001 - a server that does not answer fails this attempt, not the run
            return AttemptResult("failed", anchor, timings=timings, error=f"environment retire: {type(e).__name__}: {e}")
        try:
            try:
                self.env.prepare()
                faults.point("env.after_prepare")
                self.env.commit()
                faults.point("env.after_commit")
                self.env.drain()
                faults.point("env.after_drain")
                # Read before the cut: the export was fixed at commit, and the cut's
                # exclusive hold (the commit lock) must not wait on a server.
                self._export = self.env.export()
                self._expected = set(self.env.expected_keys()) if hasattr(self.env, "expected_keys") else set()
                faults.point("env.after_export")
            except Exception as e:  # noqa: BLE001 - as above
                return AttemptResult("failed", anchor, timings=timings,
                                     error=f"environment phase: {type(e).__name__}: {e}")
            timings["environment"] = time.perf_counter() - t_env
            if self.flush_rollouts is not None:
                t_flush = time.perf_counter()
                self.flush_rollouts(FLUSH_WAIT_S)  # what finished before the cut goes into it
                timings["flush"] = time.perf_counter() - t_flush
            if rt.commit_lock.locked() or self.p.read_progress().step != step:
                return AttemptResult("aborted_commit", anchor, timings=timings)
            try:
                stage = self.publisher.begin_snapshot(anchor, pending=pending)
            except PublishError as e:  # a full disk, a failed deferred publish: an outcome, like a failed publish
                return AttemptResult("failed", anchor, timings=timings, error=f"{type(e).__name__}: {e}")
            try:
                capture = self._cut(stage.db_path, step)
            except AbortedCommit:
                stage.abort()
                return AttemptResult("aborted_commit", anchor, timings=timings)
            except BaseException as e:
                stage.abort()  # the number is used up all the same: the row names it
                return AttemptResult("failed", anchor, stage.sequence, timings, f"{type(e).__name__}: {e}")
        finally:
            self.env.resume()  # dispatch reopens before any fsync of the snapshot
            if self.env.holds_rollout_state:
                timings["environment_hold"] = time.perf_counter() - t_env
        faults.point("snapshot.after_cut")
        timings.update({f"cut_{k}": v for k, v in capture.timings.items()})
        if capture.check_result.hold_s is not None:
            timings["prefix_hold"] = capture.check_result.hold_s
        if pending is not None:
            timings["_held_at"] = time.perf_counter()
            result = AttemptResult(HELD, anchor, stage.sequence, timings, None, capture.mutation_counter)
            self._held.append(_Held(stage, capture, result))
            return result
        t_pub = time.perf_counter()
        try:
            published = stage.publish(capture, self.config_text)
        except Exception as e:  # noqa: BLE001 - a failed publish is an outcome, the run goes on
            return AttemptResult("failed", anchor, stage.sequence, timings, f"{type(e).__name__}: {e}",
                                 capture.mutation_counter)
        timings["publish"] = time.perf_counter() - t_pub
        timings["total"] = time.perf_counter() - t0
        self._last_counter = capture.mutation_counter
        self._last_decoded = capture.check_result.decoded
        self.trace.snapshot_cut(cut_time=capture.cut_time, snapshot_seq=published.sequence, anchor=anchor, step=step,
                                snapshot=str(published.path), group_states=capture.group_states)
        self.trace.cut(capture.check_result.cut_calls, capture.cut_time)
        self.trace.fallback(capture.check_result.fallbacks, capture.cut_time)
        return AttemptResult("published", anchor, published.sequence, timings, None, capture.mutation_counter)

    def _cut(self, db_path, step: int):
        """Capture at a cut taken while the commit lock is held."""
        rt = self.p.runtime
        if not rt.commit_lock.acquire(blocking=False):
            raise AbortedCommit()
        held = [True]

        def at_cut(conn):
            try:
                if self.p.read_progress().step != step:
                    raise AbortedCommit()
                at = _AtCut(episodes=self._checked_export(conn))
                if self.capture is not None:
                    self._prefixes_at_cut(conn, self.capture, at)
                self._release_waiters(step, True)  # the train pump may commit again
                return at
            finally:
                rt.commit_lock.release()
                held[0] = False

        try:
            return self.p.store.capture(db_path, at_cut=at_cut, into_copy=_into_copy)
        finally:
            if held[0]:
                rt.commit_lock.release()

    def _checked_export(self, conn) -> list[EpisodeProgress]:
        """The environment's export, checked against the ledger as of the cut, as the
        rows the snapshot's `env_episodes` gets (attempts still running at the cut).

        Refused (the attempt fails with this message, nothing is published): a key the
        ledger does not know or that this attempt retired (the server kept an episode it
        was told to forget), and an attempt the server had acknowledged before the
        export, that the ledger still runs at the cut, missing from it (the server lost
        an agent). An exported attempt that finished after the export is dropped: its
        sample is in the cut; so is one whose group settled meanwhile (trained or
        discarded: its rows have left the live store, `queries.settled_episode_keys`)."""
        export, expected = self._export, self._expected
        if not export and not expected:
            return []
        known = queries.attempts_by_key(conn, set(export) | expected)
        settled = queries.settled_episode_keys(conn, [k for k in export if k not in known])
        unknown = sorted(k for k in export if (k not in known and k not in settled) or k in self._retired)
        missing = sorted(k for k in expected if known.get(k, (0, ""))[1] == "running" and k not in export)
        if unknown or missing:
            said = []
            if unknown:
                said.append(f"{len(unknown)} unknown or retired episodes ({', '.join(unknown[:3])})")
            if missing:
                said.append(f"{len(missing)} running attempts missing ({', '.join(missing[:3])})")
            raise ExportMismatch(f"the environment's export disagrees with the ledger at the cut: {'; '.join(said)}; "
                                 "the snapshot was refused")
        rows = []
        for key, agent in sorted(export.items()):
            attempt_id, state = known.get(key, (0, "settled"))
            if state != "running":
                continue
            rollout, attempt = key.rsplit("-a", 1)
            group, generation = rollout.split(".", 1)
            rows.append(EpisodeProgress(
                attempt_id=attempt_id, group_id=int(group), generation_index=int(generation), attempt=int(attempt),
                turn=agent["turn"], state=agent["state"], token_ids=agent.get("token_ids"),
                logprobs=agent.get("logprobs"), token_versions=agent.get("token_versions")))
        return rows

    def _prefixes_at_cut(self, conn, engine: PrefixCapture, at: _AtCut) -> None:
        """The running calls' prefixes that belong to the cut: the engine's calls read
        once, under its lock (the hold), matched to attempts the ledger runs at the cut
        whose saved episode is at the call's turn (a call whose previous turn is not yet
        committed at the cut would resume into the wrong turn: it restarts its turn).
        An agent server's call is matched the same way against the export checked at
        this cut (`at.episodes`), by its server's mode (`_agent_call`). A call that cannot
        be saved is a `call_fallback` of the trace, with its reason."""
        calls = engine.running_calls()
        at.hold_s = engine.cut_hold_s  # the output step's wait, not ours for the step in progress
        at.decoded = engine.decoded_rows
        if self.uncommitted_calls is not None:
            # Read after the engine: a call that finished meanwhile is in transit to the
            # pump or absorbed by it, and found there (`RolloutPump.uncommitted_calls`).
            calls = {**self.uncommitted_calls(), **calls}
        # An in-process attempt may have two: a finished turn's call not yet committed and
        # the next turn's call already running; the one at the saved episode's turn is kept.
        wanted: dict[str, dict[int, Any]] = {}
        remote: set[str] = set()
        servers = self.p.config.environment.servers if self.p.config is not None else []
        for rid, call in calls.items():
            m = _IN_PROCESS_CALL.match(rid)
            if m is not None and call.token_ids:
                wanted.setdefault(f"{m[1]}.{m[2]}-a{m[3]}", {})[int(m[4])] = call
            elif servers and (m := _AGENT_CALL.match(rid)) is not None:
                # Empty ones too: a restart_only server's call falls back whatever it decoded.
                wanted.setdefault(f"{m[1]}.{m[2]}-a{m[3]}", {})[int(m[4])] = call
                remote.add(f"{m[1]}.{m[2]}-a{m[3]}")
        if not wanted:
            return
        known = queries.attempts_by_key(conn, wanted)
        running = {key: attempt_id for key, (attempt_id, state) in known.items() if state == "running"}
        turns = queries.episode_turns(conn, [a for k, a in running.items() if k not in remote])
        exported = {ep.attempt_id: ep.turn for ep in at.episodes}
        prompts = queries.group_prompts(conn, (int(k.split(".", 1)[0]) for k in running))
        for key, attempt_id in sorted(running.items()):
            by_turn = wanted[key]
            turn = turns.get(attempt_id, 0) if key not in remote and turns.get(attempt_id, 0) in by_turn else max(by_turn)
            call = by_turn[turn]
            rollout, attempt = key.rsplit("-a", 1)
            group, generation = (int(x) for x in rollout.split(".", 1))
            prompt_id, step = prompts.get(group, (None, None))
            if call.cut_refused:  # the engine could not continue it exactly (cut_support): its turn restarts
                reason = call.cut_refused
            elif key in remote:
                reason = self._agent_call(servers, prompt_id, attempt_id, turn, exported)
            else:
                reason = None if turns.get(attempt_id, 0) == turn else "turn_not_committed"
            if reason is not None:
                at.fallbacks.append({"attempt_id": attempt_id, "turn": turn, "reason": reason})
                continue
            if not call.token_ids:
                continue  # nothing decoded yet: nothing to keep, nothing lost
            complete = len(call.logprobs) == len(call.token_ids)
            at.prefixes.append(CallPrefix(attempt_id, call.token_ids, call.logprobs if complete else None,
                                          call.token_versions, call.max_tokens, call.min_tokens))
            at.cut_calls.append({"group_id": group, "prompt_id": prompt_id, "generation_index": generation,
                                 "attempt": int(attempt), "step": step, "policy_version": call.token_versions[-1],
                                 "tokens": len(call.token_ids)})

    @staticmethod
    def _agent_call(servers, prompt_id: int | None, attempt_id: int, turn: int,
                    exported: dict[int, int]) -> str | None:
        """Why an agent server's call running at the cut cannot be saved, or None when it
        can. An `export_restore` agent continues from its exported turn (`turn` finished
        turns: its next call is that turn) and makes that turn's call again with the
        same prompt, seed and limits, so a call of exactly that turn continues from its
        prefix; a call of a later turn started after the export (its turn restarts). A
        `stateless` server's episode has one turn that restarts identically (same prompt,
        same seed): its turn-0 call continues too. A `restart_only` server's agents
        restart from turn 0 with state the store never saw: its calls fall back."""
        if prompt_id is None:
            return "unknown_prompt"
        spec = servers[prompt_id % len(servers)]  # the pool's rule (AgentPool.server_for)
        if spec.mode == "restart_only":
            return f"restart_only_server:{spec.name}"
        if spec.mode == "stateless":
            return None if turn == 0 else f"stateless_server_turn:{spec.name}"
        if attempt_id not in exported:
            return f"not_exported:{spec.name}"
        return None if exported[attempt_id] == turn else f"export_at_other_turn:{spec.name}"

    def _abandoned_episode_keys(self) -> list[str]:
        if not self.env.holds_rollout_state:
            return []
        # Not those a restore abandoned (reason `restart`): they ran under a controller
        # that is gone, and the servers were reset at connect, so none runs them; their
        # keys name the saved agents the restore installed for the new attempts to
        # continue (`continue_from`), which a retire would remove before they start.
        with self.p.store.read() as conn:
            return queries.episode_keys(conn, "abandoned", except_reason="restart")


def _one_line(e: BaseException) -> str:
    """`Type: message` on one line: SQLAlchemy's errors append a "(Background on this
    error at: ...)" line, and an attempt's error goes into one metrics line and one row."""
    text = str(e).splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
