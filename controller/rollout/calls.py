"""How the rollout pump runs its episodes in flight, behind one small protocol
(`EpisodesInFlight`) with two implementations: here `EngineCalls`, the episodes the
controller plays itself, one model call at a time on its engine, stepping the
environment through the run's `EnvironmentStepper` (controller/rollout/env_steps.py);
and `AgentServerEpisodes` (controller/rollout/agent_episodes.py), episodes an agent
server plays whole. The pump (controller/rollout/pump.py) owns the loop, the commit and
dispatch; it builds one of the two with the parts it needs and calls it on its thread.

A finished call is taken in two halves. `on_done` hands the environment's step on the
reply to the stepper; `_on_step` takes the reply and applies the step's outcome together
(the episode changes only there) and submits the next call or finishes the episode. In
the driver the step's future is already done and `_on_step` runs at once; on environment
workers it comes back later through the completion queue (the one engine futures use),
so the pump's thread never waits on a remote step. Meanwhile the episode is in
`stepping`, counted as in flight. At prefix level the call is in `_uncommitted` (whole)
before its step starts and stays there until the batch holding its step's turn commits,
so a cut taken while the step runs saves it, and a restored run steps it again; at turn
level the episode's progress joins the batch only once its step is applied.

A worker that dies under an attempt (an engine worker mid-call, an environment worker
mid-step: both fail their future with `WorkerLost`) has the attempt abandoned with reason
`error` and started again in the same batch (`_abandon`).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import replace
from typing import Protocol

from rolloutdb.controller.protocols import Environment
from rolloutdb.controller.rollout.env_steps import EnvironmentStepper
from rolloutdb.controller.rollout.episodes import Episode, StepOutcome
from rolloutdb.controller.rollout.group_commit import CommitBatch, RolloutMeter
from rolloutdb.controller.rollout.live_episode import GroupRun, LiveEpisode, whole_call
from rolloutdb.controller.run.dispatch import GroupHandle
from rolloutdb.controller.run.tracing import RolloutTrace
from rolloutdb.gpu_capture.protocol import (
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    RunningCall,
    SamplingParams,
    WorkerLost,
)
from rolloutdb.store import CallPrefix, FinishedGeneration, SavedEpisode, codec, faults


class EpisodesInFlight(Protocol):
    """The rollout pump's episodes in flight, as its loop and its commit use them. Every
    future `submit` starts puts itself, once done, in the pump's completion queue, which
    the loop drains into `on_done`."""

    def episode(self, group: GroupHandle, index: int, attempt_id: int | None, attempt: int, seed: int,
                saved: SavedEpisode | None, prefix: CallPrefix | None) -> LiveEpisode:
        """The episode of one generation's new attempt: continued from what the attempt
        it replaces `saved` (and the call its cut saved, `prefix`) where it can be."""
        ...

    def submit(self, live: LiveEpisode) -> None:
        """Start `live`'s next model call (agent servers: its whole episode)."""
        ...

    def on_done(self, future: Future) -> None:
        """A future from the completion queue."""
        ...

    def in_flight(self) -> int:
        """Episodes with something in progress (they count against max_inflight_calls)."""
        ...

    def take_batch_calls(self) -> list[str]:
        """Prefix level: the request ids of the calls whose turns are in the batch the
        pump is about to commit; `committed` takes them out of the cut's view once it has."""
        ...

    def committed(self, request_ids: list[str]) -> None: ...

    def uncommitted_calls(self) -> dict[str, RunningCall]:
        """Prefix level, read by a snapshot's cut on another thread: the finished calls no
        commit holds yet, each as a complete prefix."""
        ...

    def abort_running(self) -> None:
        """At a stop: abandon what is in flight (a resume redoes it)."""
        ...


def end_episode(live: LiveEpisode, batch: CommitBatch, groups: dict[int, GroupRun]) -> None:
    """`live`'s episode ended: its sample joins the batch (replacing its saved progress),
    and its group, once every generation ended, is complete."""
    e = live.episode
    batch.drop_progress((live.group.group_id, live.index))
    batch.add_finished(live, FinishedGeneration(
        token_ids=e.token_ids, logprobs=e.logprobs, reward=e.reward,
        version_token_counts=codec.version_runs(e.token_versions)))
    run = groups[live.group.group_id]
    run.outstanding.discard(live.index)
    if not run.outstanding:
        del groups[live.group.group_id]
        batch.add_completed(run.handle)


class EngineCalls:
    """Episodes the controller plays (see the module docstring): each has one model call
    running on `engine` (`running`) or one environment step (`stepping`).

    `groups` is the pump's map of the groups it runs (it adds them at dispatch); an
    episode's end takes its generation out and hands a group whose generations all
    ended to `batch`. Used on the pump's thread only, except `uncommitted_calls`."""

    def __init__(self, *, engine: GenerationEngine, env: Environment, stepper: EnvironmentStepper,
                 params: SamplingParams, batch: CommitBatch, meter: RolloutMeter, trace: RolloutTrace,
                 stop: threading.Event, groups: dict[int, GroupRun], done: queue.SimpleQueue[Future],
                 prefix_level: bool, turn_level: bool):
        self.engine = engine
        self.env = env
        self.stepper = stepper
        self.params = params
        self.batch = batch
        self.meter = meter
        self.trace = trace
        self.stop = stop
        self.groups = groups
        self.done = done
        self.prefix_level = prefix_level
        self.turn_level = turn_level
        self.running: dict[Future[GenerationResult], LiveEpisode] = {}
        # Steps running on an environment worker, with their reply (they count as in flight)
        self.stepping: dict[Future[StepOutcome], tuple[LiveEpisode, GenerationResult]] = {}
        self._uncommitted: dict[str, RunningCall] = {}  # prefix level: finished calls not yet committed
        self._uncommitted_ids: list[str] = []  # their request ids, in the batch being filled

    def episode(self, group: GroupHandle, index: int, attempt_id: int | None, attempt: int, seed: int,
                saved: SavedEpisode | None, prefix: CallPrefix | None) -> LiveEpisode:
        """From its saved turns when the attempt it replaces left a transcript, else from
        the start."""
        r = group.reservation
        key = f"g{group.group_id}.{index}-a{attempt}"
        if saved is not None and saved.token_ids is not None:
            episode = Episode.resumed(self.env, r.prompt_id, key=key, seed=seed, turn=saved.turn,
                                      state=saved.state, token_ids=saved.token_ids, logprobs=saved.logprobs or [],
                                      token_versions=saved.token_versions or [])
            return LiveEpisode(group, index, attempt_id, attempt, episode, from_attempt=saved.attempt, prefix=prefix)
        # A prefix without a saved episode is one of the first turn (the cut matched its turn)
        return LiveEpisode(group, index, attempt_id, attempt, Episode.start(self.env, r.prompt_id, key=key, seed=seed),
                           prefix=prefix)

    def in_flight(self) -> int:
        return len(self.running) + len(self.stepping)

    def take_batch_calls(self) -> list[str]:
        taken, self._uncommitted_ids = self._uncommitted_ids, []
        return taken

    def committed(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._uncommitted.pop(rid, None)

    def abort_running(self) -> None:
        """The calls in flight are aborted in the engine: a resume redoes them (from their
        episode's last committed turn at turn level)."""
        if self.running:
            ids = [f"{live.episode.key}-t{live.episode.turn}" for live in self.running.values()]
            try:
                self.engine.abort(ids)
            except Exception:  # noqa: BLE001 - a closed engine has nothing left to abort
                pass

    def submit(self, live: LiveEpisode) -> None:
        request = live.episode.request(self.env, self.params)
        live.prefix_len = 0
        if live.prefix is not None:
            request = self._spliced(live, request)
        live.limits = (request.params.max_tokens, request.params.min_tokens)
        cut_support = getattr(self.engine, "cut_support", None) if self.prefix_level else None
        live.cut_refused = cut_support(request) if cut_support is not None else None
        future = self.engine.submit(request)
        self.running[future] = live
        future.add_done_callback(self.done.put)

    def _spliced(self, live: LiveEpisode, request: GenerationRequest) -> GenerationRequest:
        """The restored call continued from its prefix: the engine counts limits,
        penalties and stop strings over the whole output, prefix included, and returns
        the whole output with the prefix's own logprobs and versions, so the result is
        the uninterrupted call's. A prefix saved under other limits (it cannot be the
        same call) restarts the turn instead."""
        prefix, live.prefix = live.prefix, None
        p = request.params
        if prefix is None or (prefix.max_tokens, prefix.min_tokens) != (p.max_tokens, p.min_tokens):
            return request
        live.prefix_len = len(prefix.token_ids)
        return replace(request, prefix_ids=list(prefix.token_ids), prefix_versions=list(prefix.token_versions),
                       prefix_logprobs=list(prefix.logprobs or ()), prefix_sampler=prefix.sampler)

    def on_done(self, future: Future) -> None:
        """A future from the completion queue: an engine call or an environment step."""
        if future in self.stepping:
            return self._on_step(future, *self.stepping.pop(future))
        live = self.running[future]
        try:
            result = future.result()  # an engine error fails the pump, and the run
        except WorkerLost:  # the engine worker running the call died (Ray)
            del self.running[future]
            self._abandon(live)
            return
        if result.finish_reason == "abort":
            del self.running[future]
            if self.stop.is_set():
                return  # the pump aborted it at a stop (or the engine closed): a resume redoes it
            raise RuntimeError(f"the engine aborted call {result.request_id} while the run was going on; its episode "
                               "cannot finish (see the engine's log for why)")
        if self.prefix_level:
            # Until the batch that holds its turn commits, a cut saves this call whole (see
            # `uncommitted_calls`). Written before the call leaves `running`: a cut finds
            # it in one or the other. It joins that batch (`_uncommitted_ids`) once its step
            # is applied (`_on_step`): a commit while the step runs keeps it for the cut.
            self._uncommitted[result.request_id] = whole_call(result, live)
        del self.running[future]
        e = live.episode
        self.meter.call()
        self.trace.call_finished(live.group, live.index, turn=e.turn, tokens=len(result.token_ids) - live.prefix_len,
                                 finish_reason=result.finish_reason,
                                 prefix_exactness=(result.extra or {}).get("prefix_exactness"))
        step = self.stepper.step(e.state, result.token_ids, last=e.last_turn)
        if step.done():
            self._on_step(step, live, result)  # in the driver (LocalStepper): at once
        else:
            self.stepping[step] = (live, result)  # on a worker: it comes back through the completion queue
            step.add_done_callback(self.done.put)

    def _on_step(self, future: Future[StepOutcome], live: LiveEpisode, result: GenerationResult) -> None:
        """The environment's step on `result` (the reply) for `live` is done: take the
        reply and apply the step together, then start the next turn or finish the
        episode. Together: the episode changes only here, on the pump thread, so a commit
        while the step runs (turn level: `live.progress()`) sees the last whole turn,
        never a reply without its step. A step whose worker died is abandoned with
        reason `error` as a lost engine call is (the episode never saw it)."""
        if self.prefix_level:
            self._uncommitted_ids.append(result.request_id)  # leaves the cut's view with this batch's commit
        try:
            outcome = future.result()  # the environment's own error fails the pump, and the run
        except WorkerLost:
            self._abandon(live)
            return
        e = live.episode
        e.take_reply(result)
        e.apply(outcome)
        if e.done:
            end_episode(live, self.batch, self.groups)
        else:
            if self.turn_level:
                self.batch.add_progress((live.group.group_id, live.index), live)
            self.submit(live)  # the next turn starts now; its save follows in the batch
        faults.point("pump.call_finished_uncommitted")

    def _abandon(self, live: LiveEpisode) -> None:
        """A worker (engine or environment) died under `live`'s attempt: the pool replaced
        it; the attempt is abandoned with reason `error` and starts again in this batch."""
        if not self.stop.is_set():
            self.batch.drop_progress((live.group.group_id, live.index))
            self.batch.add_retry(live, "error")

    def uncommitted_calls(self) -> dict[str, RunningCall]:
        """Prefix level, read by a snapshot's cut (another thread; a dict copy is atomic
        under the GIL): the calls that finished and were absorbed but whose batch has not
        committed yet, each as a complete prefix. A cut that misses them would lose them
        with the window (they are neither running in the engine nor in the store); saved
        whole, a resumed call finishes at once with the same output (the engine finds its
        end in the prefix: EOS, a stop string or max_tokens).

        Also the calls in transit: finished in the engine (their future is done) but not
        yet taken from the completion queue by this pump. The engine finishes a call
        under the lock its `running_calls` reads under, and `on_done` adds a call here
        before it leaves `running`; reading `running` before `_uncommitted` (and the
        cut reads the engine before this) therefore finds every call somewhere
        (bench_prefix_kept.py: in-transit calls were most of what a cut still lost)."""
        in_transit = {}
        for future, live in dict(self.running).items():  # a copy: the pump thread changes it
            if future.done() and future.exception() is None:
                result = future.result()
                if result.finish_reason != "abort":
                    in_transit[result.request_id] = whole_call(result, live)
        return {**in_transit, **self._uncommitted}

