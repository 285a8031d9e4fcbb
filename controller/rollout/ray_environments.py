"""Environment workers on Ray (`cluster.environment_workers` > 0 with `cluster.backend:
ray`): `EnvironmentWorkerPool` is an `EnvironmentStepper` (controller/rollout/env_steps.py) whose
steps run in N Ray actors. Ray is imported lazily (the engine pool's `import_ray`); the
rest of the controller does not know about Ray.

Each worker builds the run's environment itself, from the run's config (sent as its JSON
form, `Config.model_dump(mode="json")`, never a pickled environment) and the policy
directory (the tokenizer), with the same builder an in-driver run uses
(`controller/tasks/registry.py`'s `check_plugins` and `build_task`: the built-in tasks and an
`environment.factory` plugin alike). Workers are stateless: a step carries the
episode's state (the JSON-able dict the driver keeps and the store saves at a cut) and
returns the new one (`StepOutcome.to_json`), so a worker holds nothing the store lacks at
a cut, and any worker can take any episode's next step.

Routing: least loaded (fewest steps in progress, ties to the lowest index), as the
engine pool routes calls. A worker runs one step at a time (a plain actor): a slow step
(a plugin environment running code) holds only its worker, and the next steps go to the
others.

Faults: a worker that dies (ray.kill, its process SIGKILLed, a crash) fails each step it
held with `EnvironmentWorkerLost`; the pool starts a replacement in its slot at once (it
builds its environment from the config, as the first did) and routes steps to it once it
answers. A slot whose worker dies more than `MAX_DEATHS_IN_A_ROW` times without finishing a
step is given up; with every slot given up, `step` raises RuntimeError and the run stops
with it. A node that leaves takes all its workers at once: their deaths do not count, and
each replacement waits for a node that can host it (gpu_capture/ray_slots.py, shared with
the engine pool). A step's answer comes back on Ray's callback thread, which only queues
it: the pool's own thread completes the futures and starts replacements.

Ray must already be initialised: `build_engine` starts (or joins) the cluster with the
engine pool, and sizes a local one for both kinds of worker.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutdb.config import Config
from rolloutdb.controller.rollout.env_steps import EnvironmentWorkerLost
from rolloutdb.controller.rollout.episodes import StepOutcome, step_environment
from rolloutdb.gpu_capture.ray_slots import WorkerSlots, node_id, placement_strategy
from rolloutdb.gpu_capture.ray_workers import NAMESPACE, import_ray


class EnvironmentWorker:
    """The actor body (made a Ray actor by the pool): one environment, built here from
    the run's config; every step is a pure function of its arguments."""

    def __init__(self, config: dict, policy_dir: str):
        from rolloutdb.controller.tasks import registry

        cfg = Config.model_validate(config)
        _, self.env = registry.build_task(cfg, Path(policy_dir), registry.check_plugins(cfg))
        self.served = 0  # steps done here (placement checks: a worker on a new node serves)

    def describe(self) -> dict:
        return {"pid": os.getpid(), "node_id": node_id(), "served": self.served, "max_turns": self.env.max_turns}

    def step(self, state: dict, reply_ids: list[int], last: bool) -> dict:
        answer = step_environment(self.env, state, reply_ids, last=last).to_json()
        self.served += 1
        return answer


@dataclass(eq=False)
class _Slot:
    index: int
    actor: Any
    generation: int = 0  # how many workers this slot has had, minus one
    steps: int = 0  # in progress on this slot's worker
    deaths: int = 0  # deaths since its last finished step
    broken: str | None = None  # why the slot was given up
    ready: bool = False  # its worker is placed and built (it takes steps)
    node: str | None = None  # the Ray node of its worker, once ready


class EnvironmentWorkerPool(WorkerSlots):
    """`workers` environment actors for the run `config` (policy tokenizer from
    `policy_dir`), each reserving `worker_cpus` CPUs, placed by `placement` ("spread" or
    Ray's "default"). See the module docstring."""

    _kind = "environment worker"

    def __init__(self, config: Config, policy_dir: str | Path, *, workers: int, worker_cpus: float = 1.0,
                 name: str | None = None, placement: str = "spread"):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        strategy = placement_strategy(placement)
        ray = self._ray = import_ray()
        if not ray.is_initialized():
            raise RuntimeError("environment workers join the Ray cluster the engine pool started or joined; "
                               "initialise Ray first (build_engine does)")
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        self._lost_errors: tuple[type[BaseException], ...] = (RayActorError, ActorUnavailableError)
        self._task_error = RayTaskError
        self._config = config.model_dump(mode="json")  # what each worker builds its environment from
        self._policy_dir = str(policy_dir)
        self._actor_class = ray.remote(EnvironmentWorker)
        self._options = {"num_cpus": worker_cpus, "max_restarts": 0, "namespace": NAMESPACE,
                         "scheduling_strategy": strategy}
        self._name = name or f"env-{os.getpid()}-{id(self):x}"
        self._lock = threading.Lock()  # guards the slots
        self._slots = [_Slot(i, None) for i in range(workers)]
        self._pending: dict[Future, tuple[_Slot, Any]] = {}  # caller's future -> where its step runs
        self._closed = False
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._completer = threading.Thread(target=self._complete, name="ray-env-pool", daemon=True)
        self._completer.start()
        self.replacements = 0
        self.node_losses = 0
        try:
            for slot in self._slots:
                self._start(slot)
            info = ray.get([s.actor.describe.remote() for s in self._slots])  # a broken build fails here, not mid-run
        except BaseException:
            self.close()
            raise
        self._started(info)

    # ---- workers ------------------------------------------------------------------------

    def _start(self, slot: _Slot) -> None:
        """A new actor in `slot`, named so an operator (or a test) can find it."""
        slot.actor = self._actor_class.options(name=f"{self._name}-w{slot.index}.{slot.generation}",
                                               **self._options).remote(self._config, self._policy_dir)

    def load_per_worker(self) -> list[int]:
        with self._lock:
            return [s.steps for s in self._slots]

    # ---- EnvironmentStepper -------------------------------------------------------------

    def step(self, state: dict, reply_ids: Sequence[int], *, last: bool) -> Future[StepOutcome]:
        future: Future[StepOutcome] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("environment workers are closed")
            slot = self._route(lambda s: s.steps)  # placed, then least loaded
            actor = slot.actor
            ref = actor.step.remote(state, [int(t) for t in reply_ids], last)
            slot.steps += 1
            self._pending[future] = (slot, actor)
        self._when_done(ref, self._finish, slot, actor, future)  # on the `ray-env-pool` thread
        return future

    def _finish(self, slot: _Slot, actor: Any, future: Future, done: Future) -> None:
        with self._lock:
            slot.steps -= 1
            self._pending.pop(future, None)
        try:
            answer = done.result()
        except self._lost_errors as e:
            self._lost(slot, actor, e)
            first = str(e).splitlines()[0] if str(e) else ""
            future.set_exception(EnvironmentWorkerLost(f"environment worker {slot.index} is gone: "
                                                       f"{type(e).__name__}: {first}"))
            return
        except self._task_error as e:  # the environment's own error, as it raised it
            future.set_exception(e.cause if isinstance(e.cause, BaseException) else e)
            return
        except BaseException as e:  # noqa: BLE001 - handed to the caller's future
            future.set_exception(e)
            return
        with self._lock:
            if slot.actor is actor:
                slot.deaths = 0
        try:
            future.set_result(StepOutcome.from_json(answer))
        except Exception as e:  # noqa: BLE001 - a malformed answer fails its step, not this thread
            future.set_exception(e)

    # ---- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Kill every worker; steps still in progress fail (the run is stopping: a resume
        redoes their attempts). Ray itself is the engine pool's to shut down."""
        with self._lock:
            self._closed = True
            actors = [s.actor for s in self._slots if s.actor is not None]
        for actor in actors:
            self._ray.kill(actor)
        deadline = time.monotonic() + 10  # the killed workers' steps fail within ms
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.01)
        self._answers.put(None)
        self._completer.join(timeout=30)
        with self._lock:
            left, self._pending = list(self._pending), {}
        for future in left:
            if not future.done():
                future.set_exception(RuntimeError("environment workers are closed"))

    def __enter__(self) -> EnvironmentWorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
