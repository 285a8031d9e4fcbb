"""rolloutdb: the in-flight state of asynchronous LLM RL, kept in SQLite.

The public face. The store lives in `rolloutdb.store`, migrations in
`rolloutdb.migrations`, the controller in `rolloutdb.controller`, generation engines and
prefix capture in `rolloutdb.gpu_capture`.
"""

from rolloutdb.store import (
    FinishedGeneration,
    IllegalTransition,
    NotAStoreError,
    ReplayFullError,
    Reservation,
    SchemaTooNewError,
    SchemaTooOldError,
    Store,
    StoreError,
)

__version__ = "0.1.0"

__all__ = [
    "FinishedGeneration",
    "IllegalTransition",
    "NotAStoreError",
    "ReplayFullError",
    "Reservation",
    "SchemaTooNewError",
    "SchemaTooOldError",
    "Store",
    "StoreError",
    "__version__",
]
