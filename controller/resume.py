"""Resuming a run: pick the snapshot, load the trainer from its anchor, restore the live
store from it, and hand the rollout pump the groups to redo first.

Order (the architecture's): the weights first (the anchor's trainer checkpoint, pushed
to the engine), then the store (`rolloutdb.store.restore`: schema, integrity, run
settings, replay, ledger with restart normalization, spare pool, cursor check).

With no rollout snapshot at all the run had not saved anything it could lose, so it
starts over in the same directory (the prompts it had dispatched were never trained, so
handing them out again keeps every prompt trained exactly once). Trainer checkpoints
without any snapshot cannot be resumed consistently and are refused.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rolloutdb.controller.dispatch import GroupHandle
from rolloutdb.controller.tracing import RolloutTrace
from rolloutdb.store import Store, faults
from rolloutdb.store.layout import BOOTSTRAP, scan
from rolloutdb.store.manifest import KIND_TRAINER
from rolloutdb.store.retention import remove_tree
from rolloutdb.store.resume import NothingToRestore, TrainerCheckpointOnly, select_and_restore


class ResumeError(ValueError):
    """Nothing in the run directory can be resumed; the message says what to do."""


def restore_run(ctl) -> tuple[Store, list[tuple[GroupHandle, list[int]]]]:
    """Restore `ctl` (a Controller whose parts are built, with no store open) and return
    the live store and the restored groups, in sampler order, with the generations each
    must redo (none for a group that only waits for its finalizer)."""
    cfg, dirs = ctl.config, ctl.dirs
    t0 = time.time()

    def load_weights(selection) -> None:
        ctl.trainer.load_checkpoint(selection.anchor.path)
        ctl.engine.load_weights(ctl.trainer.export_weights(), ctl.trainer.step)

    try:
        plan = select_and_restore(
            dirs.checkpoints,
            dirs.store,
            resume=ctl.resume,
            before_restore=load_weights,
            config_fingerprint=cfg.fingerprint(),
            dataset_fingerprint=ctl.dataset.fingerprint(),
            forest_training={},
            groups_per_step=cfg.algorithm.groups_per_step,
            ledger_dispatch=cfg.ledger_dispatch,
        )
    except NothingToRestore:
        return _start_over(ctl)
    except TrainerCheckpointOnly as e:
        if e.anchor.anchor == BOOTSTRAP:
            return _start_over(ctl)  # killed before the first snapshot: nothing was trained
        raise ResumeError(f"{e}; rollout_checkpointing must be on for a run to be resumable") from None
    faults.point("resume.after_restore")
    dropped = _drop_abandoned_future(dirs.checkpoints, ctl.trainer.step)
    store = Store.open(dirs.store)
    restored = [
        (GroupHandle(g.group_id, g.reservation, g.target_step, g.num_generations, attempts={}), list(g.generations_to_run))
        for g in sorted(plan.redispatch + plan.to_finalize, key=lambda g: g.sample_seq)
    ]
    ctl.metrics.write(
        {
            "kind": "restore",
            "t": time.time(),
            "snapshot": str(plan.snapshot_dir),
            "anchor": plan.anchor,
            "snapshot_seq": plan.sequence,
            "cut_time": plan.cut_time,
            "step": ctl.trainer.step,
            "groups_restored": len(restored),
            "passed_over": plan.passed_over,
            "dropped_anchors": dropped,
            "counts": plan.counts,
            "restore_s": time.time() - t0,
        }
    )
    RolloutTrace(ctl.tracer).abandoned(_abandoned_at_restore(store, t0), "restart")
    ctl.tracer.emit(
        "restore_done",
        step=ctl.trainer.step,
        cut_time=plan.cut_time,
        snapshot_seq=plan.sequence,
        anchor=plan.anchor,
        snapshot=str(plan.snapshot_dir),
        groups_restored=len(restored),
        replay_restored=plan.counts.get("replay_groups", 0),
    )
    print(
        f"rolloutdb: resumed from {plan.anchor}/snapshot_{plan.sequence} at step {ctl.trainer.step}: "
        f"{len(restored)} groups to redo first",
        file=sys.stderr,
    )
    return store, restored


def _abandoned_at_restore(store: Store, since: float) -> list[tuple]:
    """The attempts this restore's normalization abandoned (reason `restart`)."""
    with store.atomic(mutation=False) as tx:
        return tx.exec_driver_sql(
            "SELECT r.group_id, g.prompt_id, r.generation_index, r.attempt, g.target_step "
            "FROM rollouts r JOIN prompt_groups g ON g.group_id = r.group_id "
            "WHERE r.state = 'abandoned' AND r.abandon_reason = 'restart' AND r.ended_at >= ?",
            (since,),
        ).all()


def _drop_abandoned_future(checkpoint_dir: Path, step: int) -> list[str]:
    """Trainer checkpoints newer than the restored anchor belong to the branch the stop
    cut off: the rollout state that went with them is gone, and the resumed run will
    publish those steps again. Remove them (trash rename, then delete) before it does."""
    dropped = []
    for entry in scan(checkpoint_dir).entries:
        if entry.kind == KIND_TRAINER and entry.step is not None and entry.step > step:
            remove_tree(entry.path, "cleanup")
            dropped.append(entry.anchor)
    return dropped


def _start_over(ctl) -> tuple[Store, list]:
    """No snapshot yet and no step trained: the run restarts in the same directory."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{ctl.dirs.store}{suffix}").unlink(missing_ok=True)
    print("rolloutdb: no rollout snapshot yet; starting the run over", file=sys.stderr)
    ctl.metrics.write({"kind": "restore", "t": time.time(), "snapshot": None, "step": 0})
    return ctl.create_store(), []
