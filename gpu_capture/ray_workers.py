"""Engine workers on Ray: `RayEnginePool` is one `GenerationEngine` (and `PrefixCapture`)
whose calls run in N Ray actors, each owning one engine built by the same factory an
in-process run uses (controller/job/build.py: the reference engine or vLLM). The controller
keeps talking to one engine object; the rollout pump, the snapshot pump and resume do not
know about Ray. Ray is imported lazily (`import_ray`): the rest of the package imports
without it.

Routing: least loaded. Each call goes to the worker with the fewest calls in progress
(ties: the lowest index). Calls have very different lengths on the long-tail task (1 to 8
digit answers, multi-turn), so round robin hands a worker its share of calls whatever it
still runs: the long calls pile up on whichever worker drew them and its batch stays
full while the other drains. Counting calls in progress is what the pool knows for free
(it holds every call's future); each engine batches continuously, so a worker with fewer
calls finishes a new one sooner.

Streaming: `submit` sends the request to the chosen actor's `generate`, which submits it
to its engine and returns the `GenerationResult` when the call ends; the pool turns the
ObjectRef into the `concurrent.futures.Future` the protocol promises (`ObjectRef.future`,
completed on Ray's own callback thread). Requests are checked here first (the same
`check_request` the engines use), so a bad request raises before anything is sent.

Refit: `load_weights(state, version)` puts the state dict in Ray's object store once
(`ray.put`, Ray's serializer; torch tensors cross as tensors) and passes the one reference
to every worker; the pool keeps it so that a replacement worker starts with the current
weights and version.

The cut: `running_calls` asks every worker at once and waits for all (one cut across
workers: each worker's answer is read under its own engine lock, atomic per worker; calls
are independent, so the per-worker reads need no common instant). A call that finished
in its worker but whose result has not reached the driver yet is still reported, whole:
the worker keeps each finished call (recorded by the engine's future callback, under the
engine lock) until the pool acknowledges it, and the pool acknowledges only results whose
futures it already completed, so a cut finds every call in a worker's answer or in the
rollout pump (`RolloutPump.uncommitted_calls`), as with an in-process engine.
`cut_hold_s` keeps the protocol's meaning, so the trace's figure compares with an
in-process engine's: how long an output step waited for the cut, the longest of the
workers' own holds (each copies its calls under its engine lock). `gather_s` is the wall
time of the whole gather, the cut's wait for the slowest worker: round trip and each
worker's step in progress included (bench/bench_ray_workers.py measures both).

Faults: a worker that dies (killed, SIGKILLed, crashed) fails every call it held with
`EngineWorkerLost`; the rollout pump abandons those attempts with reason `error` and
starts them again. The pool starts a replacement in the slot at once: a new actor built
with the current weights and version (its constructor installs them, so no call reaches
it first). A slot whose worker dies `MAX_DEATHS_IN_A_ROW` times without finishing a call
is given up (a worker that dies on every call is broken); when every slot is given up,
`submit` raises RuntimeError and the run stops.

Nodes: a node that leaves takes all its workers at once; what the pool does then is
`WorkerSlots`'s (gpu_capture/ray_slots.py), shared with the environment workers.

Measured here (2 shared cores under load 5-9, Ray 2.60, bench/bench_ray_workers.py): a
1-token call 5.6 ms through one worker vs 1.8 ms in process (about 4 ms of Ray per call);
long-tail tokens/s with one worker 0.4-0.67x in process; a cut's own hold 0.05 ms either
way, its gather 26-100 ms; a local `ray.init` 2.3-4.5 s, `ray.shutdown` 1.4 s, a worker's
start (torch and transformers imports) 5-13 s.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

from .protocol import (
    EngineWorkerLost,
    GenerationRequest,
    GenerationResult,
    RunningCall,
    SamplingParams,
    check_request,
    sampler_change,
)
from .ray_slots import MAX_DEATHS_IN_A_ROW, WorkerSlots, node_id, placement_strategy

__all__ = ["MAX_DEATHS_IN_A_ROW", "NAMESPACE", "EngineWorker", "RayEnginePool", "WorkerSlots", "import_ray"]

NAMESPACE = "rolloutdb"  # the Ray namespace of the pool's named actors
MAX_CUT_VERDICTS = 4096  # cached cut_support verdicts (one per kind of call)
INSTALL_HINT = "cluster.backend: ray needs Ray, which is not installed: pip install -e '.[ray]'"


def import_ray():
    """Ray, or one ValueError line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return ray


def _params_key(params: SamplingParams) -> tuple:
    """A hashable form of what a cut verdict may depend on: every setting, with `stop`
    as a tuple (a caller may pass a list) and the seed reduced to whether there is one."""
    values = {f.name: getattr(params, f.name) for f in fields(params)}
    values["seed"] = values["seed"] is not None
    values["stop"] = tuple(values["stop"])
    return tuple(values.items())


def _whole(request: GenerationRequest, result: GenerationResult, cut_refused: str | None,
           identity: str | None) -> RunningCall:
    """A call that finished on a worker but that the driver has not acknowledged, as a cut
    reads it: whole, decoded by the worker's sampler unless it went on from a prefix
    another sampler decoded (`sampler_change`; restarted calls decoded every token here)."""
    foreign = identity is None or (sampler_change(request, identity) is not None
                                   and "prefix_fallback" not in result.extra)
    return RunningCall(list(result.token_ids), list(result.logprobs), list(result.token_versions),
                       request.params.max_tokens, request.params.min_tokens, cut_refused,
                       sampler=None if foreign else identity)


class EngineWorker:
    """The actor body (made a Ray actor by the pool): one engine, its calls, and the calls
    that finished here but that the driver has not acknowledged yet (see the module
    docstring: the cut). Its methods are coroutines, so one actor serves many calls at
    once; the short ones (running_calls, abort) run on the loop between awaits."""

    def __init__(self, factory: Callable[[], Any], state: Mapping[str, Any] | None, version: int):
        self.engine = factory()
        if state is not None:
            self.engine.load_weights(state, version)
        self._finished: dict[str, RunningCall] = {}  # finished, result not yet acknowledged
        self._known: set[str] = set()  # calls submitted here and not finished
        self._early_aborts: set[str] = set()  # aborts that arrived before their call
        self.served = 0  # calls finished here (placement checks: a worker on a new node serves)

    async def describe(self) -> dict:
        return {"pid": os.getpid(), "node_id": node_id(), "served": self.served,
                "vocab_size": getattr(self.engine, "vocab_size", None),
                "max_model_len": getattr(self.engine, "max_model_len", None),
                "policy_version": self.engine.policy_version}

    def _forget(self, acked: Sequence[str]) -> None:
        for rid in acked:
            self._finished.pop(rid, None)

    async def generate(self, request: GenerationRequest, acked: Sequence[str]) -> GenerationResult:
        self._forget(acked)
        rid = request.request_id
        cut_support = getattr(self.engine, "cut_support", None)
        refused = cut_support(request) if cut_support is not None else None

        def finished(f: Future) -> None:
            # Runs where the engine completes the future (the reference engine: under its
            # lock, inside the step), so a cut reads the call running or finished here.
            if f.exception() is None:
                self._finished[rid] = _whole(request, f.result(), refused, getattr(self.engine, "sampler_identity", None))
                self.served += 1
            self._known.discard(rid)

        self._known.add(rid)
        future = self.engine.submit(request)
        future.add_done_callback(finished)
        if rid in self._early_aborts:
            self._early_aborts.discard(rid)
            self.engine.abort([rid])
        result = await asyncio.wrap_future(future)
        result.extra["worker_pid"] = os.getpid()  # which worker ran it (logs, tests)
        return result

    async def running_calls(self, acked: Sequence[str], since: Mapping[str, int] | None = None,
                            ) -> tuple[dict[str, RunningCall], int, float]:
        """(calls in progress, from the offsets `since` names on, and finished-
        unacknowledged ones, whole; decoded rows; own hold). On a thread: the read waits
        for the engine's step in progress, and the loop keeps taking calls meanwhile."""
        return await asyncio.to_thread(self._cut, acked, since)

    def _cut(self, acked: Sequence[str], since: Mapping[str, int] | None = None,
             ) -> tuple[dict[str, RunningCall], int, float]:
        self._forget(acked)
        calls = self.engine.running_calls(since)  # then the finished ones: a call is in one or the other
        return {**self._finished, **calls}, self.engine.decoded_rows, self.engine.cut_hold_s

    async def running_tokens(self) -> dict[str, list[int]]:
        return await asyncio.to_thread(self.engine.running_tokens)

    async def decoded_rows(self) -> int:
        return self.engine.decoded_rows

    async def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        await asyncio.to_thread(self.engine.load_weights, state, version)

    async def sampler_identity(self) -> str | None:
        return getattr(self.engine, "sampler_identity", None)

    async def cut_support(self, request: GenerationRequest) -> str | None:
        cut_support = getattr(self.engine, "cut_support", None)
        return cut_support(request) if cut_support is not None else None

    async def abort(self, request_ids: Sequence[str]) -> None:
        # Ray does not promise that an async actor starts calls in the order they were
        # sent: an abort may arrive before its call, which then ends at once.
        self._early_aborts.update(r for r in request_ids if r not in self._known and r not in self._finished)
        self.engine.abort(list(request_ids))

    async def close(self) -> None:
        self.engine.close()


@dataclass(eq=False)
class _Slot:
    index: int
    actor: Any
    generation: int = 0  # how many workers this slot has had, minus one
    calls: set[str] = field(default_factory=set)  # in progress on this slot's worker
    acks: list[str] = field(default_factory=list)  # results the driver completed, to tell the worker
    deaths: int = 0  # deaths since its last finished call
    broken: str | None = None  # why the slot was given up
    ready: bool = False  # its worker is placed, built and current (it takes calls)
    node: str | None = None  # the Ray node of its worker, once ready

    def take_acks(self) -> list[str]:
        acks, self.acks = self.acks, []
        return acks


class RayEnginePool(WorkerSlots):
    """GenerationEngine and PrefixCapture over `workers` Ray actors, each running
    `factory()` (a picklable callable that builds one engine). `address`: None starts a
    local cluster (`ray.init`, `num_cpus` CPUs, Ray's files under `temp_dir` or
    $RAY_TMPDIR) unless Ray is already initialised in this process; else the address of
    a running cluster to join. Each worker reserves `worker_cpus` CPUs and `worker_gpus`
    GPUs, placed by `placement` ("spread" or Ray's "default"). See the module docstring for
    routing, the cut, faults and nodes."""

    _kind = "engine worker"

    def __init__(self, factory: Callable[[], Any], *, workers: int = 1, address: str | None = None,
                 num_cpus: int | None = None, worker_cpus: float = 1.0, worker_gpus: float = 0.0,
                 temp_dir: str | None = None, name: str | None = None, placement: str = "spread"):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        strategy = placement_strategy(placement)
        ray = self._ray = import_ray()
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        self._lost_errors: tuple[type[BaseException], ...] = (RayActorError, ActorUnavailableError)
        self._task_error = RayTaskError
        self._started_ray = False
        self._guard = None
        if not ray.is_initialized():
            import logging

            from .orphan_guard import OrphanGuard, children_of

            before = children_of(os.getpid())
            ray.init(address=address, num_cpus=None if address else (num_cpus or max(1, int(workers * worker_cpus))),
                     include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                     namespace=NAMESPACE, _temp_dir=None if address else temp_dir)
            self._started_ray = True
            if not address:
                # A SIGKILLed driver runs no ray.shutdown: Ray's local processes (GCS, raylet
                # and its agents) were seen alive after it; the guard kills them then.
                self._guard = OrphanGuard(children_of(os.getpid()) - before)
        self._factory = factory
        self._options = {"num_cpus": worker_cpus, "num_gpus": worker_gpus, "max_restarts": 0,
                         "max_concurrency": 1000, "namespace": NAMESPACE, "scheduling_strategy": strategy}
        self._actor_class = ray.remote(EngineWorker)
        self._name = name or f"engine-{os.getpid()}-{id(self):x}"
        self._lock = threading.Lock()  # guards the slots and the call table
        self._weights: Any = None  # ObjectRef of the last refit's state dict
        self._version = 0
        self._calls: dict[str, tuple[_Slot, Any, Future]] = {}  # rid -> (slot, actor, caller's future)
        self._slots = [_Slot(i, None) for i in range(workers)]
        self._closed = False
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._completer = threading.Thread(target=self._complete, name="ray-engine-pool", daemon=True)
        self._completer.start()
        self.cut_hold_s = 0.0  # the longest worker's own hold at the last cut
        self.gather_s = 0.0  # the last cut's wall time across workers
        self.replacements = 0
        self.node_losses = 0
        self._sampler_identity: str | None = None  # the workers' engine's, asked once
        self._cut_verdicts: dict[tuple, str | None] = {}  # _params_key -> the engines' cut_support verdict
        self.cut_support_asks = 0  # remote cut_support asks (the cache's misses)
        try:
            for slot in self._slots:
                self._start(slot)
            info = ray.get([s.actor.describe.remote() for s in self._slots])
        except BaseException:
            self.close()
            raise
        self._started(info)
        self.vocab_size = info[0]["vocab_size"]
        self.max_model_len = info[0]["max_model_len"]
        self._version = info[0]["policy_version"]

    # ---- workers ------------------------------------------------------------------------

    def _start(self, slot: _Slot) -> None:
        """A new actor in `slot`, with the current weights (its constructor installs them,
        before any call can reach it). Named, so an operator (or a test) can find it."""
        name = f"{self._name}-w{slot.index}.{slot.generation}"
        slot.actor = self._actor_class.options(name=name, **self._options).remote(
            self._factory, self._weights, self._version)
        slot.acks = []

    def _catch_up(self, actor: Any, answer: dict) -> Any:
        """A replacement built before a refit that skipped it (it was not placed yet)
        gets that refit before it takes a call."""
        if answer["policy_version"] == self._version:
            return None
        return actor.load_weights.remote(self._weights, self._version)

    def load_per_worker(self) -> list[int]:
        """Calls in progress on each slot's worker (what routing compares)."""
        with self._lock:
            return [len(s.calls) for s in self._slots]

    # ---- GenerationEngine ---------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        check_request(request, self.vocab_size, self.max_model_len)
        rid = request.request_id
        future: Future[GenerationResult] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("engine is closed")
            if rid in self._calls:
                raise ValueError(f"request id already running: {rid!r}")
            slot = self._route(lambda s: len(s.calls))  # placed, then least loaded (module docstring)
            actor = slot.actor
            ref = actor.generate.remote(request, slot.take_acks())
            slot.calls.add(rid)
            self._calls[rid] = (slot, actor, future)
        self._when_done(ref, self._finish, rid, slot, actor, future)  # on the pool's thread (`_complete`)
        return future

    def _finish(self, rid: str, slot: _Slot, actor: Any, future: Future, done: Future) -> None:
        """Complete the caller's future from the actor's answer (a lost worker: replace it)."""
        try:
            result = done.result()
        except self._lost_errors as e:
            with self._lock:
                slot.calls.discard(rid)
                self._calls.pop(rid, None)
            self._lost(slot, actor, e)
            future.set_exception(EngineWorkerLost(f"engine worker {slot.index} is gone (call {rid}): "
                                                  f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
            return
        except self._task_error as e:  # the engine's own error, as the engine raised it
            with self._lock:
                slot.calls.discard(rid)
                self._calls.pop(rid, None)
            future.set_exception(e.cause if isinstance(e.cause, BaseException) else e)
            return
        except BaseException as e:  # noqa: BLE001 - handed to the caller's future
            with self._lock:
                slot.calls.discard(rid)
                self._calls.pop(rid, None)
            future.set_exception(e)
            return
        future.set_result(result)
        with self._lock:  # acknowledged only once the caller's future holds the result
            slot.calls.discard(rid)
            self._calls.pop(rid, None)
            if slot.actor is actor:
                slot.acks.append(rid)
                slot.deaths = 0

    def load_weights(self, state_dict: Mapping[str, object], version: int) -> None:
        """One `ray.put` of the state dict, its reference to every placed worker; waits for
        all. A worker that died meanwhile is replaced (with these weights); one not placed
        yet gets them when it is (`_catch_up`)."""
        ref = self._ray.put(dict(state_dict))
        with self._lock:
            self._weights, self._version = ref, version
            sent = [(s, s.actor, s.actor.load_weights.remote(ref, version)) for s in self._slots if s.ready]
        for slot, actor, done in sent:
            try:
                self._ray.get(done)
            except self._lost_errors as e:
                self._lost(slot, actor, e)
            except self._task_error as e:
                raise (e.cause if isinstance(e.cause, BaseException) else e) from None

    def _gather(self, method: str, *per_slot_args) -> list[tuple[_Slot, Any]]:
        """Ask every placed worker at once; (slot, answer) for those that answered (a dead
        worker is replaced; its calls fail on their own). One still waiting for a node
        would hold the gather until a node joins; it has run nothing yet."""
        with self._lock:
            sent = [(s, s.actor, getattr(s.actor, method).remote(*(a(s) for a in per_slot_args)))
                    for s in self._slots if s.ready]
        out = []
        for slot, actor, ref in sent:
            try:
                out.append((slot, self._ray.get(ref)))
            except self._lost_errors as e:
                self._lost(slot, actor, e)
        return out

    def running_tokens(self) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        for _, answer in self._gather("running_tokens"):
            tokens.update(answer)
        return tokens

    def abort(self, request_ids: Sequence[str]) -> None:
        """To the worker that owns each call; unknown ids are ignored."""
        by_slot: dict[int, tuple[Any, list[str]]] = {}
        with self._lock:
            for rid in request_ids:
                if rid in self._calls:
                    slot, actor, _ = self._calls[rid]
                    if slot.actor is actor:
                        by_slot.setdefault(slot.index, (actor, []))[1].append(rid)
        for actor, ids in by_slot.values():
            actor.abort.remote(ids)  # fire and forget, as the engines' abort (the call ends at its next step)

    # ---- PrefixCapture ------------------------------------------------------------------

    @property
    def sampler_identity(self) -> str:
        """The workers' engine's (every worker runs the same engine), asked of one once."""
        if self._sampler_identity is None:
            for _, answer in self._gather_one("sampler_identity"):
                self._sampler_identity = answer
        return self._sampler_identity or "unknown"

    @property
    def decoded_rows(self) -> int:
        """Tokens decoded by the live workers (a replaced worker starts again from 0: the
        sum changes, which is all a snapshot compares)."""
        return sum(n for _, n in self._gather("decoded_rows"))

    def running_calls(self, since: Mapping[str, int] | None = None) -> dict[str, RunningCall]:
        """Every worker's answer (module docstring, "The cut"); `since` goes to each
        worker as the offsets of the calls it runs, so each copies only their tails."""
        t0 = time.perf_counter()
        answers = self._gather("running_calls", lambda s: s.take_acks(),
                               lambda s: {rid: since[rid] for rid in list(s.calls) if rid in since} if since else None)
        self.gather_s = time.perf_counter() - t0
        calls: dict[str, RunningCall] = {}
        self.cut_hold_s = max((a[2] for _, a in answers), default=0.0)
        for _, (worker_calls, _, _) in answers:
            calls.update(worker_calls)
        return calls

    def cut_support(self, request: GenerationRequest) -> str | None:
        """The engines' own rule (every worker runs the same engine): asked of one worker
        once per kind of call, then answered from the pool's cache. The rollout pump asks
        at every submit at prefix level, on its own thread, and a remote ask is a round
        trip (about 4 ms here, the module docstring); the protocol makes the verdict a
        function of the call's SamplingParams and whether it is seeded
        (`PrefixCapture.cut_support`), so that is the key."""
        key = _params_key(request.params)
        with self._lock:
            if key in self._cut_verdicts:
                return self._cut_verdicts[key]
        self.cut_support_asks += 1
        for _, answer in self._gather_one("cut_support", request):
            with self._lock:
                if len(self._cut_verdicts) >= MAX_CUT_VERDICTS:
                    self._cut_verdicts.clear()  # a bound, never reached by a run's few kinds of call
                self._cut_verdicts[key] = answer
            return answer
        return None  # no live worker answered (replaced meanwhile): ask again next time

    def _gather_one(self, method: str, *args) -> list[tuple[_Slot, Any]]:
        with self._lock:
            live = [s for s in self._slots if s.ready]
            if not live:
                return []
            slot = min(live, key=lambda s: (len(s.calls), s.index))
            actor = slot.actor
        try:
            return [(slot, self._ray.get(getattr(actor, method).remote(*args)))]
        except self._lost_errors as e:
            self._lost(slot, actor, e)
            return []

    # ---- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """End every worker (their calls end with finish_reason "abort" or fail), then the
        local cluster if this pool started it."""
        with self._lock:
            self._closed = True
            actors = [(s.actor, s.ready) for s in self._slots if s.actor is not None]
        ray = self._ray
        for actor, ready in actors:
            try:
                if ready:  # one waiting for a node would hold this for the whole timeout
                    ray.get(actor.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead or stuck worker is killed below anyway
                pass
            ray.kill(actor)
        deadline = time.monotonic() + 10  # the killed workers' calls fail within ms
        while self._calls and time.monotonic() < deadline:
            time.sleep(0.01)
        self._answers.put(None)
        with self._lock:
            left = [f for _, _, f in self._calls.values()]
        for future in left:
            if not future.done():
                future.set_exception(RuntimeError("engine is closed"))
        self._completer.join(timeout=30)
        if self._started_ray:
            ray.shutdown()
            if self._guard is not None:
                self._guard.close()
            self._started_ray = False

    def __enter__(self) -> RayEnginePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
