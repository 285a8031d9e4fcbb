"""Typed errors of the store. Every message names the problem and what to do."""

from __future__ import annotations


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
