"""rolloutdb.store: the SQLite state store.

Knows nothing of the controller. The controller reaches it only through what is
exported here: the transition functions of `ledger` and `pools`, the named reads of
`queries`, and the fault registry `faults` (tests/test_public_api.py checks it).
"""

from . import faults
from .live import codec, ledger, pools, queries
from .live.capture import Capture, capture_snapshot
from .sqlite.database import Database
from .errors import (
    IllegalTransition,
    NotAStoreError,
    ReadOnlyViolation,
    ReplayFullError,
    SchemaTooNewError,
    SchemaTooOldError,
    StoreBusyError,
    StoreError,
)
from .live.invariants import InvariantReport, check_invariants
from .live.ledger import FinishedGeneration, Reservation
from .sqlite.revision import head_revision, known_revisions, upgrade_file
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
    publish_bootstrap,
    publish_rollout_snapshot,
    publish_trainer_checkpoint,
    publisher_for,
)
from .checkpoints.retention import (
    KeepNewestSnapshotPerAnchor,
    KeepNewestSnapshots,
    KeepNewestTrainerCheckpoints,
    PruneBootstrap,
    Retention,
    default_retention,
)
from .restore.selection import NoRestorableSnapshot, Selection, select_for_restore
from .restore.verification import Report, verify_path
from .restore.apply import (
    PayloadInventoryMismatch,
    RestoredGroup,
    RestoreError,
    RestorePlan,
    RunMismatch,
    SnapshotDamaged,
    SnapshotInconsistent,
    SnapshotTooNew,
    restore_snapshot,
)
from .restore.choice import (
    LATEST,
    LedgerAudit,
    NothingToRestore,
    TrainerCheckpointOnly,
    audit_ledger,
    choose_snapshot,
    live_run_id,
    live_store_work,
    select_and_restore,
)
from .restore.run_files import drop_checkpoints_after, move_run_aside, remove_store_files
from .fsio import refuse_special_file, replace_file, temp_path_beside
from .sqlite.identity import identify
from .sqlite.readonly import (
    DEFAULT_QUERY_TIMEOUT_S,
    QueryTimeout,
    listing_manifest,
    open_readonly,
    quick_check,
    run_readonly_query,
)
from .live.schema import ABANDON_REASONS, GROUP_STATES, ROLLOUT_STATES, STATE_TABLES
from .checkpoints.manifest import KIND_SNAPSHOT
from .trace.analysis import Table, TraceAnalysis
from .trace.writer import TraceError, open_tracer, trace_file_for

__all__ = [
    # restore (store/restore/)
    "NothingToRestore",
    "PayloadInventoryMismatch",
    "RestoredGroup",
    "RestoreError",
    "RestorePlan",
    "RunMismatch",
    "SnapshotDamaged",
    "SnapshotInconsistent",
    "SnapshotTooNew",
    "TrainerCheckpointOnly",
    "choose_snapshot",
    "restore_snapshot",
    "select_and_restore",
    "LATEST",
    "LedgerAudit",
    "audit_ledger",
    "live_run_id",
    "live_store_work",
    "drop_checkpoints_after",
    "move_run_aside",
    "remove_store_files",
    "refuse_special_file",
    "replace_file",
    "temp_path_beside",
    "identify",
    "DEFAULT_QUERY_TIMEOUT_S",
    "QueryTimeout",
    "listing_manifest",
    "open_readonly",
    "quick_check",
    "run_readonly_query",
    "ABANDON_REASONS",
    "GROUP_STATES",
    "ROLLOUT_STATES",
    "STATE_TABLES",
    "KIND_SNAPSHOT",
    "Table",
    "TraceAnalysis",
    "TraceError",
    "open_tracer",
    "trace_file_for",
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
    "publish_bootstrap",
    "publish_rollout_snapshot",
    "publish_trainer_checkpoint",
    "publisher_for",
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
    "faults",
    "head_revision",
    "known_revisions",
    "ledger",
    "pools",
    "queries",
    "upgrade_file",
]
