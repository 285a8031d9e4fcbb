"""Resuming from a trainer checkpoint alone: the live store rolled back to its step.

A run with no rollout snapshot to restore (`rollout_checkpointing.enabled: false`, or a
stop before the first snapshot of a run that had none) still has two durable things:
its trainer checkpoints (fsynced when published) and its live store (every commit
survives a killed process: WAL). The store holds everything the run did after the
newest checkpoint, step N: the steps trained after N, the groups in flight and in
replay. The trainer loads step_N; `rewind_live_store` makes the store say what a run at
step N would say, every sampler position still accounted for exactly once:

- positions trained at a step after N are settled no more: their `settled_steps` rows
  go (the discards those rows carried are written back: a discard stays final), their
  prompts' bits in `settled_prompts` are cleared, and they join the spare pool, which
  hands them out again before any new position (lowest first);
- every live ledger row (reserved, dispatched, sealed, in replay) goes, with its
  attempts and payload, and its position joins the spare pool: its tokens were decoded
  under weights the resumed trainer no longer has (versions after N are trained again,
  and would be other weights), so its samples are generated again;
- the shortfall of every step after N goes: the rollout pump stamps those steps again
  from N, as a fresh run stamps its first ones.

Discards are kept whenever they happened: a group whose rewards had no variance settled
its prompt, and the record cannot say at which step a discard happened (it is coded
into a neighbouring row, live/compaction.py). The sampler cursor stays where it is.

One transaction on the live store itself (no copy: the rewind is small, and a failure or
a kill rolls it back), with the run settings checked as a restore checks a snapshot's
and the invariants checked before and after: a failing check refuses with nothing
changed. Refused too, before anything is loaded (`rewind_problem`): a store without
the ledger (it does not record which positions were trained when), and a store that
records training only up to a step below N: it lost commits the checkpoint did not
(a power loss under synchronous=NORMAL), so which prompts step N trained is unknown.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import NotAStoreError, RecordDamaged, RestoreError, SnapshotInconsistent
from ..live import ledger, pools
from ..live.compaction import read_prefix, unmark_settled, unsettle_trained_after
from ..live.invariants import check_invariants
from ..live.ledger import Reservation
from ..live.store import Store
from ..sqlite.prepared import _driver
from ..sqlite.upgrade import refuse_if_open
from .plan import check_run_meta, stamp_config_fingerprint
from .verification import open_for_checks


@dataclass
class Rewound:
    """What `rewind_live_store` did."""

    step: int  # the trainer checkpoint's step the store now matches
    trained_after: int  # positions trained after `step`, handed out again
    # the live ledger groups (in flight or in replay) handed out again, as (group_id,
    # prompt_id, target_step, policy_version) for the trace: each leaves the ledger
    # untrained (a `group_discarded`, reason `rewind`)
    withdrawn_groups: list[tuple]
    abandoned: list[tuple]  # their running attempts, for the trace (ledger.withdraw_every_group)
    shortfall_dropped: int  # stamped steps after `step` whose shortfall went
    config_fingerprint_was: str | None = None  # the earlier formula's, when the store carried it

    @property
    def withdrawn(self) -> int:
        return len(self.withdrawn_groups)


def rewind_problem(live_store_path: str | Path, step: int, *, ledger_dispatch: bool | None = None,
                   config_fingerprints: tuple[str, ...] = ()) -> str | None:
    """Why the live store cannot be rewound to `step` (one phrase), or None. Read-only.
    `ledger_dispatch` and `config_fingerprints` (the config's, under the current and the
    earlier formula), when given, are checked against the store's run_meta too, so a
    resume with other settings is refused before anything is loaded (the rewind checks
    every setting again in its transaction)."""
    try:
        with contextlib.closing(open_for_checks(live_store_path)) as conn:
            meta = conn.execute("SELECT ledger_dispatch, config_fingerprint FROM run_meta").fetchone()
            top = conn.execute("SELECT max(trained_step) FROM settled_steps").fetchone()[0]
            folded = read_prefix(conn).through_step
    except (NotAStoreError, sqlite3.DatabaseError, RecordDamaged) as e:
        return f"the live store cannot be read ({e})"
    if meta is None:
        return "the live store has no run_meta row"
    mode, fingerprint = bool(meta[0]), meta[1]
    if not mode:
        return ("the run records no ledger (rollout_recovery.target_level none), so which prompts were trained after "
                f"step {step} is not known and they cannot be handed out again")
    if ledger_dispatch is not None and not ledger_dispatch:
        return ("the run records a ledger and this config runs without one (target_level none): a store without the "
                "ledger does not record which prompts were in flight, so switching would lose or repeat them; resume "
                "with rollout_recovery.target_level group, turn or prefix")
    if config_fingerprints and fingerprint not in config_fingerprints:
        return (f"the live store carries config fingerprint {fingerprint}, this config's is {config_fingerprints[0]}; "
                "resume with the config the run was started with (RUN_DIR/config.yaml)")
    if folded is not None and folded > step:
        return (f"the live store keeps which prompts each step trained only after step {folded} (older steps are "
                f"folded into counts, settled_prefix), so it cannot be rolled back to step {step}; keep trainer "
                "checkpoints closer together (checkpointing.interval_steps x keep_last) or restore a rollout snapshot")
    if step > 0 and max(top or 0, folded or 0) < step:
        return (f"the live store records training only up to step {top or 0}, below the trainer checkpoint's step "
                f"{step}: it lost its last commits (a power loss?), so which prompts step {step} trained is not known")
    return None


def rewind_live_store(live_store_path: str | Path, *, step: int, position: Callable[[int], Reservation],
                      config_fingerprint: str, dataset_fingerprint: str, forest_training: dict,
                      ledger_dispatch: bool, earlier_config_fingerprint: str | None = None) -> Rewound:
    """Rewind the live store to trainer step `step` (see the module docstring).
    `position(seq)`: the prompt the sampler hands out at position `seq` (the
    controller's PromptOrder: the store records positions, not which prompt each held,
    once they settled). No other process may have the store open. Raises a
    RestoreError subclass, with the store unchanged, on any refusal."""
    path = Path(live_store_path)
    problem = rewind_problem(path, step)
    if problem:
        raise RestoreError(f"{path}: cannot resume from the trainer checkpoint of step {step} alone: {problem}; "
                           "nothing was changed: pass --start-over to move this run aside and train from step 0")
    refuse_if_open(path, doing="resume")
    store = Store.open(path)
    try:
        with store.atomic() as tx:
            raw = _driver(tx)
            check_run_meta(raw, path, config_fingerprint=config_fingerprint, dataset_fingerprint=dataset_fingerprint,
                           forest_training=forest_training, ledger_dispatch=ledger_dispatch, run_id=None,
                           earlier_config_fingerprint=earlier_config_fingerprint)
            was = stamp_config_fingerprint(raw, config_fingerprint, earlier_config_fingerprint)
            _refuse_on_invariants(raw, path, "before the rewind")
            trained = [position(seq) for seq in unsettle_trained_after(raw, step)]
            unmark_settled(raw, [(r.epoch, r.prompt_id) for r in trained])
            held, withdrawn, running = ledger.withdraw_every_group(tx)
            pools.push_spare(tx, sorted(trained + held, key=lambda r: r.sample_seq))
            dropped = raw.execute("DELETE FROM step_shortfall WHERE step > ?", (step,)).rowcount
            _refuse_on_invariants(raw, path, "after the rewind")
    except RecordDamaged as e:
        raise SnapshotInconsistent(f"{path}: {e}; nothing was changed: pass --start-over to train the run again", 1) \
            from None
    finally:
        store.close()
    return Rewound(step, len(trained), withdrawn, running, dropped, was)


def _refuse_on_invariants(raw: sqlite3.Connection, path: Path, when: str) -> None:
    report = check_invariants(raw)
    if not report.ok:
        raise SnapshotInconsistent(f"{path}: {when}: {report.problems[0]}; nothing was changed (`rolloutdb verify` "
                                   "shows every problem): pass --start-over to train the run again", report.invariants[0])
