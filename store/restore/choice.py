"""Resuming a run: which snapshot to restore, and checking a run's whole history after.

`choose_snapshot` picks what a resume starts from: with ``resume="latest"`` the newest
complete snapshot whose anchor is a durable trainer checkpoint whose files match its
manifest (`selection`), or the directory the user named (refused if its anchor's files
do not match, or, given the run's id, if it belongs to another run). It never starts
fresh silently: snapshots that exist but are all unusable raise `NoRestorableSnapshot`;
no snapshot at all beside a durable trainer checkpoint raises `TrainerCheckpointOnly`
(the controller then resumes from that checkpoint alone: rewind.py);
nothing at all raises `NothingToRestore`. Whether the caller may then start over is its
decision: `live_store_work` says whether the live store holds anything to lose.

`audit_ledger` checks exactly-once over every stop a run's live store has been through
(the controller's run audit, `verify RUN_DIR`, calls it). The live store accounts for
every position the sampler ever handed out: in flight as ledger rows, settled (trained,
discarded) as `settled_steps` rows, about one per step (live/compaction.py; read through
`queries.settled_runs`); a restore rolls back
only what came after the snapshot's cut, records included, and the rolled-back work is
redone under the same rows, so one read of it sees the whole chain.
"""

from __future__ import annotations

import bisect
import contextlib
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import (
    AnchorDamaged,
    NotAStoreError,
    NothingToRestore,
    NoRestorableSnapshot,
    RestoreError,
    RunMismatch,
    SnapshotDamaged,
    SnapshotInconsistent,
    TrainerCheckpointOnly,
)
from ..live.invariants import audit_prompts, check_invariants
from ..checkpoints.layout import COMPLETE, SNAPSHOTS_DIR, Entry, scan
from ..live.compaction import Prefix, read_prefix
from ..live.queries import FOLDED, SettledRun, settled_counts, settled_runs
from ..live.ledger import ALGORITHM_DISCARD_REASONS
from ..checkpoints.manifest import KIND_SNAPSHOT, KIND_TRAINER, ManifestError, read_manifest
from .apply import RestorePlan, restore_snapshot
from .selection import Selection, anchor_problem, run_id_problem, select_for_restore
from .verification import open_for_checks

LATEST = "latest"
MAX_EXAMPLES = 5


def _anchor_entry(path: Path) -> Entry:
    try:
        manifest = read_manifest(path)
    except ManifestError as e:
        raise RestoreError(f"{path}: not a durable trainer checkpoint ({e}); its snapshots cannot be restored; "
                           "pass another snapshot or --resume latest") from None
    if manifest.kind != KIND_TRAINER:
        raise RestoreError(f"{path}: manifest kind {manifest.kind}, not a trainer checkpoint")
    return Entry(KIND_TRAINER, manifest.anchor, path, COMPLETE, None, manifest)


def _only_trainer_checkpoint(checkpoint_dir: Path, anchors: list[Entry]) -> RestoreError:
    if not anchors:
        return NothingToRestore(f"{checkpoint_dir}: no trainer checkpoint and no rollout snapshot to resume from")
    newest = anchors[-1]
    return TrainerCheckpointOnly(
        f"{checkpoint_dir}: no rollout snapshot, but the trainer checkpoint {newest.anchor} is durable; "
        f"a resume from it alone rolls the live store back to step {newest.step or 0}", newest)


def _checked(selection: Selection, run_id: str | None) -> Selection:
    """A snapshot the user named: refused (nothing loaded, nothing replaced) if its
    anchor's files fail their manifest or it belongs to another run."""
    problem = anchor_problem(selection.anchor)
    if problem:
        raise AnchorDamaged(f"{selection.anchor.path}: the trainer checkpoint of this snapshot fails verification "
                            f"({problem}); its files were not loaded; pass another snapshot or --resume latest",
                            selection.anchor.path)
    problem = run_id_problem(selection.snapshot.path, run_id)
    if problem:
        raise RunMismatch(f"{selection.snapshot.path}: {problem}; pass a snapshot of this run "
                          "(`rolloutdb snapshots RUN_DIR/checkpoints` lists them) or --resume latest", ["run_id"])
    return selection


def choose_snapshot(checkpoint_dir: str | Path, resume: str | Path = LATEST, *, verify: bool = False,
                    run_id: str | None = None) -> Selection:
    """The snapshot a resume restores (see the module docstring). `resume` is "latest",
    a snapshot directory, or a trainer checkpoint directory (its newest snapshot).
    Anchors are always checked against their manifests; `verify` makes "latest" also
    pass over snapshots that fail their checksums or checks. `run_id`, when given,
    refuses (or with "latest" passes over) snapshots of another run."""
    checkpoint_dir = Path(checkpoint_dir)
    if str(resume) == LATEST:
        # raises NoRestorableSnapshot
        selection = select_for_restore(checkpoint_dir, verify=verify, verify_anchors=True, run_id=run_id)
        if selection is None:
            raise _only_trainer_checkpoint(checkpoint_dir, scan(checkpoint_dir).complete_anchors())
        return selection
    path = Path(resume)
    if not path.is_dir():
        raise RestoreError(f"{path}: no such directory; pass --resume latest, a snapshot directory or a trainer checkpoint")
    try:
        manifest = read_manifest(path)
    except ManifestError as e:
        raise SnapshotDamaged(f"{e}; pass a complete snapshot or --resume latest", path) from None
    if manifest.kind == KIND_TRAINER:
        anchor = _anchor_entry(path)
        snaps = [s for s in scan(path.parent).complete_snapshots() if s.anchor == anchor.anchor]
        if not snaps:
            raise _only_trainer_checkpoint(path.parent, [anchor])
        return _checked(Selection(snaps[-1], anchor), run_id)
    if manifest.kind != KIND_SNAPSHOT or path.parent.name != SNAPSHOTS_DIR:
        raise RestoreError(f"{path}: not a rollout snapshot directory (…/{SNAPSHOTS_DIR}/snapshot_<N>)")
    anchor = _anchor_entry(path.parent.parent)
    if anchor.anchor != manifest.anchor:
        raise SnapshotDamaged(f"{path}: manifest says anchor {manifest.anchor} but it lies under {anchor.anchor}", path)
    snapshot = Entry(KIND_SNAPSHOT, manifest.anchor, path, COMPLETE, manifest.sequence, manifest)
    return _checked(Selection(snapshot, anchor), run_id)


def select_and_restore(
    checkpoint_dir: str | Path,
    live_store_path: str | Path,
    *,
    resume: str | Path = LATEST,
    before_restore: Callable[[Selection], None] | None = None,
    run_id: str | None = None,
    selection: Selection | None = None,
    **restore_kwargs,
) -> RestorePlan:
    """Choose a snapshot (or take `selection`, made by `choose_snapshot` with the same
    arguments), call `before_restore(selection)` (load the trainer's weights from
    `selection.anchor.path`, whose files have been checked), then `restore_snapshot` into
    `live_store_path`. `run_id`: this run's id; a snapshot of another run is refused.

    With "latest", the newest candidate is tried without a separate verification pass
    (restore checks every checksum itself); if it turns out damaged or inconsistent, the
    newest snapshot that verifies is chosen instead (its anchor is loaded again), and so
    on. An anchor whose files match their manifest but that the trainer cannot load (a
    trainer that wrote a truncated or foreign file before it was sealed) is unsound too:
    `before_restore` raises `AnchorDamaged` for it, and every snapshot of that anchor is
    passed over. `plan.passed_over` names every snapshot or anchor passed over, and why."""
    latest = str(resume) == LATEST
    selection = selection or choose_snapshot(checkpoint_dir, resume, run_id=run_id)
    passed_over = list(selection.passed_over)
    tried: list[Path] = []
    while True:
        try:
            if before_restore is not None:
                before_restore(selection)
        except AnchorDamaged as e:
            if not latest:
                raise AnchorDamaged(f"{e}; nothing was restored: pass another snapshot or --resume latest",
                                    e.path) from e
            anchor = selection.anchor.anchor
            passed_over.append(f"{anchor} and its snapshot(s): {e}")
            tried += [s.path for s in scan(checkpoint_dir).snapshots if s.anchor == anchor]
        else:
            try:
                # The manifest the listing read is passed down: restore reads it no more.
                plan = restore_snapshot(selection.snapshot.path, live_store_path, run_id=run_id,
                                        manifest=selection.snapshot.manifest, **restore_kwargs)
            except (SnapshotDamaged, SnapshotInconsistent) as e:
                if not latest:
                    raise
                passed_over.append(f"{selection.snapshot.path.name} ({selection.snapshot.anchor}): {e}")
                tried.append(selection.snapshot.path)
            else:
                plan.passed_over = passed_over
                return plan
        try:  # the next sound pair
            selection = select_for_restore(checkpoint_dir, verify=True, run_id=run_id, exclude=tried)
        except NoRestorableSnapshot as none:
            reasons = passed_over + none.reasons
            raise NoRestorableSnapshot(f"{checkpoint_dir}: no rollout snapshot can be restored: "
                                       + "; ".join(reasons[:8]) + ". Refusing to start fresh", reasons) from None
        if selection is None:  # cannot happen: the ones tried are still listed
            raise NoRestorableSnapshot(f"{checkpoint_dir}: no rollout snapshot can be restored: "
                                       + "; ".join(passed_over[:8]), passed_over)
        passed_over += [r for r in selection.passed_over if r not in passed_over]


# --------------------------------------------------------------------------- the live store


def live_run_id(live_store_path: str | Path) -> str | None:
    """The run id of the live store (read-only), or None when it cannot be read."""
    try:
        with contextlib.closing(open_for_checks(live_store_path)) as conn:
            row = conn.execute("SELECT run_id FROM run_meta").fetchone()
    except (NotAStoreError, sqlite3.DatabaseError):
        return None
    return row[0] if row else None


def live_store_work(live_store_path: str | Path, checkpoint_dir: str | Path) -> str | None:
    """What a start over would throw away: None only when the live store provably holds
    no work (no prompt ever handed out, nothing in replay, no sample) and no trainer step
    was ever checkpointed; otherwise one phrase saying what it holds (or that it cannot
    be read, which proves nothing). Read-only."""
    steps = [a.anchor for a in scan(checkpoint_dir).anchors if a.step is not None]
    try:
        with contextlib.closing(open_for_checks(live_store_path)) as conn:
            q = lambda sql: conn.execute(sql).fetchone()[0]  # noqa: E731
            states = dict(conn.execute("SELECT state, count(*) FROM prompt_groups GROUP BY state").fetchall())
            cursor = q("SELECT coalesce(max(next_seq), 0) FROM sampler_state")
            spare, replay, samples = (q(f"SELECT count(*) FROM {t}") for t in ("spare_prompts", "replay_groups", "samples"))
            settled = settled_counts(conn)
    except (NotAStoreError, sqlite3.DatabaseError) as e:
        return f"the live store cannot be read ({e}), so it may hold trained work"
    for outcome, n in settled.items():  # settled groups left the ledger (live/compaction.py)
        states[outcome] = states.get(outcome, 0) + n
    held = [f"{n} group(s) {state}" for state, n in sorted(states.items(), key=lambda kv: kv[0] != "trained") if n]
    held += [f"{n} {what}" for n, what in ((spare, "spare prompt(s)"), (replay, "group(s) in replay"),
                                          (samples, "finished sample(s)")) if n]
    if cursor and not held:
        held.append(f"the sampler cursor at {cursor}")
    if steps:
        held.append(f"trainer checkpoint(s) {', '.join(steps[-3:])}")
    return ", ".join(held) or None


# --------------------------------------------------------------------------- audit a run


@dataclass
class LedgerAudit:
    """Exactly-once over a run's whole history. `duplicated`: prompt hand-outs beyond the
    first of the same (epoch, prompt id); `lost`: sampler positions below the cursor in
    neither the ledger nor the spare pool, plus groups discarded for a reason the
    algorithm does not own (`discarded_not_owned`: anything but zero reward variance is
    work thrown away, not a decision of the algorithm). `pending`: groups neither trained
    nor discarded yet (in flight or in replay; zero at the end of a finished run)."""

    ledger_dispatch: bool
    groups_per_step: int
    trained: int = 0
    discarded: int = 0
    duplicated: int = 0
    lost: int = 0
    pending: int = 0
    discarded_not_owned: int = 0
    spare: int = 0
    cursor: int = 0
    steps: int = 0  # highest trained step
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.duplicated == 0 and self.lost == 0

    def line(self) -> str:
        return f"trained={self.trained} discarded={self.discarded} duplicated={self.duplicated} lost={self.lost}"


def _examples(items: list) -> str:
    return ", ".join(map(str, items[:MAX_EXAMPLES])) + (", ..." if len(items) > MAX_EXAMPLES else "")


def audit_ledger(store_path: str | Path, *, groups_per_step: int,
                 algorithm_reasons: frozenset[str] = ALGORITHM_DISCARD_REASONS) -> LedgerAudit:
    """Read the live store at `store_path` (read-only; no side files created); count and
    check exactly-once (see `LedgerAudit`). `groups_per_step`: the run's, from its
    config; `algorithm_reasons`: the discard reasons that settle a group."""
    store_path = Path(store_path)
    conn = open_for_checks(store_path)  # open_readonly, for our own SQL
    with contextlib.closing(conn):
        q = lambda sql, *a: conn.execute(sql, a).fetchall()  # noqa: E731
        mode = bool(q("SELECT ledger_dispatch FROM run_meta")[0][0])
        v = LedgerAudit(mode, groups_per_step)
        v.cursor = q("SELECT next_seq FROM sampler_state")[0][0]
        v.spare = q("SELECT count(*) FROM spare_prompts")[0][0]
        v.problems += [f"{store_path.name}: {p}" for p in check_invariants(conn).problems]
        if not mode:
            v.notes.append("run without ledger dispatch (rollout_recovery.target_level none): groups are not recorded, "
                           "so exactly-once cannot be checked; only the invariants were")
            return v
        states = dict(q("SELECT state, count(*) FROM prompt_groups GROUP BY state"))
        runs = settled_runs(conn)
        prefix = read_prefix(conn)  # the folded steps, as counts (compaction.fold_settled)
        settled = {"trained": prefix.trained, "discarded": sum(prefix.discarded.values())}
        for r in runs:
            if r.outcome != FOLDED:
                settled[r.outcome] = settled.get(r.outcome, 0) + r.end - r.start
        v.trained = states.pop("trained", 0) + settled["trained"]
        v.discarded = states.pop("discarded", 0) + settled["discarded"]
        v.pending = sum(states.values())
        if v.pending:
            v.notes.append(f"{v.pending} group(s) neither trained nor discarded yet (in flight or in replay): "
                           "a run that has not finished, or stopped")
        handed = "SELECT sample_seq, epoch, prompt_id FROM prompt_groups UNION ALL " \
                 "SELECT sample_seq, epoch, prompt_id FROM spare_prompts"
        # Live rows with the settled prompts' bitmaps: a prompt handed out again after its
        # first group settled (live/compaction.py) counts as duplicated too.
        prompts = audit_prompts(conn, runs)
        v.duplicated = prompts.duplicated
        if prompts.twice:
            v.problems.append(f"{v.duplicated} prompt(s) handed out more than once: " + _examples(prompts.twice))
        clashes = q(f"SELECT sample_seq FROM ({handed}) GROUP BY sample_seq HAVING count(DISTINCT epoch || ':' || prompt_id) > 1")
        if clashes:
            v.problems.append(f"sampler positions holding two different prompts: {_examples([r[0] for r in clashes])}")
        live = sorted({r[0] for r in q(f"SELECT sample_seq FROM ({handed})")})
        _check_positions(v, live, runs)
        _check_discard_reasons(q, v, algorithm_reasons, runs, prefix)
        _check_steps(q, v, runs, prefix)
    return v


def _check_positions(v: LedgerAudit, live: list[int], runs: list[SettledRun]) -> None:
    """Every sampler position below the cursor in exactly one of: a live row (ledger or
    spare, `live`, distinct and sorted), a settled range. A position in two ranges or in
    a range and a live row counts as duplicated; a position in none as lost. Ranges are
    few (runs of positions, see compaction.py) and live rows are what is in flight, so a
    merge in Python over both is cheap."""
    doubled: list[str] = []
    covered = 0
    reach = 0  # the end of the union of the ranges so far (runs are sorted by start)
    for r in runs:
        if r.start < reach:
            overlap = min(r.end, reach) - r.start
            v.duplicated += overlap
            doubled.append(f"positions {r.start}..{r.start + overlap - 1} settled twice")
        lo, hi = max(0, max(r.start, reach)), min(v.cursor, r.end)
        covered += max(0, hi - lo)
        reach = max(reach, r.end)
    starts = [r.start for r in runs]
    for seq in live:
        i = bisect.bisect_right(starts, seq) - 1
        inside = any(runs[j].start <= seq < runs[j].end for j in range(max(0, i - 1), i + 1)) if i >= 0 else False
        if inside:
            v.duplicated += 1
            doubled.append(f"position {seq} settled and live")
        elif 0 <= seq < v.cursor:
            covered += 1
    if doubled:
        v.problems.append(f"{len(doubled)} sampler position(s) or range(s) recorded twice: {_examples(doubled)}")
    lost = v.cursor - covered
    v.lost += lost
    if lost:
        missing, seq = [], 0
        spans = sorted([(r.start, r.end) for r in runs] + [(s, s + 1) for s in live])
        for a, b in spans:  # the first few gaps below the cursor
            while seq < min(a, v.cursor) and len(missing) <= MAX_EXAMPLES:
                missing.append(seq)
                seq += 1
            seq = max(seq, b)
        while seq < v.cursor and len(missing) <= MAX_EXAMPLES:
            missing.append(seq)
            seq += 1
        v.problems.append(f"{lost} sampler position(s) below the cursor {v.cursor} neither in the ledger, the spare "
                          f"pool nor a settled range: {_examples(missing)}")


def _check_discard_reasons(q, v: LedgerAudit, algorithm_reasons: frozenset[str], runs: list[SettledRun],
                           prefix: Prefix) -> None:
    """A group discarded for a reason the algorithm does not own is lost work: its
    sampler position is covered by a ledger row or a settled range, so the position
    count cannot see it."""
    owned = sorted(algorithm_reasons)
    marks = ", ".join("?" * len(owned)) or "NULL"
    rows = q(f"SELECT discard_reason, epoch, prompt_id, group_id FROM prompt_groups WHERE state = 'discarded' "
             f"AND (discard_reason IS NULL OR discard_reason NOT IN ({marks})) ORDER BY sample_seq, group_id", *owned)
    examples = [f"group {g} epoch {e} prompt {p} ({r!r})" for r, e, p, g in rows]
    per_reason: dict[str, int] = {}
    for reason, *_ in rows:
        per_reason[str(reason)] = per_reason.get(str(reason), 0) + 1
    for r in runs:
        if r.outcome == "discarded" and r.discard_reason not in algorithm_reasons:
            n = r.end - r.start
            per_reason[str(r.discard_reason)] = per_reason.get(str(r.discard_reason), 0) + n
            examples.append(f"positions {r.start}..{r.end - 1} ({r.discard_reason!r})")
    for reason, n in sorted(prefix.discarded.items()):
        if n and reason not in algorithm_reasons:
            per_reason[reason] = per_reason.get(reason, 0) + n
            examples.append(f"{n} folded position(s) below {prefix.seq_end} ({reason!r})")
    total = sum(per_reason.values())
    if not total:
        return
    v.discarded_not_owned = total
    v.lost += total
    v.problems.append(
        f"{total} group(s) discarded for a reason the algorithm does not own (it owns only "
        f"{', '.join(repr(r) for r in owned)}), counted as lost work: "
        + ", ".join(f"{r!r} x{n}" for r, n in sorted(per_reason.items()))
        + "; e.g. " + _examples(examples))


def _check_steps(q, v: LedgerAudit, runs: list[SettledRun], prefix: Prefix) -> None:
    """Each group trained at most once and at its stamped step; each step trained exactly
    groups_per_step groups, with no step skipped. The steps folded into the prefix
    (up to its `through_step`) are checked together: their groups, folded or still
    rows, number `through_step` x groups_per_step."""
    wrong = q("SELECT group_id FROM prompt_groups WHERE (state = 'trained') != (trained_step IS NOT NULL)")
    wrong += [(f"positions {r.start}..{r.end - 1}",) for r in runs if (r.outcome == "trained") != (r.trained_step is not None)]
    if wrong:
        v.problems.append(f"groups whose trained step contradicts their state: {_examples([r[0] for r in wrong])}")
    off = q("SELECT group_id, target_step, trained_step FROM prompt_groups "
            "WHERE state = 'trained' AND target_step IS NOT NULL AND target_step != trained_step")
    off += [(f"positions {r.start}..{r.end - 1}", r.target_step, r.trained_step) for r in runs
            if r.outcome == "trained" and r.target_step is not None and r.target_step != r.trained_step]
    if off:
        v.problems.append("groups trained at another step than stamped: "
                          + _examples([f"group {g} stamped {s} trained {t}" for g, s, t in off]))
    per_step = dict(q("SELECT trained_step, count(*) FROM prompt_groups WHERE state = 'trained' GROUP BY trained_step"))
    for r in runs:
        if r.outcome == "trained":
            per_step[r.trained_step] = per_step.get(r.trained_step, 0) + r.end - r.start
    folded = prefix.through_step or 0
    v.steps = max([folded, *(s for s in per_step if s is not None)])
    bad = [(s, per_step.get(s, 0)) for s in range(folded + 1, v.steps + 1) if per_step.get(s, 0) != v.groups_per_step]
    early = prefix.trained + sum(n for s, n in per_step.items() if s is not None and 1 <= s <= folded)
    if early != folded * v.groups_per_step:
        v.problems.append(f"train steps 1..{folded} (folded into settled_prefix) trained {early} groups, not "
                          f"{folded} x groups_per_step={v.groups_per_step}")
    bad += [(s, n) for s, n in per_step.items() if s is None or s < 1]
    if bad:
        v.problems.append(f"train steps that did not train groups_per_step={v.groups_per_step} groups: "
                          + _examples([f"step {s}: {n}" for s, n in sorted(bad, key=lambda x: (x[0] is None, x[0] or 0))]))
