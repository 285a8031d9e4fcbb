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
    # a StagedTrainer's step computed (after the backward), not committed
    "train.prepared",
    "train.after_commit",
    "train.after_checkpoint",
    # a train step's metrics line written (its trace event committed before it)
    "train.after_step_logged",
    # checkpointing.async: the state copied and the cut held (train pump); the files
    # written (background thread); the write ended, not yet renamed; renamed, its
    # held snapshot not yet published (train pump, a later step boundary).
    "train.after_checkpoint_copy",
    "checkpoint.files_written",
    "train.before_checkpoint_publish",
    "train.after_checkpoint_publish",
    "snapshot.after_cut",
    "resume.after_restore",
    # environment servers in export_restore mode: the snapshot's environment phase
    "env.after_prepare",
    "env.after_commit",
    "env.after_drain",
    "env.after_export",
)

# Reached only with checkpointing.async: true (the crash tests give those chains it).
ASYNC_POINTS: tuple[str, ...] = (
    "train.after_checkpoint_copy",
    "checkpoint.files_written",
    "train.before_checkpoint_publish",
    "train.after_checkpoint_publish",
)

# Reached only with an environment server in export_restore mode (the agent-server
# crash tests, tests/test_agent_server_faults.py, kill at each).
ENV_POINTS: tuple[str, ...] = ("env.after_prepare", "env.after_commit", "env.after_drain", "env.after_export")
