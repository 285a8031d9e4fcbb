"""Which rollout snapshot a restore starts from.

The newest complete snapshot whose anchor is a durable trainer checkpoint (one with a
`trainer_checkpoint` manifest; `bootstrap/` counts once published). With `verify`, a
candidate whose files fail their checksums or whose store file fails integrity_check is
passed over for the next older one, and the reason is kept.

No snapshot directory at all means a fresh run: `select_for_restore` returns None.
Snapshots that exist but none usable is never a fresh start: it raises
`NoRestorableSnapshot` naming each snapshot and why it was refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import StoreError
from .layout import SNAPSHOT_DB, Entry, scan
from .verification import verify_snapshot_dir

MAX_REASONS = 8


class NoRestorableSnapshot(StoreError):
    """Snapshots exist but none can be restored; the message lists why for each."""

    def __init__(self, message: str, reasons: list[str]):
        super().__init__(message)
        self.reasons = reasons


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


def select_for_restore(checkpoint_dir: str | Path, *, verify: bool = True) -> Selection | None:
    inv = scan(checkpoint_dir)
    anchors = {a.anchor: a for a in inv.anchors if not a.leftover}
    candidates = [s for s in inv.snapshots if not s.leftover]
    if not candidates:
        return None
    reasons: list[str] = []
    for snap in reversed(candidates):  # newest first
        if not snap.complete:
            reasons.append(f"{snap.path.name} ({snap.anchor}): {snap.status}: {snap.problem}")
            continue
        anchor = anchors.get(snap.anchor)
        if anchor is None or not anchor.complete:
            why = anchor.status if anchor else "missing"
            reasons.append(f"{snap.path.name}: its anchor {snap.anchor} is not a durable trainer checkpoint ({why})")
            continue
        if verify:
            report = verify_snapshot_dir(snap.path)
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
