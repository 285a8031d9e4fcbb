"""rolloutdb: the in-flight state of asynchronous LLM RL, kept in SQLite.

The public face, and the library surface for a team with its own controller (see
examples/own_loop.py): the live store and its transitions, the publisher of trainer
checkpoints and rollout snapshots, restore, and the exactly-once audit. Every name here
comes from the store's facade, `rolloutdb.store`, which holds the rest (migrations are in
`rolloutdb.migrations`, the built-in controller in `rolloutdb.controller`).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolloutdb.store import (
        BOOTSTRAP,
        LATEST,
        AnchorNotDurable,
        FinishedGeneration,
        IllegalTransition,
        LedgerAudit,
        NoRestorableSnapshot,
        NotAStoreError,
        Published,
        Publisher,
        PublishError,
        ReplayFullError,
        Report,
        Reservation,
        RestoredGroup,
        RestoreError,
        RestorePlan,
        SchemaTooNewError,
        SchemaTooOldError,
        Selection,
        Store,
        StoreError,
        anchor_name,
        audit_ledger,
        check_invariants,
        choose_snapshot,
        codec,
        drop_checkpoints_after,
        ledger,
        pools,
        queries,
        restore_snapshot,
        scan,
        select_and_restore,
        verify_path,
    )

__version__ = "0.1.0"

__all__ = [
    # the live store: transitions through Store (or `ledger` inside `Store.atomic()`),
    # reads through `queries`/`pools`/`codec` inside `Store.read()`
    "FinishedGeneration",
    "Reservation",
    "Store",
    "check_invariants",
    "codec",
    "ledger",
    "pools",
    "queries",
    # trainer checkpoints and rollout snapshots
    "BOOTSTRAP",
    "Published",
    "Publisher",
    "anchor_name",
    "scan",
    # restore and the audit
    "LATEST",
    "LedgerAudit",
    "Report",
    "RestorePlan",
    "RestoredGroup",
    "Selection",
    "audit_ledger",
    "choose_snapshot",
    "drop_checkpoints_after",
    "restore_snapshot",
    "select_and_restore",
    "verify_path",
    # errors
    "AnchorNotDurable",
    "IllegalTransition",
    "NoRestorableSnapshot",
    "NotAStoreError",
    "PublishError",
    "ReplayFullError",
    "RestoreError",
    "SchemaTooNewError",
    "SchemaTooOldError",
    "StoreError",
    "__version__",
]


def __getattr__(name: str) -> object:
    # The store (SQLAlchemy, Alembic, NumPy: ~0.8 s of imports) loads on first use of one
    # of its names, so that `import rolloutdb.cli` and `rolloutdb --help` stay light.
    if name in __all__ and name != "__version__":
        import rolloutdb.store

        value = getattr(rolloutdb.store, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rolloutdb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
