"""rolloutdb.store: the SQLite state store.

Knows nothing of the controller. The controller and the CLI reach it only through what is
exported here: the transition functions of `ledger` and `pools`, the named reads of
`queries`, the fault registry `faults`, and the names below, grouped by subsystem
(tests/test_public_api.py checks that nothing outside the store imports anything else;
tests/test_import_edges.py checks the edges between the subsystems).
"""

from . import faults
from .errors import (
    AnchorDamaged,
    IllegalTransition,
    NoRestorableSnapshot,
    NotAStoreError,
    NothingToRestore,
    PayloadInventoryMismatch,
    ReadOnlyViolation,
    RecordDamaged,
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
from .fsio import refuse_special_file, remove_sqlite_file, replace_file, temp_path_beside, write_file_atomic

# sqlite: engine, read-only opening, the integrity check, revisions and upgrades
from .sqlite.database import Database
from .sqlite.identity import identify
from .sqlite.integrity import quick_check
from .sqlite.readonly import (
    DEFAULT_QUERY_TIMEOUT_S,
    QueryTimeout,
    listing_manifest,
    open_readonly,
    run_readonly_query,
)
from .sqlite.revision import head_revision, known_revisions
from .sqlite.upgrade import upgrade_file

# live: the Store, its transitions, reads, invariants and capture
from .live import codec, ledger, pools, queries
from .live.capture import Capture, capture_snapshot
from .live.compaction import KEEP_STEPS, keep_steps_for
from .live.invariants import InvariantReport, check_invariants
from .live.ledger import FinishedGeneration, Reservation
from .live.pools import CallPrefix, Chunk, ChunkReference, EpisodeProgress, SavedEpisode
from .live.schema import ABANDON_REASONS, GROUP_STATES, ROLLOUT_STATES, STATE_TABLES
from .live.store import Store

# checkpoints: layout, manifests, publication, retention
from .checkpoints.layout import BOOTSTRAP, Entry, Inventory, anchor_name, scan
from .checkpoints.manifest import KIND_SNAPSHOT, Manifest, ManifestError, read_manifest
from .checkpoints.publish import (
    AnchorNotDurable,
    BackgroundWorkError,
    Published,
    PublishError,
    Publisher,
    SnapshotStage,
)
from .checkpoints.staged import TrainerStage, begin_trainer_checkpoint
from .checkpoints.segments import Sealed, seal_inline_payload, store_segment_problems, write_chunk_segment
from .checkpoints.layout import segments_dir_of
from .live.payload import SegmentRef, payload_counts, segment_summary
from .checkpoints.retention import (
    KeepNewestSnapshotPerAnchor,
    KeepNewestSnapshots,
    KeepNewestTrainerCheckpoints,
    PruneBootstrap,
    Retention,
    default_retention,
)

# restore: choosing, verifying and applying a snapshot; the ledger audit
from .restore.apply import restore_snapshot
from .restore.choice import (
    LATEST,
    LedgerAudit,
    audit_ledger,
    choose_snapshot,
    live_run_id,
    live_store_work,
    select_and_restore,
)
from .restore.plan import RestoredGroup, RestorePlan
from .restore.rewind import Rewound, rewind_live_store, rewind_problem
from .restore.run_files import drop_checkpoints_after, move_run_aside
from .restore.selection import Selection, anchor_problem, select_for_restore
from .restore.verification import Report, verify_path

# trace: the writer and the analysis
from .trace.analysis import Table, TraceAnalysis
from .trace.attached import AttachedFiles
from .trace.summary import trace_summary
from .trace.writer import NullTracer, Tracer, TraceError, open_tracer, trace_file_for

__all__ = [
    # foundation
    "faults",
    "AnchorDamaged",
    "IllegalTransition",
    "NoRestorableSnapshot",
    "NotAStoreError",
    "NothingToRestore",
    "PayloadInventoryMismatch",
    "ReadOnlyViolation",
    "RecordDamaged",
    "ReplayFullError",
    "RestoreError",
    "RunMismatch",
    "SchemaTooNewError",
    "SchemaTooOldError",
    "SnapshotDamaged",
    "SnapshotInconsistent",
    "SnapshotTooNew",
    "StoreBusyError",
    "StoreError",
    "TrainerCheckpointOnly",
    "refuse_special_file",
    "remove_sqlite_file",
    "replace_file",
    "temp_path_beside",
    "write_file_atomic",
    # sqlite
    "Database",
    "DEFAULT_QUERY_TIMEOUT_S",
    "QueryTimeout",
    "head_revision",
    "identify",
    "known_revisions",
    "listing_manifest",
    "open_readonly",
    "quick_check",
    "run_readonly_query",
    "upgrade_file",
    # live
    "ABANDON_REASONS",
    "GROUP_STATES",
    "ROLLOUT_STATES",
    "STATE_TABLES",
    "payload_counts",
    "Capture",
    "CallPrefix",
    "ChunkReference",
    "Chunk",
    "EpisodeProgress",
    "FinishedGeneration",
    "InvariantReport",
    "Reservation",
    "SavedEpisode",
    "Store",
    "capture_snapshot",
    "check_invariants",
    "codec",
    "ledger",
    "KEEP_STEPS",
    "keep_steps_for",
    "pools",
    "queries",
    # checkpoints
    "AnchorNotDurable",
    "BackgroundWorkError",
    "BOOTSTRAP",
    "Entry",
    "Inventory",
    "KIND_SNAPSHOT",
    "KeepNewestSnapshotPerAnchor",
    "KeepNewestSnapshots",
    "KeepNewestTrainerCheckpoints",
    "Manifest",
    "ManifestError",
    "PruneBootstrap",
    "Published",
    "PublishError",
    "Publisher",
    "Retention",
    "SnapshotStage",
    "Sealed",
    "SegmentRef",
    "TrainerStage",
    "begin_trainer_checkpoint",
    "anchor_name",
    "default_retention",
    "read_manifest",
    "scan",
    "seal_inline_payload",
    "write_chunk_segment",
    "segment_summary",
    "segments_dir_of",
    "store_segment_problems",
    # restore
    "LATEST",
    "LedgerAudit",
    "Report",
    "RestoredGroup",
    "RestorePlan",
    "Rewound",
    "Selection",
    "anchor_problem",
    "audit_ledger",
    "choose_snapshot",
    "drop_checkpoints_after",
    "live_run_id",
    "live_store_work",
    "move_run_aside",
    "restore_snapshot",
    "rewind_live_store",
    "rewind_problem",
    "select_and_restore",
    "select_for_restore",
    "verify_path",
    # trace
    "AttachedFiles",
    "NullTracer",
    "Table",
    "TraceAnalysis",
    "TraceError",
    "Tracer",
    "open_tracer",
    "trace_file_for",
    "trace_summary",
]
