"""Environment steps, in the driver or on environment workers, behind one seam.

The rollout pump takes a finished model call in two halves: it hands the environment's
step on the reply to the stepper, and once the step is done it takes the reply and
applies the step together (`Episode.take_reply`, `Episode.apply`; controller/rollout/calls.py).
The step goes through an
`EnvironmentStepper`: `step(state, reply_ids, last)` returns a
`concurrent.futures.Future` of the `StepOutcome` (the new state, the observation, and the
reward when the step ended the episode). Two implementations:

* `LocalStepper` (the default, `cluster.environment_workers: 0`): runs the step inline on
  the pump's thread and returns a future that is already done. The pump sees it done and
  applies it at once, so an in-driver run takes each step in its own turn of the loop,
  with no wait and no reordering, at the cost of one Future (about 2 us).
* `EnvironmentWorkerPool` (controller/rollout/ray_environments.py, `cluster.environment_workers`
  > 0 with `cluster.backend: ray`): the step runs on a Ray actor; its future completes on
  the pool's thread and reaches the pump through the same completion queue the engine's
  futures use, so the pump's thread never waits on a remote step.

Both step with `step_environment` (controller/rollout/episodes.py): the same rule decides when a
step scores. Workers are stateless: the episode's state is the JSON-able dict the driver
keeps in its `Episode` (and the store saves at a cut), sent with each step and returned
with its answer, so a worker holds nothing the store does not have at the cut, by
construction. A worker that dies fails the step's future with `EnvironmentWorkerLost`
(a `WorkerLost`, as an engine worker's loss is): the pump abandons the attempt with
reason `error` and starts it again.

`env.start` stays in the driver, on the driver's own environment instance (the one
`controller/job/build.py` builds with the dataset): it is deterministic for a prompt id
(`Episode.resumed` and the train pump already rely on that), the built-in tasks' start
is a tokenizer call of a few tens of us, and a new group's episodes start in one commit
on the pump thread, where a remote start would cost a round trip per batch. A plugin
environment whose `start` is expensive still runs it in the driver; say so in docs/ray.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

from rolloutdb.controller.rollout.episodes import StepOutcome, step_environment
from rolloutdb.controller.protocols import Environment
from rolloutdb.gpu_capture.protocol import WorkerLost


class EnvironmentWorkerLost(WorkerLost):
    """A step's future fails with this when the environment worker that ran it is gone
    (killed, SIGKILLed, crashed): the step did not happen (the episode's state in the
    driver is unchanged), the pool replaces the worker, and the attempt starts again."""


@runtime_checkable
class EnvironmentStepper(Protocol):
    """Steps an environment on a reply: see the module docstring."""

    def step(self, state: dict, reply_ids: Sequence[int], *, last: bool) -> Future[StepOutcome]:
        """Step on `reply_ids` from `state`; score when the episode ends there (the
        environment says done, or `last`: its last allowed turn). The future fails with
        the environment's own error, or with `WorkerLost` when a worker died under it."""
        ...

    def close(self) -> None:
        ...


class LocalStepper:
    """The environment in the driver: each step runs inline, its future already done."""

    def __init__(self, env: Environment):
        self.env = env

    def step(self, state: dict, reply_ids: Sequence[int], *, last: bool) -> Future[StepOutcome]:
        future: Future[StepOutcome] = Future()
        try:
            future.set_result(step_environment(self.env, state, reply_ids, last=last))
        except Exception as e:  # noqa: BLE001 - the environment's error, handed to the future as a worker's would be
            future.set_exception(e)
        return future

    def close(self) -> None:
        pass  # the environment is the driver's own; nothing to end
