"""Which checkpoints to keep, and deleting the rest without ever showing half of one.

Retention is a set of small policies. Each one *votes to keep* some complete entries of
the kind it manages; a managed entry that no policy keeps is deleted. On top of the
votes, two guards always hold: the newest complete rollout snapshot and its anchor are
kept (the restore target), and the newest complete trainer checkpoint is kept. A snapshot
lives inside its anchor's directory, so deleting an anchor deletes its snapshots with it.

    Retention(KeepNewestSnapshots(3), KeepNewestSnapshotPerAnchor(1), PruneBootstrap())

Deleting is a rename to a trash name (``.snapshot_7.<pid>.trash``), a parent fsync, then
``rmtree``: a crash in the middle leaves a trash directory, which listing shows as
incomplete and the next save removes. A failed delete is logged and reported, never
raised; the entry is still there, so the next run of retention tries again.

Leftovers (temporary directories of a crashed publish, trash) are removed by
`remove_leftovers`, which the publisher calls at the start of every save.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Set
from dataclasses import dataclass, field
from pathlib import Path

from .. import faults
from ..fsio import fsync_dir, leftover_kind, rename, trash_path_beside
from .layout import BOOTSTRAP, SNAPSHOT_DB, Entry, Inventory, anchor_order, scan

log = logging.getLogger(__name__)

SNAPSHOTS, BOOTSTRAP_ANCHOR, STEP_ANCHORS = "snapshots", "bootstrap", "steps"


@dataclass(frozen=True)
class KeepNewestSnapshots:
    """Keep the newest `k` complete rollout snapshots (by sequence)."""

    k: int
    manages = (SNAPSHOTS,)

    def keep(self, inv: Inventory) -> Iterable[Entry]:
        return inv.complete_snapshots()[-self.k:] if self.k > 0 else []


@dataclass(frozen=True)
class KeepNewestSnapshotPerAnchor:
    """Keep the newest `n` snapshots of every kept trainer checkpoint, so a run can
    be restored at any step whose weights are still on disk."""

    n: int = 1
    manages = (SNAPSHOTS,)

    def keep(self, inv: Inventory) -> Iterable[Entry]:
        by_anchor: dict[str, list[Entry]] = {}
        for s in inv.complete_snapshots():
            by_anchor.setdefault(s.anchor, []).append(s)
        return [s for group in by_anchor.values() for s in group[-self.n:]] if self.n > 0 else []


@dataclass(frozen=True)
class PruneBootstrap:
    """Keep `bootstrap/` only until a durable `step_<N>` exists."""

    manages = (BOOTSTRAP_ANCHOR,)

    def keep(self, inv: Inventory) -> Iterable[Entry]:
        if any(a.complete and a.anchor != BOOTSTRAP for a in inv.anchors):
            return []
        return [a for a in inv.complete_anchors() if a.anchor == BOOTSTRAP]


@dataclass(frozen=True)
class KeepNewestTrainerCheckpoints:
    """Keep the newest `k` durable `step_<N>` (only when rolloutdb, not the trainer,
    manages trainer checkpoints)."""

    k: int
    manages = (STEP_ANCHORS,)

    def keep(self, inv: Inventory) -> Iterable[Entry]:
        steps = [a for a in inv.complete_anchors() if a.anchor != BOOTSTRAP]
        return steps[-self.k:] if self.k > 0 else []


@dataclass
class RetentionPlan:
    delete: list[Entry]
    keep: list[Entry]


@dataclass
class RetentionReport:
    deleted: list[Path] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Retention:
    """A composition of policies; see the module docstring for the rules."""

    def __init__(self, *policies):
        self.policies = policies

    def plan(self, inv: Inventory) -> RetentionPlan:
        managed = {m for p in self.policies for m in p.manages}
        voted = {e.path for p in self.policies for e in p.keep(inv)}
        anchors = inv.complete_anchors()
        snapshots = [s for s in inv.complete_snapshots() if s.anchor in {a.anchor for a in anchors}]
        protected = set()
        if snapshots:
            newest = snapshots[-1]
            protected |= {newest.path, *(a.path for a in anchors if a.anchor == newest.anchor)}
        if anchors:
            protected.add(max(anchors, key=lambda a: anchor_order(a.anchor)).path)

        def manages(e: Entry) -> bool:
            if e.kind == "rollout_snapshot":
                return SNAPSHOTS in managed
            return (BOOTSTRAP_ANCHOR if e.anchor == BOOTSTRAP else STEP_ANCHORS) in managed

        doomed_anchors = [a for a in anchors if manages(a) and a.path not in voted | protected]
        gone = {a.anchor for a in doomed_anchors}
        doomed_snaps = [
            s for s in inv.complete_snapshots()
            if s.anchor not in gone and manages(s) and s.path not in voted | protected
        ]
        doomed = doomed_anchors + doomed_snaps
        keep = [e for e in inv.complete_anchors() + inv.complete_snapshots() if e not in doomed and e.anchor not in gone]
        return RetentionPlan(delete=doomed, keep=keep)


def default_retention(keep: int = 3) -> Retention:
    return Retention(KeepNewestSnapshots(keep), KeepNewestSnapshotPerAnchor(1), PruneBootstrap())


def remove_tree(path: Path, stage: str) -> None:
    """Rename `path` to a trash name (unless it already is one), fsync the parent, then
    rmtree. `stage` ('retention' or 'cleanup') names the fault points passed."""
    if leftover_kind(path.name) != "trash":
        trash = trash_path_beside(path)
        if trash.exists():
            shutil.rmtree(trash)
        rename(path, trash)
        fsync_dir(path.parent)
        faults.point(f"{stage}.after_trash_rename")
        path = trash
    if stage == "retention":
        # Delete the big file first, so a kill here leaves a visibly partial directory.
        for db in path.rglob(SNAPSHOT_DB):
            db.unlink()
            break
        faults.point("retention.mid_rmtree")
    shutil.rmtree(path)
    faults.point(f"{stage}.after_rmtree")


def apply_retention(checkpoint_dir: str | Path, retention: Retention, inventory: Inventory | None = None) -> RetentionReport:
    """Delete what `retention` does not keep. Never raises for a failed delete."""
    inv = inventory or scan(checkpoint_dir)
    plan = retention.plan(inv)
    faults.point("retention.planned")
    report = RetentionReport()
    for entry in plan.delete:
        try:
            remove_tree(entry.path, "retention")
            report.deleted.append(entry.path)
        except OSError as e:
            msg = f"retention: could not delete {entry.path} ({e.strerror or e}); will retry at the next save"
            log.warning(msg)
            report.errors.append(msg)
    return report


def remove_leftovers(inventory: Inventory, *, busy: Set[Path] = frozenset()) -> RetentionReport:
    """Remove temporary and trash directories (other than `busy` ones, which this
    process is still writing). Failures are reported, never raised."""
    report = RetentionReport()
    # Shallowest first: a leftover snapshot inside a leftover anchor goes with the anchor.
    for entry in sorted(inventory.leftovers(), key=lambda e: len(e.path.parts)):
        if entry.path in busy or not os.path.lexists(entry.path):
            continue
        try:
            remove_tree(entry.path, "cleanup")
            report.deleted.append(entry.path)
        except OSError as e:
            msg = f"cleanup: could not remove leftover {entry.path} ({e.strerror or e}); will retry at the next save"
            log.warning(msg)
            report.errors.append(msg)
    return report
