"""Typed errors of the store. Every message names the problem and what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class NotAStoreError(StoreError):
    """The path is missing, a directory, not SQLite, damaged, or not a rolloutdb store."""


class SchemaTooNewError(StoreError):
    """The file was written by a newer rolloutdb than the code reading it."""


class SchemaTooOldError(StoreError):
    """The file is at an older schema revision; `rolloutdb upgrade PATH` migrates it."""


class StoreBusyError(StoreError):
    """Another writer held the database past busy_timeout."""


class IllegalTransition(StoreError):
    """A group or attempt was asked to move from a state that does not allow it."""


class ReplayFullError(StoreError):
    """Every replay-capacity permit is taken; train or discard a group first."""


class ReadOnlyViolation(StoreError):
    """A statement given to a read-only tool would change the file."""


class RecordDamaged(StoreError):
    """A row the store decodes itself (the settled record: `settled_steps`,
    `discard_reasons`, `settled_prompts`) holds a value of the wrong type or size: the
    file is damaged or forged. The message names the table and the row; a caller that
    knows the file prefixes its path."""


# --------------------------------------------------------------------------- restore


class RestoreError(StoreError):
    """A snapshot cannot be restored. The live store and the snapshot are unchanged."""


class SnapshotDamaged(RestoreError):
    """A file of the snapshot is missing, changed, or fails integrity_check; `path` names it."""

    def __init__(self, message: str, path: Path | None = None):
        super().__init__(message)
        self.path = path


class SnapshotTooNew(RestoreError, SchemaTooNewError):
    """The snapshot was written by a newer rolloutdb than this one."""


class RunMismatch(RestoreError):
    """The snapshot belongs to a run with other settings; `fields` names what differs."""

    def __init__(self, message: str, fields: list[str]):
        super().__init__(message)
        self.fields = fields


class SnapshotInconsistent(RestoreError):
    """The snapshot's rows break an invariant; `invariant` is its number (0: other)."""

    def __init__(self, message: str, invariant: int = 0):
        super().__init__(message)
        self.invariant = invariant


class PayloadInventoryMismatch(SnapshotInconsistent):
    """Payload rows (samples, chunks, episodes) no live ledger row
    references, found *before* normalization: refused rather than silently cleared."""

    def __init__(self, message: str):
        super().__init__(message, 3)


class NothingToRestore(RestoreError):
    """A resume was asked for but the checkpoint directory holds no checkpoint at all."""


class TrainerCheckpointOnly(RestoreError):
    """No rollout snapshot, but a durable trainer checkpoint: the caller may restore the
    trainer from it and start the store fresh at its step (in-flight work is lost).
    `anchor` is its `checkpoints.layout.Entry`."""

    def __init__(self, message: str, anchor: Any):
        super().__init__(message)
        self.anchor = anchor
        self.step = anchor.step or 0
        self.path = anchor.path


class AnchorDamaged(SnapshotDamaged):
    """The snapshot's anchor (the trainer checkpoint its weights come from) has files
    that do not match its manifest; they were not loaded."""


class NoRestorableSnapshot(StoreError):
    """Snapshots exist but none can be restored; the message lists why for each."""

    def __init__(self, message: str, reasons: list[str]):
        super().__init__(message)
        self.reasons = reasons
