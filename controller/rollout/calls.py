"""How the rollout pump handles a model call, from its submit to its episode's next turn:
the call's request (a restored call spliced onto its prefix), its finished result (the
reply taken, then the environment's step through the run's `EnvironmentStepper`,
controller/rollout/env_steps.py), and the episode's end. `RolloutCalls` holds the
episodes in flight; the pump (controller/rollout/pump.py), which owns the loop, the commit
and dispatch, builds it with the parts it needs and calls it on the pump's thread.

A finished call is taken in two halves. `on_done` hands the environment's step on the
reply to the stepper; `_on_step` takes the reply and applies the step's outcome together
(the episode changes only there) and submits the next call or finishes the episode. In
the driver the step's future is already done and `_on_step` runs at once; on environment
workers it comes back later through the completion queue (`done`, the queue engine
futures use), so the pump's thread never waits on a remote step. Meanwhile the episode is
in `stepping`, counted as in flight. At prefix level the call is in `_uncommitted`
(whole) before its step starts and stays there until the batch holding its step's turn
commits, so a cut taken while the step runs saves it, and a restored run steps it again;
at turn level the episode's progress joins the batch only once its step is applied.

A worker that dies under an attempt (an engine worker mid-call, an environment worker
mid-step: both fail their future with `WorkerLost`) has the attempt abandoned with reason
`error` and started again in the same batch (`_abandon`).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import replace

from rolloutdb.controller.protocols import Environment
from rolloutdb.controller.rollout.agent_episodes import AgentEpisodes, EpisodeOutcome
from rolloutdb.controller.rollout.env_steps import EnvironmentStepper
from rolloutdb.controller.rollout.episodes import StepOutcome
from rolloutdb.controller.rollout.group_commit import CommitBatch, RolloutMeter
from rolloutdb.controller.rollout.live_episode import GroupRun, LiveEpisode, whole_call
from rolloutdb.controller.run.tracing import RolloutTrace
from rolloutdb.gpu_capture.protocol import (
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    RunningCall,
    SamplingParams,
    WorkerLost,
)
from rolloutdb.store import FinishedGeneration, codec, faults

# Episodes an agent server may lose in a row (every one since its last finished episode)
# before the run stops: a server that comes back and fails every episode is broken.
MAX_LOST_IN_A_ROW = 1000


class RolloutCalls:
    """The rollout pump's episodes in flight (see the module docstring): each has one
    model call running (`running`), or one environment step (`stepping`); with agent
    servers (`agents`) each future in `running` is a whole episode instead. Every
    finished future puts itself in `done`, which the pump's loop drains into `on_done`.

    `groups` is the pump's map of the groups it runs (it adds them at dispatch); an
    episode's end takes its generation out here and hands a group whose generations all
    ended to `batch`. Used only on the pump's thread, except `uncommitted_calls` (a cut's
    thread) and `agents.on_call` (the HTTP loop's)."""

    def __init__(self, *, engine: GenerationEngine, env: Environment, stepper: EnvironmentStepper,
                 agents: AgentEpisodes | None, params: SamplingParams, batch: CommitBatch, meter: RolloutMeter,
                 trace: RolloutTrace, stop: threading.Event, groups: dict[int, GroupRun], prefix_level: bool,
                 turn_level: bool):
        self.engine = engine
        self.env = env
        self.stepper = stepper
        self.agents = agents
        self.params = params
        self.batch = batch
        self.meter = meter
        self.trace = trace
        self.stop = stop
        self.groups = groups
        self.prefix_level = prefix_level
        self.turn_level = turn_level
        self.running: dict[Future, LiveEpisode] = {}  # model calls (agent servers: episodes) in flight
        # Steps running on an environment worker, with their reply (they count as in flight)
        self.stepping: dict[Future, tuple[LiveEpisode, GenerationResult]] = {}
        # Finished futures, in the order they finished: each puts itself here when it
        # completes, so waiting costs O(1) per call (concurrent.futures.wait over every
        # running call costs O(calls in flight) per wake-up).
        self.done: queue.SimpleQueue[Future] = queue.SimpleQueue()
        self._uncommitted: dict[str, RunningCall] = {}  # prefix level: finished calls not yet committed
        self._uncommitted_ids: list[str] = []  # their request ids, in the batch being filled
        self._lost_in_a_row: dict[str, int] = {}
        if agents is not None:
            agents.on_call = self._served_call

    def in_flight(self) -> int:
        """Episodes with a model call or an environment step in progress."""
        return len(self.running) + len(self.stepping)

    def take_batch_calls(self) -> list[str]:
        """Prefix level: the request ids of the calls whose turns are in the batch the pump
        is about to commit; `committed` takes them out of the cut's view once it has."""
        taken, self._uncommitted_ids = self._uncommitted_ids, []
        return taken

    def committed(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._uncommitted.pop(rid, None)

    def abort_running(self) -> None:
        """At a stop the calls in flight are abandoned: a resume redoes them (from their
        episode's last committed turn at turn level). Agent servers' episodes end when
        the controller closes its policy endpoint (their calls fail)."""
        if self.running and self.agents is None:
            ids = [f"{live.episode.key}-t{live.episode.turn}" for live in self.running.values()]
            try:
                self.engine.abort(ids)
            except Exception:  # noqa: BLE001 - a closed engine has nothing left to abort
                pass

    def submit(self, live: LiveEpisode) -> None:
        """Start `live`'s next model call (agent servers: its whole episode)."""
        future: Future
        if self.agents is not None:
            future = self.agents.run(live, key=live.episode.key, prompt_id=live.group.reservation.prompt_id,
                                     seed=live.episode.seed, params=self.params, continue_from=live.continue_from,
                                     prefix=live.prefix, prefix_turn=live.episode.turn)
        else:
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
                       prefix_logprobs=list(prefix.logprobs or ()))

    def _served_call(self, live: LiveEpisode, turn: int, result: GenerationResult, prefix_tokens: int = 0) -> None:
        """An agent server's model call for `live` (HTTP loop's thread), less its restored prefix."""
        self.meter.call()
        self.trace.call_finished(live.group, live.index, turn=turn, tokens=len(result.token_ids) - prefix_tokens,
                                 finish_reason=result.finish_reason)

    def _on_episode(self, future: Future[EpisodeOutcome]) -> None:
        """An agent server's episode ended: its sample goes in the batch; an episode the
        server lost (it died, or the deadline passed) is abandoned with that reason and
        started again in the same batch."""
        live = self.running.pop(future)
        outcome = future.result()  # a protocol error fails the pump, and the run
        if outcome.status != "finished":
            if self.stop.is_set():
                return  # the controller is stopping: a resume redoes it
            lost = self._lost_in_a_row[outcome.server] = self._lost_in_a_row.get(outcome.server, 0) + 1
            if lost > MAX_LOST_IN_A_ROW:
                raise RuntimeError(f"agent server {outcome.server} lost {lost} episodes in a row; the last: "
                                   f"{outcome.error} (see logs/agent_server_{outcome.server}.log)")
            self.batch.add_retry(live, outcome.status)
            return
        self._lost_in_a_row[outcome.server] = 0
        e = live.episode
        e.turn, e.reward, e.done = outcome.turn, outcome.reward, True
        e.token_ids, e.logprobs, e.token_versions = outcome.token_ids, outcome.logprobs, outcome.token_versions
        e.finish_reasons = outcome.finish_reasons
        self._episode_done(live)

    def _episode_done(self, live: LiveEpisode) -> None:
        e = live.episode
        self.batch.drop_progress((live.group.group_id, live.index))
        self.batch.add_finished(live, FinishedGeneration(
            token_ids=e.token_ids, logprobs=e.logprobs, reward=e.reward,
            version_token_counts=codec.version_runs(e.token_versions)))
        run = self.groups[live.group.group_id]
        run.outstanding.discard(live.index)
        if not run.outstanding:
            del self.groups[live.group.group_id]
            self.batch.add_completed(run.handle)

    def on_done(self, future: Future) -> None:
        """A future from the completion queue: an engine call, an environment step, or
        (agent servers) a whole episode."""
        if self.agents is not None:
            return self._on_episode(future)
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
                                 finish_reason=result.finish_reason)
        step = self.stepper.step(e.state, result.token_ids, last=e.last_turn)
        if step.done():
            self._on_step(step, live, result)  # in the driver (LocalStepper): at once, as before the seam
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
            self._episode_done(live)
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
        if self.agents is not None:
            return {}
        in_transit = {}
        for future, live in dict(self.running).items():  # a copy: the pump thread changes it
            if future.done() and future.exception() is None:
                result = future.result()
                if result.finish_reason != "abort":
                    in_transit[result.request_id] = whole_call(result, live)
        return {**in_transit, **self._uncommitted}

