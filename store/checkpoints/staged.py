"""Asynchronous trainer checkpoints: the one commit protocol (publish.py) cut in two.

`begin_trainer_checkpoint(publisher, step, write_fn)` makes the temporary directory under
the save lock and returns a `TrainerStage`; the Publisher's background thread
(`rolloutdb-publish`, the pool `publish_deferred` and background retention use) writes
the files (`write_fn(tmpdir)`) and seals them (steps 2-3: fsync and hash every file, the
manifest last, every directory fsynced) holding no lock, so snapshots anchored to
earlier checkpoints go on meanwhile. `stage.publish()` is steps 4-5 (rename into place,
fsync the parent) under the save lock: a few milliseconds, at whatever later moment the
caller chooses (the controller: a later step boundary).

Until it is published the anchor is not durable: `scan` lists the temporary directory
as a leftover, never as a checkpoint, and a snapshot can be published under it only
after the rename. A snapshot whose cut was taken at the checkpoint's own step is *held*
inside the temporary directory (`begin_snapshot(anchor, pending=stage)`) and moves with
the rename; a crash before the rename leaves one temporary directory (the checkpoint and
its held snapshots), which the next save removes, and the previous anchor stays in force.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from .layout import SNAPSHOTS_DIR, anchor_dir, anchor_name
from .manifest import KIND_TRAINER, Manifest
from .publish import (
    Published,
    PublishError,
    Publisher,
    SnapshotStage,
    _as_os_error,
    _discard_tmp,
    _fail,
    rename_into_place,
    seal_directory,
)


class TrainerStage:
    """A trainer checkpoint being written off the caller's thread. `written()` says the
    background write ended; `publish()` renames it into place; `abort()` removes it."""

    def __init__(self, publisher: Publisher, step: int, tmp: Path, target: Path, cleaned: list[Path]):
        self.publisher = publisher
        self.step = step
        self.anchor = anchor_name(step)
        self.tmp = tmp
        self.target = target
        self.cleaned = cleaned
        self.manifest = Manifest(kind=KIND_TRAINER, anchor=self.anchor, files=[], step=step)
        self.future: Future | None = None
        self.snapshots: list[SnapshotStage] = []  # held: captured, published after this one
        self.published: Published | None = None
        self.error: BaseException | None = None  # the write's failure, or why it was aborted
        self.done = False  # published or aborted

    def written(self) -> bool:
        """Whether the background write ended (sealed, or failed)."""
        return self.future is None or self.future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the background write; its failure is kept in `error`, not raised.
        Raises TimeoutError when `timeout` passes first."""
        if self.future is None:
            return
        try:
            self.future.result(timeout)
        except TimeoutError:
            if not self.future.done():
                raise
        except BaseException as e:  # noqa: BLE001 - kept; publish() raises it
            self.error = self.error or e
        if self.future.done() and self.future.exception() is not None:
            self.error = self.error or self.future.exception()

    def publish(self, *, blocking: bool = True) -> Published | None:
        """Rename the sealed directory into place (waiting for the write first). None
        when `blocking` is False and another save holds the save lock: try again later.
        A failed write raises PublishError, and the stage is removed."""
        return finish_trainer_checkpoint(self.publisher, self, blocking)

    def abort(self) -> None:
        abort_trainer_checkpoint(self.publisher, self)


def begin_trainer_checkpoint(pub: Publisher, step: int, write_fn: Callable[[Path], Any]) -> TrainerStage:
    target = anchor_dir(pub.root, anchor_name(step))
    with pub.lock:
        _inv, cleaned = pub._start_save()
        if target.exists():
            raise PublishError(f"{target}: already exists; a trainer checkpoint is published once", path=target)
        try:
            tmp = pub._make_tmp(target)  # busy: no other save removes it as a leftover
        except OSError as e:
            raise _fail("creating the temporary directory", target, e) from e
        stage = TrainerStage(pub, step, tmp, target, cleaned)
        stage.future = pub._pool().submit(_write, stage, write_fn)
        return stage


def _write(stage: TrainerStage, write_fn: Callable[[Path], Any]) -> dict[str, float]:
    """On the background thread, holding no lock: the payload, then steps 2-3."""
    t0 = time.perf_counter()
    write_fn(stage.tmp)
    timings = {"write": time.perf_counter() - t0}
    timings.update(seal_directory(stage.tmp, stage.manifest, skip_dirs=(SNAPSHOTS_DIR,)))
    return timings


def finish_trainer_checkpoint(pub: Publisher, stage: TrainerStage, blocking: bool) -> Published | None:
    if stage.done:
        raise PublishError(f"{stage.target}: this stage was already published or aborted", path=stage.target)
    stage.wait()
    if stage.error is not None:
        abort_trainer_checkpoint(pub, stage)
        e = stage.error
        cause = _as_os_error(e)  # a full disk under safetensors' write too
        if cause is not None:
            raise _fail("trainer checkpoint (background write)", stage.target, cause) from e
        raise PublishError(f"{stage.target}: the background write failed ({type(e).__name__}: {e}); "
                           "earlier checkpoints are intact", path=stage.target) from e
    if not pub.lock.acquire(blocking=blocking):
        return None
    try:
        t0 = time.perf_counter()
        try:
            timings = rename_into_place(stage.tmp, stage.target)
        except OSError as e:
            stage.error = e
            _discard(pub, stage)
            raise _fail("trainer checkpoint (rename)", stage.target, e) from e
        # The held snapshots moved with the directory: follow them, still busy.
        pub._busy.discard(stage.tmp)
        for snap in stage.snapshots:
            pub._busy.discard(snap.tmp)
            snap.move_under(stage.target)
            if not snap.done:
                pub._busy.add(snap.tmp)
        timings.update(stage.future.result() if stage.future is not None else {})
        timings["publish"] = time.perf_counter() - t0
        stage.done = True
        # Retention on the background thread: deleting old checkpoints is no work for
        # the caller's step boundary (its failures are reported by a later save).
        pub._pool().submit(pub._retain_in_background)
        stage.published = Published(KIND_TRAINER, stage.anchor, stage.target, stage.manifest, None, timings,
                                    stage.cleaned, None, pub._take_warnings())
        return stage.published
    finally:
        pub.lock.release()


def abort_trainer_checkpoint(pub: Publisher, stage: TrainerStage) -> None:
    """Wait for the write to end, then remove the temporary directory and the snapshots
    held in it. Best effort: what stays is a leftover the next save removes."""
    stage.wait()
    with pub.lock:
        if not stage.done:
            stage.error = stage.error or PublishError(f"{stage.target}: aborted before it was published",
                                                      path=stage.target)
            _discard(pub, stage)


def _discard(pub: Publisher, stage: TrainerStage) -> None:
    _discard_tmp(stage.tmp)
    pub._busy.discard(stage.tmp)
    for snap in stage.snapshots:
        pub._busy.discard(snap.tmp)
        snap.done = True
    stage.done = True
