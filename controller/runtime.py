"""The one bundle of parts both pumps share, and the runtime state they coordinate by.

The pumps never read each other's (or the controller's) fields: they see the trainer's
live counters only through `read_progress`, and signal each other only through
`RuntimeState` (a condition variable, a stop flag and the first error).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rolloutdb.config import Config
from rolloutdb.controller.protocols import Environment, Trainer
from rolloutdb.controller.sampler import PromptOrder, StalenessBound
from rolloutdb.gpu_capture.protocol import GenerationEngine
from rolloutdb.store import Store


@dataclass(frozen=True)
class Progress:
    """The trainer's live counters."""

    step: int  # optimizer steps done
    policy_version: int  # version the engine generates with


class RuntimeState:
    """How the pumps wait for each other. `notify()` after anything another pump may be
    waiting for (a publish, a train step, a refit)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        # Held by the train pump from the optimizer step until its groups are marked
        # trained: a snapshot cut must fall entirely before or after a commit.
        self.commit_lock = threading.Lock()
        # One save at a time: trainer checkpoints, deferred publication, snapshots.
        self.save_lock = threading.RLock()

    def notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def wait(self, timeout: float) -> None:
        with self._changed:
            if not self.stop.is_set():
                self._changed.wait(timeout)

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.stop.set()
        self.notify()


@dataclass
class RolloutParts:
    config: Config
    store: Store
    order: PromptOrder
    bound: StalenessBound
    engine: GenerationEngine
    env: Environment
    trainer: Trainer
    dispatcher: Any  # LedgerDispatch | NoLedgerDispatch
    runtime: RuntimeState
    read_progress: Callable[[], Progress]
    log_event: Callable[[dict], None]
    tracer: Any = None  # rolloutdb.store.trace tracer or None
