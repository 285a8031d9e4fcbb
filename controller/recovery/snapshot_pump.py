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
4. the cut: at prefix level read the running calls first (no lock of ours held), then
   flush the rollout pump (what finished is committed now), take the commit lock
   without waiting, begin the read transaction, re-check the trainer has not moved,
   release the commit lock; then check the environment's export against the ledger as
   of the cut, match the calls to it, and copy the store as of that cut (the checked
   export goes into the copy's `env_episodes`: the snapshot's own file; cut_contents.py
   has what a cut adds to the copy; `_cut` the order and why).
   The pumps are never stopped: the only exclusive hold is the commit lock, for the
   time it takes to begin a read transaction and read the trainer's step;
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
import sqlite3
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path

from rolloutdb.controller.recovery.cut_contents import AtCut, CutContents, into_copy
from rolloutdb.controller.recovery.env_checkpoint import EnvironmentCheckpoint
from rolloutdb.controller.recovery.prefix_chunks import PrefixChunks
from rolloutdb.controller.run.runtime import RolloutParts
from rolloutdb.controller.run.tracing import TRACE_WAIT_S, RolloutTrace
from rolloutdb.gpu_capture.protocol import PrefixCapture
from rolloutdb.store import (Capture, Published, Publisher, PublishError, SegmentRef, SnapshotStage, TrainerStage, anchor_name,
                             faults, queries, scan, seal_inline_payload, segments_dir_of, write_chunk_segment)

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
    # A published attempt's cut (wall clock, `Capture.cut_time`): a cut held for its
    # checkpoint is published later, in another step, and its line says when it was cut.
    cut_time: float | None = None


@dataclass
class _Attempt:
    """What flows between one attempt's steps (`_attempt_locked`), once its anchor is resolved."""

    t0: float
    step: int
    anchor: str
    pending: TrainerStage | None  # the unpublished checkpoint the cut is held for (async checkpoints)
    timings: dict[str, float]  # shared with every result of the attempt: the environment's hold lands after
    contents: CutContents

    def ended(self, outcome: str, error: str | None = None) -> AttemptResult:
        """The result of an attempt that ends before its cut is taken."""
        return AttemptResult(outcome, self.anchor, timings=self.timings, error=error)


@dataclass
class _Cut:
    """A cut taken: the stage it was copied into, and what the copy saw."""

    stage: SnapshotStage
    capture: Capture

    @property
    def at(self) -> AtCut:
        return self.capture.check_result


@dataclass(eq=False)
class _Held:
    """A cut anchored to a pending checkpoint, published once the checkpoint is."""

    stage: SnapshotStage  # inside the pending checkpoint's temporary directory
    capture: Capture
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
        self._pending: TrainerStage | None = None  # an async checkpoint not yet published
        self._held: list[_Held] = []  # touched under the save lock only
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
        # Prefix level: what the published snapshots made durable of each running call.
        self.chunks = PrefixChunks()
        self.trace = RolloutTrace(parts.tracer)
        # Turn and prefix level: the rollout pump's `flush`, set by the controller.
        self.flush_rollouts: Callable[[float], bool] | None = None
        # Prefix level: the rollout pump's `uncommitted_calls`, set by the controller.
        self.uncommitted_calls: Callable[[], dict] | None = None
        # Async trainer checkpoints: `TrainerCheckpoints.publish_if_written`, set by the
        # controller, tried before each attempt (holding no lock: it takes the save lock
        # itself), so an attempt anchors to new weights once their write has ended.
        self.publish_written_checkpoint: Callable[[], object] | None = None
        # The latest attempts, for tests and benchmarks; bounded for runs of days.
        self.results: deque[AttemptResult] = deque(maxlen=1024)
        # (sequence, anchor, trainer step) of the newest snapshot this process published:
        # one attribute, replaced whole, so a signal handler may read it (what a stop saved).
        self.last_published: tuple[int, str | None, int] | None = None

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
                if self.publish_written_checkpoint is not None:
                    self.publish_written_checkpoint()
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

    def anchor_new_checkpoint(self, step: int, *, pending: TrainerStage | None = None,
                              timeout: float = ANCHOR_WAIT_S) -> bool:
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
        self._account_published(held.capture, published, r.anchor, trainer.step)
        return AttemptResult("published", r.anchor, published.sequence, timings, None, r.mutation_counter,
                             held.capture.cut_time)

    def _record(self, result: AttemptResult) -> None:
        """The one place a snapshot attempt's outcome is recorded: its row, then its
        metrics line, both from `result`. The line's `t` is when the attempt ended, read
        before the row's write (which may wait for the store's write lock); a published
        attempt's `cut_time` is when it was cut (test_commit_window places it in a step
        by that)."""
        ended = time.time()
        self.p.store.record_snapshot_attempt(
            result.outcome, anchor=result.anchor, snapshot_seq=result.sequence,
            mutation_counter=result.mutation_counter, timings=result.timings or None, error=result.error,
        )
        self.p.log_event({"kind": "snapshot", "outcome": result.outcome, "anchor": result.anchor,
                          "sequence": result.sequence, "mutation_counter": result.mutation_counter,
                          "timings": result.timings, "error": result.error, "t": ended,
                          **({"cut_time": result.cut_time} if result.cut_time is not None else {})})

    def _attempt_locked(self, force: bool, t0: float) -> AttemptResult:
        """Steps 1-6 of the module docstring, under the save lock. Each step returns the
        attempt's outcome where the attempt ends, None where it goes on."""
        a = self._resolve_anchor(force, t0)
        if isinstance(a, AttemptResult):
            return a
        ended = self._seal(a)
        if ended is not None:
            return ended
        cut = self._environment_and_cut(a)
        if isinstance(cut, AttemptResult):
            return cut
        faults.point("snapshot.after_cut")
        a.timings.update({f"cut_{k}": v for k, v in cut.capture.timings.items()})
        if cut.capture.incremental is not None:  # cloned from the previous snapshot: the blocks it wrote
            a.timings["cut_blocks_written"], a.timings["cut_blocks"] = map(float, cut.capture.incremental)
        if cut.at.hold_s is not None:
            a.timings["prefix_hold"] = cut.at.hold_s
        if cut.at.chunks is not None:  # what this cut wrote of the running calls: their new tokens only
            a.timings["prefix_new_tokens"] = float(cut.at.chunks.new_tokens)
            a.timings["prefix_segment_bytes"] = float(cut.at.chunks.segment.bytes if cut.at.chunks.segment else 0)
        return self._hold(a, cut) if a.pending is not None else self._publish(a, cut)

    def _resolve_anchor(self, force: bool, t0: float) -> AttemptResult | _Attempt:
        """Steps 1-2: the skip checks, and the durable anchor (or the pending checkpoint
        this attempt's cut is held for)."""
        if self.p.runtime.commit_lock.locked():
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
        servers = self.p.config.environment.servers if self.p.config is not None else []
        contents = CutContents(servers, self.uncommitted_calls)
        return _Attempt(t0, step, anchor, pending, {"lock_and_anchor": time.perf_counter() - t0}, contents)

    def _seal(self, a: _Attempt) -> AttemptResult | None:
        """Step 2b. Seal before the environment phase (dispatch stays open meanwhile) and the
        cut (which then copies references). Not while the train pump waits for this cut: it
        copies what finished since the last seal inline, sealed right after (`seal_payload`)."""
        waited_for = bool(self._waiters)  # unlocked read: a waiter arriving just after waits out this one seal
        self._seal_owed = self._seal_owed or waited_for
        if waited_for:
            return None
        t_seal = time.perf_counter()
        try:
            sealed = seal_inline_payload(self.p.store, self.publisher.root)
        except Exception as e:  # noqa: BLE001 - a full disk fails this attempt, not the run; the payload stays inline
            return a.ended("failed", f"sealing payload: {_one_line(e)}")
        if sealed is not None:
            a.timings.update(sealed.timings, seal=time.perf_counter() - t_seal)
        return None

    def _environment_and_cut(self, a: _Attempt) -> AttemptResult | _Cut:
        """Steps 3-5: retire, the environment phase, the cut. Once past the retire, the
        environment leaves its phase (resume) whatever happens, before any fsync."""
        t_env = time.perf_counter()
        try:
            a.contents.retired = set(self._abandoned_episode_keys())
            self.env.retire(sorted(a.contents.retired))
        except Exception as e:  # noqa: BLE001 - a server that does not answer fails this attempt, not the run
            return a.ended("failed", f"environment retire: {type(e).__name__}: {e}")
        try:
            ended = self._export_environment(a, t_env)
            return ended if ended is not None else self._flush_and_cut(a)
        finally:
            self.env.resume()  # dispatch reopens before any fsync of the snapshot
            if self.env.holds_rollout_state:
                a.timings["environment_hold"] = time.perf_counter() - t_env

    def _export_environment(self, a: _Attempt, t_env: float) -> AttemptResult | None:
        """Step 3: prepare, commit, drain and read the export of the environment's servers."""
        try:
            self.env.prepare()
            faults.point("env.after_prepare")
            self.env.commit()
            faults.point("env.after_commit")
            self.env.drain()
            faults.point("env.after_drain")
            # Read before the cut: the export was fixed at commit, and the cut's
            # exclusive hold (the commit lock) must not wait on a server.
            a.contents.export = self.env.export()
            a.contents.expected = set(self.env.expected_keys()) if hasattr(self.env, "expected_keys") else set()
            faults.point("env.after_export")
        except Exception as e:  # noqa: BLE001 - a server that fails its phase fails this attempt, not the run
            return a.ended("failed", f"environment phase: {type(e).__name__}: {e}")
        a.timings["environment"] = time.perf_counter() - t_env
        return None

    def _flush_and_cut(self, a: _Attempt) -> AttemptResult | _Cut:
        """Step 4: the copy as of the cut (`_cut`, which flushes the rollout pump first),
        unless an optimizer commit started since the anchor was resolved."""
        if self.p.runtime.commit_lock.locked() or self.p.read_progress().step != a.step:
            return a.ended("aborted_commit")
        try:
            stage = self.publisher.begin_snapshot(a.anchor, pending=a.pending)
        except PublishError as e:  # a full disk, a failed deferred publish: an outcome, like a failed publish
            return a.ended("failed", f"{type(e).__name__}: {e}")
        try:
            cut = _Cut(stage, self._cut(stage.db_path, stage.base, a.step, a.contents, a.timings))
        except AbortedCommit:
            stage.abort()
            return a.ended("aborted_commit")
        except BaseException as e:
            stage.abort()  # the number is used up all the same: the row names it
            return AttemptResult("failed", a.anchor, stage.sequence, a.timings, f"{type(e).__name__}: {e}")
        self._trace_cut(cut.capture)
        return cut

    def _trace_cut(self, capture: Capture) -> None:
        """The cut's `call_cut` and `call_fallback` events, committed to the trace before
        the snapshot can be published, with everything emitted before them (the calls
        finished by the cut's read among them): a stop right after the publication then
        loses none of what `rolloutdb trace` needs to account for the cut's tokens. A cut
        that is never published is never restored, and the analysis reads these events
        only at a restored cut's time."""
        at: AtCut = capture.check_result
        if not self.trace.enabled or (not at.cut_calls and not at.fallbacks):
            return
        self.trace.cut(at.cut_calls, capture.cut_time)
        self.trace.fallback(at.fallbacks, capture.cut_time)
        self.trace.flush(TRACE_WAIT_S)

    def _hold(self, a: _Attempt, cut: _Cut) -> AttemptResult:
        """Step 6 deferred: the cut waits for its checkpoint (`publish_held`)."""
        a.timings["_held_at"] = time.perf_counter()
        result = AttemptResult(HELD, a.anchor, cut.stage.sequence, a.timings, None, cut.capture.mutation_counter)
        self._held.append(_Held(cut.stage, cut.capture, result))
        return result

    def _publish(self, a: _Attempt, cut: _Cut) -> AttemptResult:
        """Step 6: publish, then account for what was published."""
        t_pub = time.perf_counter()
        try:
            published = cut.stage.publish(cut.capture, self.config_text)
        except Exception as e:  # noqa: BLE001 - a failed publish is an outcome, the run goes on
            return AttemptResult("failed", a.anchor, cut.stage.sequence, a.timings, f"{type(e).__name__}: {e}",
                                 cut.capture.mutation_counter)
        a.timings["publish"] = time.perf_counter() - t_pub
        a.timings["total"] = time.perf_counter() - a.t0
        self._account_published(cut.capture, published, a.anchor, a.step)
        return AttemptResult("published", a.anchor, published.sequence, a.timings, None, cut.capture.mutation_counter,
                             cut.capture.cut_time)

    def _account_published(self, capture: Capture, published: Published, anchor: str | None, step: int) -> None:
        """What a published cut changes: the next attempt's skip check, and the trace's
        `snapshot_cut` (its calls' events are in the trace already: `_trace_cut`)."""
        at: AtCut = capture.check_result
        self._last_counter = capture.mutation_counter
        self.last_published = (published.sequence, anchor, step)
        self._last_decoded = at.decoded
        if at.chunks is not None:
            self.chunks.published(at.chunks)
        self.trace.snapshot_cut(cut_time=capture.cut_time, snapshot_seq=published.sequence, anchor=anchor, step=step,
                                snapshot=str(published.path), group_states=capture.group_states,
                                decoded_at=capture.decoded_at)

    def _cut(self, db_path: Path, base: Path | None, step: int, contents: CutContents,
             timings: dict[str, float]) -> Capture:
        """Capture at a cut, in this order (the commit lock is held for steps 3-5 only,
        so its hold is independent of how many calls run and how long they are):

        1. at prefix level, read the running calls (`CutContents.read_engine`: the
           engine, then the rollout pump's uncommitted calls), with no lock of ours held;
        2. flush the rollout pump: what finished so far is committed now, not at the end
           of its window. After the read: the turn a call read in step 1 follows was
           applied before the read, so this commits it, and the call is saved at its
           turn instead of restarting it (`turn_not_committed`);
        3. take the commit lock without waiting (an optimizer commit in progress: abort);
        4. begin the read transaction: its first read is the cut;
        5. check the trainer is still at `step`, and release the commit lock;
        6. as of the cut: check the environment's export against the ledger, and match
           the calls read in step 1 to the attempts the ledger runs (`prefixes_at_cut`,
           which keeps no token of a version newer than `step`).

        Step 1 before the cut is what makes it consistent (`CutContents.read_engine`
        argues it); step 5 makes the cut fall wholly before or after an optimizer
        commit: the commit cannot start while the lock is held, and one that ended
        before step 3 moved the step (checked in 5)."""
        read = None
        if self.capture is not None:
            self.chunks.forget_missing(segments_dir_of(self.publisher.root))
            read = contents.read_engine(self.capture, self.chunks.since())
        if self.flush_rollouts is not None:
            t_flush = time.perf_counter()
            self.flush_rollouts(FLUSH_WAIT_S)  # what finished before the cut goes into it
            timings["flush"] = time.perf_counter() - t_flush
        rt = self.p.runtime
        if not rt.commit_lock.acquire(blocking=False):
            raise AbortedCommit()
        held = [True]

        def at_cut(conn: sqlite3.Connection) -> AtCut:
            try:
                if self.p.read_progress().step != step:
                    raise AbortedCommit()
            finally:
                rt.commit_lock.release()
                held[0] = False
            self._release_waiters(step, True)  # the train pump may commit again
            at = AtCut(episodes=contents.checked_export(conn))
            if read is not None:
                contents.prefixes_at_cut(conn, read, at, version=step, durable=self.chunks)
                at.chunks = self.chunks.cut(at.prefixes, self._write_chunks)
            return at

        try:
            capture = self.p.store.capture(db_path, at_cut=at_cut, into_copy=into_copy, base=base)
            capture.decoded_at = read.decoded_at if read is not None else None
            return capture
        finally:
            if held[0]:
                rt.commit_lock.release()

    def _write_chunks(self, rows: list[tuple[int, bytes, bytes]]) -> SegmentRef:
        """A cut's new prefix chunks, durable in one new segment (`PrefixChunks.cut`)."""
        return write_chunk_segment(self.p.store, self.publisher.root, rows)

    def _abandoned_episode_keys(self) -> list[str]:
        if not self.env.holds_rollout_state:
            return []
        # Not those abandoned for a restart (reason `restart`, as the pump starts a
        # restored group's generations again): they ran under a controller
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
