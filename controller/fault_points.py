"""The controller's kill points, registered with the store's fault registry
(`rolloutdb.store.faults`) when the controller is imported: between the pumps'
transactions and around restore. The crash harness kills the main job at each of them
(``ROLLOUTDB_FAULT=<point>[@n]``)."""

from __future__ import annotations

from rolloutdb.store import faults

POINTS: tuple[str, ...] = faults.register(
    "pump.after_dispatch",
    "pump.after_finish",
    "pump.after_enter_replay",
    "pump.after_turn_commit",
    "pump.call_finished_uncommitted",
    "train.after_commit",
    "train.after_checkpoint",
    "snapshot.after_cut",
    "resume.after_restore",
)
