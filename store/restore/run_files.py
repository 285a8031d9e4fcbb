"""File operations a resume makes on a run's store and checkpoint directory, so the
controller never handles the store's files, side files or checkpoint layout itself.
The controller passes every path in (its run directory names them); nothing here knows
the run directory's file names.

* `drop_checkpoints_after`: after a restore, the trainer checkpoints of the branch the
  stop cut off.
* `move_run_aside`: `--start-over` moves the store, the checkpoints and any other file
  into a directory the caller made; nothing is deleted, snapshot numbers keep growing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..checkpoints.layout import scan
from ..checkpoints.manifest import KIND_TRAINER
from ..checkpoints.publish import record_high_water
from ..checkpoints.retention import remove_tree
from ..fsio import SQLITE_SIDE_SUFFIXES, fsync_dir, rename


def drop_checkpoints_after(checkpoint_dir: str | Path, step: int) -> list[str]:
    """Trainer checkpoints newer than `step` (the restored anchor's) belong to the branch
    the stop cut off: the rollout state that went with them is gone, and the resumed run
    will publish those steps again. Remove them (trash rename, then delete) before it
    does, after recording the highest snapshot number, so none of theirs is handed out
    again. Returns the removed anchors' names."""
    checkpoint_dir = Path(checkpoint_dir)
    inv = scan(checkpoint_dir)
    doomed = [e for e in inv.anchors if e.kind == KIND_TRAINER and e.step is not None and e.step > step]
    if doomed:
        record_high_water(checkpoint_dir, inv.max_sequence())
    for entry in doomed:
        remove_tree(entry.path, "cleanup")
    return [e.anchor for e in doomed]


def move_run_aside(dest: str | Path, *, store: str | Path, checkpoints: str | Path, also: Sequence[str | Path] = ()) -> None:
    """Move the store (with its side files), the checkpoint directory and the paths in
    `also` into the existing directory `dest`, each under its own name; missing ones are
    skipped. The moves are made durable (`dest` and every source's parent fsynced). A new
    checkpoint directory starts with the old high-water mark, so snapshot numbers keep
    growing."""
    dest, checkpoints = Path(dest), Path(checkpoints)
    high = scan(checkpoints).max_sequence()
    store_files = [Path(store), *(Path(f"{store}{suffix}") for suffix in SQLITE_SIDE_SUFFIXES)]
    sources = [*store_files, checkpoints, *map(Path, also)]
    for path in sources:
        if path.exists():
            rename(path, dest / path.name)
    fsync_dir(dest)
    for parent in sorted({p.parent for p in sources}):
        fsync_dir(parent)
    if high:
        checkpoints.mkdir()
        record_high_water(checkpoints, high)
