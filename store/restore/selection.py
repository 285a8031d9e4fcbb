"""Which rollout snapshot a restore starts from.

The newest complete snapshot whose anchor is a durable trainer checkpoint (one with a
`trainer_checkpoint` manifest; `bootstrap/` counts once published). With `verify`, a
candidate whose files fail their checksums or whose store file fails integrity_check is
passed over for the next older one, and so is one whose anchor's files fail their
checksums (`verify_anchors`, on by default with `verify`: the trainer loads those files,
so they are checked before it does). With `run_id`, a snapshot of another run is passed
over too. Every candidate passed over is kept with the reason.

No snapshot directory at all means a fresh run: `select_for_restore` returns None.
Snapshots that exist but none usable is never a fresh start: it raises
`NoRestorableSnapshot` naming each snapshot and why it was refused.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import NoRestorableSnapshot, StoreError
from ..checkpoints.layout import SNAPSHOT_DB, Entry, scan
from .verification import open_for_checks, verify_snapshot_dir, verify_trainer_dir

MAX_REASONS = 8


@dataclass
class Selection:
    snapshot: Entry
    anchor: Entry
    passed_over: list[str] = field(default_factory=list)

    @property
    def db_path(self) -> Path:
        return self.snapshot.path / SNAPSHOT_DB

    @property
    def step(self) -> int | None:
        return self.anchor.step


def anchor_problem(anchor: Entry) -> str | None:
    """Why the trainer must not load this anchor's files (checksums, missing or unlisted
    files), or None when they match its manifest."""
    report = verify_trainer_dir(anchor.path, with_snapshots=False, manifest=anchor.manifest)  # the listing's
    return None if report.ok else report.problems[0]


def snapshot_run_id(snapshot_dir: Path) -> str:
    """The run id in a snapshot's store file (read-only). Raises StoreError when it
    cannot be read."""
    try:
        with contextlib.closing(open_for_checks(Path(snapshot_dir) / SNAPSHOT_DB)) as conn:
            row = conn.execute("SELECT run_id FROM run_meta").fetchone()
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{snapshot_dir / SNAPSHOT_DB}: cannot read its run id ({e})") from None
    if row is None:
        raise StoreError(f"{snapshot_dir / SNAPSHOT_DB}: no run_meta row")
    return row[0]


def run_id_problem(snapshot_dir: Path, run_id: str | None) -> str | None:
    """Why the snapshot is not this run's (`run_id`), or None (also when run_id is None)."""
    if run_id is None:
        return None
    try:
        theirs = snapshot_run_id(snapshot_dir)
    except StoreError as e:
        return str(e)
    if theirs != run_id:
        return f"it belongs to another run (run id {theirs}; this run is {run_id})"
    return None


def select_for_restore(checkpoint_dir: str | Path, *, verify: bool = True, verify_anchors: bool | None = None,
                       run_id: str | None = None, exclude: Collection[Path] = ()) -> Selection | None:
    """See the module docstring. `exclude`: snapshot directories already tried and
    refused by the caller (left out silently; the caller has their reasons)."""
    inv = scan(checkpoint_dir)
    check_anchors = verify if verify_anchors is None else verify_anchors
    anchors = {a.anchor: a for a in inv.anchors if not a.leftover}
    candidates = [s for s in inv.snapshots if not s.leftover]
    if not candidates:
        return None
    excluded = {Path(p) for p in exclude}
    anchor_checked: dict[str, str | None] = {}
    reasons: list[str] = []
    for snap in reversed(candidates):  # newest first
        if snap.path in excluded:
            continue
        if not snap.complete:
            reasons.append(f"{snap.path.name} ({snap.anchor}): {snap.status}: {snap.problem}")
            continue
        anchor = anchors.get(snap.anchor)
        if anchor is None or not anchor.complete:
            why = anchor.status if anchor else "missing"
            reasons.append(f"{snap.path.name}: its anchor {snap.anchor} is not a durable trainer checkpoint ({why})")
            continue
        if check_anchors:
            if anchor.anchor not in anchor_checked:  # hash each anchor once
                anchor_checked[anchor.anchor] = anchor_problem(anchor)
            if anchor_checked[anchor.anchor]:
                reasons.append(f"{snap.path.name}: its anchor {snap.anchor} fails verification: "
                               f"{anchor_checked[anchor.anchor]}")
                continue
        problem = run_id_problem(snap.path, run_id)
        if problem:
            reasons.append(f"{snap.path.name} ({snap.anchor}): {problem}")
            continue
        if verify:
            report = verify_snapshot_dir(snap.path, snap.manifest)  # the listing read it
            if not report.ok:
                reasons.append(f"{snap.path.name} ({snap.anchor}): fails verification: {report.problems[0]}")
                continue
        return Selection(snap, anchor, reasons)
    shown = reasons[:MAX_REASONS] + ([f"... and {len(reasons) - MAX_REASONS} more"] if len(reasons) > MAX_REASONS else [])
    raise NoRestorableSnapshot(
        f"{checkpoint_dir}: {len(candidates)} rollout snapshot(s) exist but none can be restored: "
        + "; ".join(shown)
        + ". Refusing to start fresh; fix or move the checkpoint directory, or run `rolloutdb verify` on it",
        reasons,
    )
