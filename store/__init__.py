"""rolloutdb.store: the SQLite state store.

Knows nothing of the controller. The controller reaches it only through what is
exported here and through the transition functions of `ledger` and `pools`.
"""

from .live import codec, ledger, pools
from .live.capture import Capture, capture_snapshot
from .sqlite.database import Database
from .errors import (
    IllegalTransition,
    NotAStoreError,
    NothingToRestore,
    NoRestorableSnapshot,
    PayloadInventoryMismatch,
    ReadOnlyViolation,
    ReplayFullError,
    RestoreError,
    RunMismatch,
    SchemaTooNewError,
    SchemaTooOldError,
    SnapshotDamaged,
    SnapshotInconsistent,
    SnapshotTooNew,
    StoreBusyError,
    StoreError,
    TrainerCheckpointOnly,
)
from .live.invariants import InvariantReport, check_invariants
from .live.ledger import FinishedGeneration, Reservation
from .sqlite.revision import head_revision, known_revisions
from .sqlite.upgrade import upgrade_file
from .live.store import Store
from .checkpoints.layout import BOOTSTRAP, Entry, Inventory, anchor_name, scan
from .checkpoints.manifest import Manifest, ManifestError, read_manifest
from .checkpoints.publish import (
    AnchorNotDurable,
    BackgroundWorkError,
    Published,
    PublishError,
    Publisher,
    SnapshotStage,
)
from .checkpoints.retention import (
    KeepNewestSnapshotPerAnchor,
    KeepNewestSnapshots,
    KeepNewestTrainerCheckpoints,
    PruneBootstrap,
    Retention,
    default_retention,
)
from .restore.selection import Selection, select_for_restore
from .restore.verification import Report, verify_path
from .restore.plan import RestoredGroup, RestorePlan
from .restore.apply import (
    restore_snapshot,
)
from .trace.writer import NullTracer, Tracer, open_tracer
from .restore.choice import (
    RunVerdict,
    choose_snapshot,
    select_and_restore,
    verify_run,
)

__all__ = [
    # restore (store/restore/, its errors in store/errors.py)
    "NothingToRestore",
    "PayloadInventoryMismatch",
    "RestoredGroup",
    "RestoreError",
    "RestorePlan",
    "RunMismatch",
    "RunVerdict",
    "SnapshotDamaged",
    "SnapshotInconsistent",
    "SnapshotTooNew",
    "TrainerCheckpointOnly",
    "choose_snapshot",
    "restore_snapshot",
    "select_and_restore",
    "verify_run",
    "AnchorNotDurable",
    "BackgroundWorkError",
    "BOOTSTRAP",
    "Entry",
    "Inventory",
    "KeepNewestSnapshotPerAnchor",
    "KeepNewestSnapshots",
    "KeepNewestTrainerCheckpoints",
    "Manifest",
    "ManifestError",
    "NoRestorableSnapshot",
    "PruneBootstrap",
    "Published",
    "PublishError",
    "Publisher",
    "Report",
    "Retention",
    "Selection",
    "SnapshotStage",
    "anchor_name",
    "default_retention",
    "read_manifest",
    "scan",
    "select_for_restore",
    "verify_path",
    "Capture",
    "Database",
    "FinishedGeneration",
    "IllegalTransition",
    "InvariantReport",
    "NotAStoreError",
    "ReadOnlyViolation",
    "ReplayFullError",
    "Reservation",
    "SchemaTooNewError",
    "SchemaTooOldError",
    "Store",
    "StoreBusyError",
    "StoreError",
    "capture_snapshot",
    "check_invariants",
    "codec",
    "head_revision",
    "known_revisions",
    "ledger",
    "pools",
    "upgrade_file",
    "NullTracer",
    "Tracer",
    "open_tracer",
]
