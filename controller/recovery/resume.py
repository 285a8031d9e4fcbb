"""Resuming a run: decide what the resume does before anything is written, then load the
trainer from the anchor, restore the live store, and hand the rollout pump the groups to
redo first.

1. `plan_resume` (read-only; no torch, so `rolloutdb train` calls it under the run lock
   before building anything): the (snapshot, anchor) pair to restore, whose anchor's
   files match its manifest and whose store is this run's (the live store's run id);
   or a start over; or a refusal that says what to do.
2. `restore_run`, from the parts the controller built (`ResumeParts`, passed explicitly):
   the weights first (the anchor's trainer checkpoint, pushed to the engine), then the
   store (`rolloutdb.store.restore`: schema, integrity, run settings, replay, ledger with
   restart normalization, spare pool, cursor check). With `latest`, a pair that fails
   (its store, or an anchor the trainer cannot load) is passed over for the next sound
   one. The live store is the first thing written; a refusal before it leaves the run
   directory as it was.
3. `announce`, once the logs are open: every snapshot or anchor passed over and why,
   the anchors of the cut-off branch removed, on stderr and in the metrics.

With no rollout snapshot at all (`rollout_checkpointing` off, or a stop before a run's
first snapshot) the newest durable trainer checkpoint is a restore point by itself: the
trainer loads it and the live store is rolled back to its step (REWIND,
`rolloutdb.store.rewind_live_store`): what was trained after it and everything in flight
is handed out again, every prompt still trained once. Refused, with the reason, where the
store cannot prove that (no ledger; a store that lost the checkpoint's commits).

Starting over is never silent unless it provably loses nothing: with no snapshot to
restore, a live store that holds no work (no prompt ever handed out, no step trained)
starts over in place. Otherwise the resume restores, rewinds or is refused, and
`--start-over` moves the run's store, checkpoints, config and logs aside (into
RUN_DIR/discarded/<time>/, nothing is deleted) and trains from step 0.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rolloutdb.config import Config
from rolloutdb.controller.protocols import PromptDataset, Trainer
from rolloutdb.controller.recovery.earlier_fingerprint import earlier_config_fingerprint
from rolloutdb.controller.run.dispatch import GroupHandle
from rolloutdb.controller.run.metrics_backends import RunMetrics
from rolloutdb.controller.run.run_dir import RunDir
from rolloutdb.controller.run.sampler import PromptOrder
from rolloutdb.controller.run.tracing import RolloutTrace
from rolloutdb.gpu_capture.protocol import GenerationEngine
from rolloutdb.store import (
    AnchorDamaged,
    Entry,
    LATEST,
    NoRestorableSnapshot,
    NothingToRestore,
    NullTracer,
    RestorePlan,
    Rewound,
    Selection,
    Store,
    TrainerCheckpointOnly,
    Tracer,
    anchor_problem,
    choose_snapshot,
    drop_checkpoints_after,
    faults,
    live_run_id,
    live_store_work,
    move_run_aside,
    remove_sqlite_file,
    rewind_live_store,
    rewind_problem,
    select_and_restore,
)

RESTORE, START_OVER, START_OVER_EMPTY = "restore", "start_over", "start_over_empty"
REWIND = "rewind"  # no rollout snapshot: the live store rolled back to the newest trainer checkpoint
MAX_DETAIL = 300  # characters of a loading error quoted in its one line


class ResumeError(ValueError):
    """Nothing in the run directory can be resumed; the message says what to do."""


@dataclass
class ResumePlan:
    action: str  # RESTORE, REWIND, START_OVER (asked for) or START_OVER_EMPTY (nothing to lose)
    selection: Selection | None = None
    run_id: str | None = None  # the live store's; a restore refuses snapshots of other runs
    why: str = ""
    anchor: Entry | None = None  # REWIND: the trainer checkpoint the run resumes from alone


@dataclass
class ResumeParts:
    """What a resume reads from the run: built by the controller once its parts are built
    and before any store is open (controller/job/controller.py)."""

    config: Config
    dirs: RunDir
    resume: str  # "latest" or a snapshot directory (--resume)
    plan: ResumePlan  # plan_resume's decision, carried out by restore_run
    trainer: Trainer  # loaded from the anchor, then its weights pushed to the engine
    engine: GenerationEngine
    dataset: PromptDataset  # its fingerprint must be the snapshot's


@dataclass
class Restored:
    """What `restore_run` did, for the controller and `announce`."""

    plan: ResumePlan
    store: Store | None = None  # None: the run starts over (the controller creates the store)
    groups: list[tuple[GroupHandle, list[int]]] = field(default_factory=list)
    restore_plan: RestorePlan | None = None
    dropped: list[str] = field(default_factory=list)
    moved_to: Path | None = None
    t0: float = 0.0
    step: int = 0  # the trainer's step once restored (0: the run starts over)
    policy_version: int = 0  # the engine's, once the anchor's weights are pushed to it
    config_fingerprint: str = ""  # the one the restored store carries
    rewound: Rewound | None = None  # REWIND: what the live store's rollback did


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def plan_resume(dirs: RunDir, resume: str, *, start_over: bool = False) -> ResumePlan:
    """Decide, reading only, what resuming `dirs` does (see the module docstring).
    Raises ResumeError (or a RestoreError) with one line saying what to do."""
    if start_over:
        if str(resume) != LATEST:
            raise ResumeError("--start-over trains the run again from step 0; it takes no snapshot "
                              "(drop the path after --resume, or drop --start-over to restore that snapshot)")
        return ResumePlan(START_OVER)
    run_id = live_run_id(dirs.store)
    if run_id is None and str(resume) != LATEST and not _inside(Path(resume), dirs.checkpoints):
        raise ResumeError(f"{dirs.store}: cannot read this run's id, so {resume} cannot be shown to belong to this run; "
                          f"pass --resume latest or a snapshot under {dirs.checkpoints}")
    try:
        return ResumePlan(RESTORE, choose_snapshot(dirs.checkpoints, resume, run_id=run_id), run_id)
    except (NothingToRestore, TrainerCheckpointOnly) as e:
        nothing = e
    except NoRestorableSnapshot as e:
        raise ResumeError(f"{e}; or pass --start-over to move this run's state into {dirs.discarded}/ and train "
                          "from step 0") from None
    work = live_store_work(dirs.store, dirs.checkpoints)
    if work is None:
        # The only silent-safe start over: the store never handed out a prompt and no step
        # was trained, so starting over hands out the same prompts a restore would have
        # and loses nothing (a run killed before its first snapshot: the controller takes
        # that snapshot before the rollout pump dispatches anything).
        return ResumePlan(START_OVER_EMPTY, run_id=run_id, why=str(nothing))
    if isinstance(nothing, TrainerCheckpointOnly):
        return _plan_rewind(dirs, nothing, run_id)
    raise ResumeError(f"{nothing}; the live store holds work ({work}) that starting over would discard, so "
                      f"nothing was changed: restore {dirs.checkpoints}, pass a snapshot of this run with "
                      f"--resume SNAPSHOT_DIR, or pass --start-over to move this run's store, checkpoints, config and logs "
                      f"into {dirs.discarded}/ and train from step 0")


def _plan_rewind(dirs: RunDir, nothing: TrainerCheckpointOnly, run_id: str | None) -> ResumePlan:
    """No rollout snapshot, but a durable trainer checkpoint and a live store holding
    work: resume from the checkpoint alone (store/restore/rewind.py), or refuse saying
    why not. The checkpoint's files are checked against its manifest here, before
    anything is loaded."""
    anchor = nothing.anchor
    problem = anchor_problem(anchor) or rewind_problem(dirs.store, anchor.step or 0)
    if problem:
        raise ResumeError(f"{dirs.checkpoints}: no rollout snapshot, and the run cannot resume from its trainer checkpoint "
                          f"{anchor.anchor} alone: {problem}; nothing was changed: pass --start-over to move this run's "
                          f"store, checkpoints, config and logs into {dirs.discarded}/ and train from step 0")
    return ResumePlan(REWIND, anchor=anchor, run_id=run_id, why=str(nothing))


def check_rewind(config: Config, dirs: RunDir, plan: ResumePlan) -> None:
    """Refuse (before the controller is built) a REWIND under settings the live store was
    not written with: the config fingerprint, and the ledger switched off. The rewind's
    transaction checks every setting again, the dataset's too."""
    if plan.action != REWIND or plan.anchor is None:
        return
    fingerprints = tuple(f for f in (config.fingerprint(), earlier_config_fingerprint(config)) if f)
    problem = rewind_problem(dirs.store, plan.anchor.step or 0, ledger_dispatch=config.ledger_dispatch,
                             config_fingerprints=fingerprints)
    if problem:
        raise ResumeError(f"{dirs.checkpoints}: no rollout snapshot, and the run cannot resume from its trainer checkpoint "
                          f"{plan.anchor.anchor} alone: {problem}; nothing was changed")


def _rewind(parts: ResumeParts, on_writing: Callable[[], None], t0: float) -> Restored:
    """REWIND: the trainer from its checkpoint, its weights pushed to the engine, then the
    live store rolled back to the checkpoint's step in one transaction (a refusal there
    leaves it as it was), and the checkpoints of the branch after it removed."""
    cfg, dirs, plan, trainer = parts.config, parts.dirs, parts.plan, parts.trainer
    anchor = plan.anchor
    assert anchor is not None
    load_anchor(trainer, anchor.path)
    if trainer.step != (anchor.step or 0):
        raise ResumeError(f"{anchor.path}: the trainer loaded step {trainer.step} from a checkpoint named "
                          f"{anchor.anchor}; nothing was changed: pass --start-over")
    parts.engine.load_weights(trainer.export_weights(), trainer.step)
    rewound = rewind_live_store(
        dirs.store, step=trainer.step, position=PromptOrder(len(parts.dataset), cfg.run.seed).at,
        config_fingerprint=cfg.fingerprint(), dataset_fingerprint=parts.dataset.fingerprint(),
        forest_training={}, ledger_dispatch=cfg.ledger_dispatch,
        earlier_config_fingerprint=earlier_config_fingerprint(cfg))
    on_writing()  # the live store was rolled back
    faults.point("resume.after_restore")
    dropped = drop_checkpoints_after(dirs.checkpoints, trainer.step)
    return Restored(plan, Store.open(dirs.store), dropped=dropped, t0=t0, step=trainer.step,
                    policy_version=parts.engine.policy_version, config_fingerprint=cfg.fingerprint(), rewound=rewound)


def restore_run(parts: ResumeParts, *, on_writing: Callable[[], None]) -> Restored:
    """Carry out `parts.plan`. Calls `on_writing` once the run directory is about to
    change: from then on a failure is no refusal (it has not left the directory as it was)."""
    dirs, plan, trainer = parts.dirs, parts.plan, parts.trainer
    t0 = time.time()
    if plan.action == START_OVER:
        on_writing()
        return Restored(plan, moved_to=_move_aside(dirs), t0=t0)
    if plan.action == START_OVER_EMPTY:
        on_writing()
        remove_sqlite_file(dirs.store)
        return Restored(plan, t0=t0)
    if plan.action == REWIND:
        return _rewind(parts, on_writing, t0)

    def load_weights(selection: Selection) -> None:
        load_anchor(trainer, selection.anchor.path)  # its files were checked against its manifest
        parts.engine.load_weights(trainer.export_weights(), trainer.step)

    check_server_modes(parts.config, plan.selection.snapshot.path if plan.selection else None)
    check_packing(parts.config, plan.selection.snapshot.path if plan.selection else None)
    try:
        restore_plan = _restore(parts, load_weights)
    except NoRestorableSnapshot as e:  # every pair failed at restore: still nothing written
        raise ResumeError(f"{e}; or pass --start-over to move this run's state into {dirs.discarded}/ and train "
                          "from step 0") from None
    on_writing()  # the live store was replaced
    faults.point("resume.after_restore")
    # The trainer checkpoints of the branch the stop cut off: the resumed run publishes
    # those steps again (their snapshot numbers are never handed out again).
    dropped = drop_checkpoints_after(dirs.checkpoints, trainer.step)
    store = Store.open(dirs.store)
    groups = [
        (GroupHandle(g.group_id, g.reservation, g.target_step, g.num_generations, attempts={}), list(g.generations_to_run))
        for g in sorted(restore_plan.redispatch + restore_plan.to_finalize, key=lambda g: g.sample_seq)
    ]
    return Restored(plan, store, groups, restore_plan, dropped, t0=t0, step=trainer.step,
                    policy_version=parts.engine.policy_version, config_fingerprint=parts.config.fingerprint())


def load_anchor(trainer: Trainer, path: Path) -> None:
    """`trainer.load_checkpoint(path)`; a failure to load is the anchor's: its files
    match their manifest, but the trainer that wrote them wrote them bad (a truncated
    safetensors file sealed as it was, weights of another shape), so no resume can start
    from it. Raised as `AnchorDamaged`, one line: `select_and_restore` passes over the
    anchor's snapshots for the next sound pair (with `latest`) or refuses the snapshot
    named. A trainer left half-loaded is loaded again whole from the next anchor (every
    weight, the optimizer's state, the RNG and the step are replaced)."""
    try:
        trainer.load_checkpoint(path)
    except MemoryError:
        raise  # the machine's, not the anchor's: every other anchor would fail the same
    except Exception as e:  # noqa: BLE001 - whatever the trainer raises, the anchor cannot be loaded
        detail = " ".join(str(e).split())[:MAX_DETAIL]
        raise AnchorDamaged(f"{path}: the trainer cannot load this checkpoint although its files match their "
                            f"manifest ({type(e).__name__}: {detail}); it was written bad", path) from e


def _snapshot_config(snapshot_dir: Path | None) -> object | None:
    """The snapshot's config.yaml as parsed ({} when it has none), or None when there is
    no snapshot or the file cannot be read (the snapshot's own checks report a damaged
    file)."""
    if snapshot_dir is None:
        return None
    import yaml

    path = snapshot_dir / "config.yaml"
    try:
        return yaml.safe_load(path.read_text()) if path.is_file() else {}
    except (OSError, yaml.YAMLError):
        return None


def check_server_modes(config: Config, snapshot_dir: Path | None) -> None:
    """Refuse (before anything is written) a restore whose agent servers run in other
    checkpoint modes than they did when the snapshot was taken: an export_restore
    snapshot's agents would go to a server that cannot take them, or a restart_only
    snapshot would be read as holding agents. The snapshot's config.yaml records the
    modes. The config fingerprint holds them too; this check runs before the restore so
    that the refusal names the server."""
    old = _snapshot_config(snapshot_dir)
    if old is None:
        return
    servers = ((old or {}).get("environment") or {}).get("servers") or [] if isinstance(old, dict) else []
    then = {s.get("name"): s.get("mode", "export_restore") for s in servers if isinstance(s, dict)}
    now = {s.name: s.mode for s in config.environment.servers}
    differ = [f"{n}: {then.get(n, 'no server')} in the snapshot, {now.get(n, 'no server')} now"
              for n in sorted(set(then) | set(now), key=str) if then.get(n) != now.get(n)]
    if differ:
        raise ResumeError(f"environment servers changed checkpoint mode since {snapshot_dir.name} ({'; '.join(differ)}), "
                          "so its agents cannot be restored as they were saved; nothing was changed: resume with the "
                          "modes the run had (environment.servers[].mode), or pass --start-over")


def check_packing(config: Config, snapshot_dir: Path | None) -> None:
    """Refuse (before anything is written) a restore whose `algorithm.shared_prefix_packing`
    differs from the snapshot's (its config.yaml; a snapshot from before the key has it
    off). The two layouts train the same loss but not the same floating-point sums
    (tests/test_shared_prefix_packing.py), so a resumed run that switched would no longer
    take the steps the uninterrupted run takes. The config fingerprint holds the setting
    too; this check runs before the restore so that the refusal names it."""
    old = _snapshot_config(snapshot_dir)
    if old is None:
        return
    algorithm = (old.get("algorithm") or {}) if isinstance(old, dict) else {}
    then = bool(algorithm.get("shared_prefix_packing", False)) if isinstance(algorithm, dict) else False
    now = bool(config.algorithm.shared_prefix_packing)
    if then != now:
        word = lambda on: "true" if on else "false"  # noqa: E731
        where = f"{snapshot_dir.parent.parent.name}/{snapshot_dir.name}"  # step_N/snapshot_M
        raise ResumeError(f"algorithm.shared_prefix_packing is {word(then)} in {where} but {word(now)} now; "
                          f"nothing was changed: resume with algorithm.shared_prefix_packing={word(then)}, or pass "
                          "--start-over to train the run again from step 0 with the new setting")


def _restore(parts: ResumeParts, load_weights: Callable[[Selection], None]) -> RestorePlan:
    cfg, dirs, plan = parts.config, parts.dirs, parts.plan
    return select_and_restore(
        dirs.checkpoints,
        dirs.store,
        resume=parts.resume,
        selection=plan.selection,
        run_id=plan.run_id,
        before_restore=load_weights,
        config_fingerprint=cfg.fingerprint(),
        earlier_config_fingerprint=earlier_config_fingerprint(cfg),
        dataset_fingerprint=parts.dataset.fingerprint(),
        forest_training={},  # no forest rollouts in this version: "off" (schema.py, run_meta)
        groups_per_step=cfg.algorithm.groups_per_step,
        ledger_dispatch=cfg.ledger_dispatch,
    )


def announce(done: Restored, *, metrics: RunMetrics, tracer: Tracer | NullTracer) -> None:
    """Say what the resume did: stderr, the metrics log and the trace (opened after the
    restore, so that a refused resume writes nothing)."""
    say = lambda text: print(f"rolloutdb: {text}", file=sys.stderr)  # noqa: E731
    if done.store is None:
        if done.plan.action == START_OVER:
            say(f"--start-over: moved the run's store, checkpoints, config and logs to {done.moved_to}; "
                "starting the run over from step 0")
        else:
            say(f"no rollout snapshot yet and the live store held no work; starting the run over ({done.plan.why})")
        metrics.write({"kind": "restore", "t": time.time(), "snapshot": None, "step": 0,
                           "started_over": done.plan.action, "moved_to": str(done.moved_to) if done.moved_to else None})
        return
    if done.rewound is not None:
        _announce_rewind(done, say, metrics=metrics, tracer=tracer)
        return
    plan = done.restore_plan
    assert plan is not None
    for reason in plan.passed_over:
        say(f"passed over {reason}")
    if plan.config_fingerprint_was is not None:
        say(f"{plan.snapshot_dir.parent.parent.name}/{plan.snapshot_dir.name} carries config fingerprint "
            f"{plan.config_fingerprint_was}, this config's under the fingerprint's earlier formula: accepted, and the "
            f"run now carries {done.config_fingerprint} (its later snapshots are resumed by that)")
    for anchor in done.dropped:
        say(f"removed {anchor}: newer than the restored anchor, its step is trained again")
    metrics.write(
        {
            "kind": "restore",
            "t": time.time(),
            "snapshot": str(plan.snapshot_dir),
            "anchor": plan.anchor,
            "snapshot_seq": plan.sequence,
            "cut_time": plan.cut_time,
            "step": done.step,
            "groups_restored": len(done.groups),
            "passed_over": plan.passed_over,
            "dropped_anchors": done.dropped,
            "counts": plan.counts,
            "restore_s": time.time() - done.t0,
        }
    )
    RolloutTrace(tracer).restore_done(
        step=done.step,
        policy_version=done.policy_version,
        cut_time=plan.cut_time,
        decoded_at=plan.decoded_at,
        snapshot_seq=plan.sequence,
        anchor=plan.anchor,
        snapshot=str(plan.snapshot_dir),
        groups_restored=len(done.groups),
        replay_restored=plan.counts.get("replay_groups", 0),
    )
    say(f"resumed from {plan.anchor}/snapshot_{plan.sequence} at step {done.step}: "
        f"{len(done.groups)} groups to redo first")


def _announce_rewind(done: Restored, say: Callable[[str], None], *, metrics: RunMetrics,
                     tracer: Tracer | NullTracer) -> None:
    r, anchor = done.rewound, done.plan.anchor
    assert r is not None and anchor is not None
    for name in done.dropped:
        say(f"removed {name}: newer than the checkpoint resumed from, its step is trained again")
    say(f"no rollout snapshot: resumed from the trainer checkpoint {anchor.anchor} alone, at step {done.step}; "
        f"in-flight and replay work of the steps after {done.step} is generated again ({r.trained_after} group(s) "
        f"trained after step {done.step} and {r.withdrawn} in flight or in replay handed out again)")
    if r.config_fingerprint_was is not None:
        say(f"the live store carried config fingerprint {r.config_fingerprint_was}, this config's under the "
            f"fingerprint's earlier formula: accepted, and the run now carries {done.config_fingerprint}")
    metrics.write({"kind": "restore", "t": time.time(), "snapshot": None, "anchor": anchor.anchor, "step": done.step,
                   "rewound": {"trained_after": r.trained_after, "withdrawn": r.withdrawn,
                               "abandoned_attempts": len(r.abandoned), "shortfall_dropped": r.shortfall_dropped},
                   "dropped_anchors": done.dropped, "restore_s": time.time() - done.t0})
    trace = RolloutTrace(tracer)
    trace.abandoned(r.abandoned, "restart")
    trace.withdrawn(r.withdrawn_groups)
    # The cut is the checkpoint's: what the stopped run did after it is done again.
    created = anchor.manifest.created_at if anchor.manifest is not None else None
    trace.restore_done(step=done.step, policy_version=done.policy_version, cut_time=created, snapshot_seq=None,
                       anchor=anchor.anchor, snapshot="", groups_restored=0, replay_restored=0)


def _move_aside(dirs: RunDir) -> Path:
    """`--start-over`: move the store (with its side files), the checkpoints, the
    config, the logs and the plots into RUN_DIR/discarded/<UTC time>/; nothing is deleted. The new checkpoint
    directory starts with the old high-water mark, so snapshot numbers keep growing."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest, n = dirs.discarded / stamp, 1
    while dest.exists():  # two start-overs in one second
        n += 1
        dest = dirs.discarded / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    # The logs and plots too: the new run's trace and dashboards would otherwise continue
    # the old run's (a trace report then showed the gap between the two as a stop).
    move_run_aside(dest, store=dirs.store, checkpoints=dirs.checkpoints, also=[dirs.config, dirs.logs, dirs.plots])
    return dest
