"""rolloutdb.store: the SQLite state store.

Knows nothing of the controller. The controller reaches it only through what is
exported here and through the transition functions of `ledger` and `pools`.
"""

from . import codec, ledger, pools
from .capture import Capture, capture_snapshot
from .db import Database
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
from .invariants import InvariantReport, check_invariants
from .ledger import FinishedGeneration, Reservation
from .revision import head_revision, known_revisions, upgrade_file
from .store import Store

__all__ = [
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
]
