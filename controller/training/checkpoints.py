"""Trainer checkpoints: `bootstrap/` before the first step and `step_<N>/` on the
configured interval, published through the store's one commit protocol under the save
lock (the Publisher's) that rollout snapshots take too.

Synchronous (the default): the train pump writes, fsyncs and renames the checkpoint at
the step boundary, so it stalls for the whole write.

Asynchronous (`checkpointing.async: true`, a trainer with `checkpoint_state`): at the
step boundary the train pump only copies the state into CPU memory and makes the
temporary directory; the Publisher's background thread writes and seals it
(`store/checkpoints/staged.py`), and it is published (rename, parent fsync) as soon as
the write has ended: by the snapshot pump before its next attempt (`publish_if_written`,
so interval snapshots anchor to it within the write's time, not a whole train step
later), or by the train pump at a later step boundary, whichever comes first. Until then
the anchor in force is the previous one, and no snapshot can anchor to the new weights:
with a train step of tens of seconds, waiting for the next boundary made every interval
snapshot of that step `skipped_not_durable`. One write at a time: a checkpoint that falls due while the
previous one is still being written is *skipped* (a `checkpoint` line with outcome
`skipped_busy`), so the train pump never waits for the disk; the last step's checkpoint
is never skipped (the train pump waits for the earlier write, then begins it), and the
run's end waits for it to be published.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rolloutdb.config import Config
from rolloutdb.controller.protocols import AsyncCheckpointing, CheckpointState, Trainer
from rolloutdb.store import Published, Publisher, TrainerStage, anchor_name, begin_trainer_checkpoint, faults, scan


def write_checkpoint_state(state: CheckpointState, directory: Path) -> list[Path]:
    """Write a `CheckpointState` into an existing directory: each tensor mapping as one
    safetensors file, each document as one JSON file, each copy as is. Touches nothing
    but `state` and `directory`, so it runs on any thread."""
    from safetensors.torch import save_file

    written = []
    for name in [*state.tensors, *state.documents, *state.copies]:
        if Path(name).name != name or name in (".", ".."):
            raise ValueError(f"checkpoint file {name!r}: must be a plain file name")
    for name, tensors in state.tensors.items():
        save_file(dict(tensors), directory / name, metadata=state.metadata.get(name))
        written.append(directory / name)
    for name, doc in state.documents.items():
        (directory / name).write_text(json.dumps(doc, indent=1, sort_keys=True))
        written.append(directory / name)
    for name, src in state.copies.items():
        shutil.copyfile(src, directory / name)
        written.append(directory / name)
    return written


class TrainerCheckpoints:
    """Publishes `bootstrap/` before the first step and `step_<N>/` every
    `checkpointing.interval_steps`, through the one commit protocol, synchronously or
    (`checkpointing.async`) from a copy written in the background (module docstring).
    `log_event` gets one `checkpoint` line per due checkpoint: outcome `published`
    (sync), `begun` then `published` (async), or `skipped_busy`, with `stall_s`, the
    train pump's time in it; `on_written` is called (on the Publisher's background thread)
    when an asynchronous write ends, `on_published` after an asynchronous publication."""

    def __init__(self, config: Config, trainer: Trainer, publisher: Publisher, *,
                 log_event: Callable[[dict], None] | None = None, on_published: Callable[[], None] | None = None,
                 on_written: Callable[[], None] | None = None):
        self.config = config.checkpointing
        self.total_steps = config.algorithm.total_steps
        self.trainer = trainer
        self.publisher = publisher
        self.asynchronous = self.config.enabled and self.config.async_
        if self.asynchronous and not isinstance(trainer, AsyncCheckpointing):
            raise ValueError(f"checkpointing.async: true needs a trainer with checkpoint_state() "
                             f"(controller/protocols.py AsyncCheckpointing); {type(trainer).__name__} has only "
                             "save_checkpoint: set checkpointing.async: false or implement it")
        self.log_event = log_event or (lambda event: None)
        self.on_published = on_published or (lambda: None)
        self.on_written = on_written or (lambda: None)
        self.pending: TrainerStage | None = None  # async: begun, not yet published
        # `pending` is read and published by the train pump and by the snapshot pump
        # (`publish_if_written`). Taken before the save lock, never inside it (runtime.py's
        # lock order); re-entrant: `maybe_publish` polls inside it.
        self._lock = threading.RLock()

    def _write(self, tmp: Path) -> None:
        self.trainer.save_checkpoint(tmp)

    def _log(self, step: int, outcome: str, stall_s: float, cpu0: float, **fields) -> None:
        """`stall_s`: the train pump's wall time in it; `stall_cpu_s`: its CPU time (what
        it costs apart from waiting for the disk or for a CPU on a loaded machine)."""
        self.log_event({"kind": "checkpoint", "step": step, "outcome": outcome, "async": self.asynchronous,
                        "stall_s": stall_s, "stall_cpu_s": time.thread_time() - cpu0, "t": time.time(), **fields})

    def publish_bootstrap(self) -> None:
        """Once per run directory: a resumed run keeps the bootstrap it has. Always
        synchronous: nothing trains yet."""
        from rolloutdb.store import BOOTSTRAP, scan

        with self.publisher.lock:  # the look and the publication are one save
            if BOOTSTRAP not in scan(self.publisher.root).durable_anchor_names():
                self.publisher.publish_bootstrap(self._write)

    def maybe_publish(self, step: int) -> bool:
        """At the boundary after optimizer step `step`: publish (sync) or begin (async)
        its checkpoint when one is due. Returns whether it did."""
        if not self.config.enabled or step % self.config.interval_steps:
            return False
        with self._lock:
            return self._publish_or_begin(step)

    def _publish_or_begin(self, step: int) -> bool:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if not self.asynchronous:
            published = self.publisher.publish_trainer_checkpoint(step, self._write)  # takes the save lock
            self._log(step, "published", time.perf_counter() - t0, cpu0, timings=published.timings)
            return True
        if self.pending is not None:
            if step < self.total_steps:
                self._log(step, "skipped_busy", time.perf_counter() - t0, cpu0, writing=self.pending.anchor)
                return False
            self.poll(wait=True)  # the last step's checkpoint is never skipped
            t0, cpu0 = time.perf_counter(), time.thread_time()
        state = self.trainer.checkpoint_state()  # type: ignore[attr-defined]
        copied, copied_cpu = time.perf_counter(), time.thread_time()
        self.pending = begin_trainer_checkpoint(self.publisher, step, lambda tmp: self._write_state(state, tmp))
        if self.pending.future is not None:  # tell whoever publishes it that it can, at once
            self.pending.future.add_done_callback(lambda _done: self.on_written())
        self._log(step, "begun", time.perf_counter() - t0, cpu0, copy_s=copied - t0, copy_cpu_s=copied_cpu - cpu0)
        return True

    @staticmethod
    def _write_state(state: CheckpointState, tmp: Path) -> None:
        """On the Publisher's background thread."""
        write_checkpoint_state(state, tmp)
        faults.point("checkpoint.files_written")

    def publish_if_written(self) -> Published | None:
        """From the snapshot pump, before each attempt, holding no lock: publish the
        pending checkpoint if its write has ended. Never waits: when the train pump is in
        its own checkpoint work (or another save holds the save lock) it is left for the
        next try. A failed write raises PublishError, as at a step boundary."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self.poll()
        finally:
            self._lock.release()

    def poll(self, *, wait: bool = False) -> Published | None:
        """Async: publish the pending checkpoint if its write has ended and the save
        lock is free (else leave it for a later try); with `wait`, wait for both. A
        failed write raises PublishError: the previous anchor stays in force."""
        with self._lock:
            return self._poll(wait)

    def _poll(self, wait: bool) -> Published | None:
        stage = self.pending
        if stage is None or not (wait or stage.written()):
            return None
        t0, cpu0 = time.perf_counter(), time.thread_time()
        faults.point("train.before_checkpoint_publish")
        try:
            published = stage.publish(blocking=wait)
        except BaseException:
            self.pending = None  # removed by publish; the run fails with the error
            raise
        if published is None:
            return None
        self.pending = None
        faults.point("train.after_checkpoint_publish")
        self._log(stage.step, "published", time.perf_counter() - t0, cpu0, timings=published.timings,
                  at_end=wait)
        self.on_published()
        return published

    def finish(self) -> None:
        """At the end of a run: the pending checkpoint published (waits for its write)."""
        self.poll(wait=True)

    def publish_at_stop(self, step: int, *, write: bool) -> bool:
        """A graceful stop (`Controller.request_shutdown`): the pending checkpoint published
        (its write waited for), then, with `write`, `step_<step>` written now if it is not
        durable (the final rollout snapshot can anchor only to the weights in force). One
        save of the trainer's state, the cost of any due checkpoint; without it a stop between
        two due checkpoints saves nothing new. Returns whether `step_<step>` (`bootstrap` at
        step 0) is durable."""
        if not self.config.enabled:
            return False
        self.finish()
        anchor = anchor_name(step or None)
        with self._lock, self.publisher.lock:  # the look and the publication are one save
            if anchor in scan(self.publisher.root).durable_anchor_names():
                return True
            if not write or step == 0:  # bootstrap is published at setup
                return False
            t0, cpu0 = time.perf_counter(), time.thread_time()
            published = self.publisher.publish_trainer_checkpoint(step, self._write)
            self._log(step, "published", time.perf_counter() - t0, cpu0, timings=published.timings, at_stop=True)
            return True

    def abandon(self) -> None:
        """A run that fails: remove the pending checkpoint (waits for its write to end)."""
        with self._lock:
            if self.pending is not None:
                self.pending.abort()
                self.pending = None
