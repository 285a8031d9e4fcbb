"""What both Ray pools share about their workers (the engine workers of
gpu_capture/ray_workers.py, the environment workers of controller/rollout/ray_environments.py):
each pool has N slots, each running one actor; a dead actor is replaced in its slot, a slot
that keeps dying is given up, and a replacement takes work only once it is placed.

Deaths: a slot whose worker dies `MAX_DEATHS_IN_A_ROW` times in a row without finishing
its work is given up (a worker that dies on every call is broken); the pool refuses work
once every slot is.

Nodes: a node that leaves the cluster takes all its workers at once, and each slot's
replacement needs a node with the resources it reserves. Ray keeps such an actor pending
until one joins (no timeout), so a pool routes work only to slots whose worker is placed
(its `describe` answered, at the current weights version: `_placed`), and the engine pool
asks only those at a cut or a refit: work sent to a pending actor would wait for a node,
and the attempts redone after the loss with it. With no slot placed, work queues on a
pending one and the run waits for a node (an operator sees no progress, nothing fails). A death whose node is gone (`ray.nodes()` no longer lists
it alive) does not count toward `MAX_DEATHS_IN_A_ROW`: the worker did nothing wrong, and
a slot waiting for a node never dies, so a cluster that loses nodes loses no slot. Workers
are placed with Ray's SPREAD strategy by default (`placement`): a node loss then takes the
fewest workers.

Only the pool's own thread (`_complete`) handles an answer: Ray's callback thread only
queues it, since a Ray call made on that thread (starting a replacement actor) hung.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

MAX_DEATHS_IN_A_ROW = 3


# cluster.worker_placement -> Ray's scheduling strategy for the workers (module docstring: Nodes)
PLACEMENTS = {"spread": "SPREAD", "default": "DEFAULT"}


def node_id() -> str | None:
    """The Ray node this process runs on (in an actor), else None."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def placement_strategy(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement: {placement!r} is not one of {', '.join(map(repr, PLACEMENTS))}")
    return PLACEMENTS[placement]


class WorkerSlots:
    """The slots of a Ray pool (the module docstring): a dead actor is replaced once, a
    slot that keeps dying is given up, a replacement takes work only once it is placed,
    and the live actors and their nodes are listed. A pool sets
    `_lock`, `_slots`, `_closed`, `replacements`, `node_losses`, `_ray`, `_kind`,
    `_lost_errors`, `_answers` and `_start(slot)`, and runs `_complete` on its own thread."""

    _kind = "worker"
    _lock: threading.Lock
    _slots: list[Any]
    _closed: bool
    replacements: int
    node_losses: int  # deaths whose node was gone (not counted against the slot)
    _ray: Any
    _lost_errors: tuple[type[BaseException], ...]
    _answers: queue.SimpleQueue

    def _start(self, slot: Any) -> None:
        raise NotImplementedError

    def _catch_up(self, actor: Any, answer: dict) -> Any:
        """None when a placed worker's `describe` answer shows it current, else the
        ObjectRef of the call that makes it so (the engine pool: a refit it missed)."""
        return None

    def _complete(self) -> None:
        """The pool's own thread: runs what Ray's callback thread queued, in arrival
        order. That thread only queues: a Ray call made on it (starting a replacement
        actor) hung."""
        while True:
            item = self._answers.get()
            if item is None:
                return
            item()

    def _when_done(self, ref: Any, handler: Callable[..., None], *args: Any) -> None:
        """`handler(*args, done)` on the pool's thread once `ref` resolves."""
        ref.future().add_done_callback(lambda done: self._answers.put(partial(handler, *args, done)))

    def _started(self, answers: Sequence[dict]) -> None:
        """The first workers answered `describe` (the pool's constructor waits for them)."""
        with self._lock:
            for slot, answer in zip(self._slots, answers):
                slot.ready, slot.node = True, answer.get("node_id")

    def _watch(self, slot: Any, actor: Any) -> None:
        """Take `actor` into routing once it answers: Ray placed it and its constructor ran."""
        self._when_done(actor.describe.remote(), self._placed, slot, actor)

    def _placed(self, slot: Any, actor: Any, done: Future) -> None:
        try:
            answer = done.result()
        except Exception as e:  # noqa: BLE001 - a worker that cannot answer is lost
            if not isinstance(e, self._lost_errors):
                self._ray.kill(actor)
            self._lost(slot, actor, e)
            return
        with self._lock:
            if slot.actor is not actor or self._closed:
                return
            pending = self._catch_up(actor, answer)
            if pending is None:
                slot.ready, slot.node = True, answer.get("node_id")
                return
        self._when_done(pending, lambda s, a, _: self._watch(s, a), slot, actor)

    def _route(self, load: Callable[[Any], int]) -> Any:
        """The slot for the next call or step (under `_lock`): placed ones first, then the
        least loaded, then the lowest index; with every slot given up, RuntimeError saying why."""
        live = [s for s in self._slots if s.broken is None]
        if not live:
            raise RuntimeError("; ".join(s.broken or "" for s in self._slots))
        return min(live, key=lambda s: (not s.ready, load(s), s.index))

    def _lost(self, slot: Any, actor: Any, error: BaseException) -> None:
        """`actor` (which ran in `slot`) is gone: replace it, once, unless the slot keeps
        dying. A death whose node is gone does not count (the module docstring: Nodes)."""
        with self._lock:
            if slot.actor is not actor or self._closed:
                return  # already replaced
            node = slot.node
        node_gone = node is not None and not self._node_alive(node)
        with self._lock:
            if slot.actor is not actor or self._closed:
                return
            slot.generation += 1
            self.replacements += 1
            slot.ready, slot.node = False, None
            if node_gone:
                self.node_losses += 1
            else:
                slot.deaths += 1
            if slot.deaths > MAX_DEATHS_IN_A_ROW:
                slot.broken = f"{self._kind} {slot.index} died {slot.deaths} times in a row; the last: {error}"
                slot.actor = None
                return
            self._start(slot)
            actor = slot.actor
        self._watch(slot, actor)

    def _node_alive(self, node: str) -> bool:
        try:
            return any(n["NodeID"] == node and n["Alive"] for n in self._ray.nodes())
        except Exception:  # noqa: BLE001 - the cluster cannot say: count the death (the safe side)
            return True

    def workers(self) -> list[Any]:
        """The live actors, slot by slot (None for a slot given up)."""
        with self._lock:
            return [s.actor for s in self._slots]

    def worker_nodes(self) -> list[str | None]:
        """Each slot's Ray node while its worker is placed, else None (waiting for a node
        or being built, or given up)."""
        with self._lock:
            return [s.node if s.ready else None for s in self._slots]

    def worker_pids(self) -> list[int]:
        """Every live worker's pid (waits for a replacement still being placed)."""
        return [d["pid"] for d in self._ray.get([a.describe.remote() for a in self.workers() if a is not None])]
