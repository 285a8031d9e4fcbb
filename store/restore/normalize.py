"""Restart normalization (phases 6 and 7 of `apply.restore_snapshot`): what the live
store must look like before the pumps start, done in one transaction on the restore's
copy. State moves go through the ledger's and the pools' public functions; what is left
here is restore's own: reading what abandoned attempts saved, and clearing payload rows
no live ledger row references (invariant 3).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from sqlalchemy import Connection, delete, func, literal_column, select

from ..errors import ReplayFullError, SnapshotInconsistent
from ..live import ledger, pools, queries
from ..live.compaction import read_prefix
from ..live.payload import SegmentMissing
from ..live.schema import T
from ..sqlite.prepared import Prepared, _driver
from .plan import RestoredGroup

# --------------------------------------------------------------------------- phase 6


groups_t, rollouts_t, samples_t = T["prompt_groups"], T["rollouts"], T["samples"]
chunks_t, episodes_t = T["token_chunks"], T["env_episodes"]
replay_t = T["replay_groups"]

# The two reads that grow with the groups in flight (a row per finished generation, a
# row per dispatched group: 50k rows at 10k groups in flight), run on the DBAPI cursor
# (`Prepared`): SQLAlchemy's row wrapping cost more than SQLite's work for them.
# Driven from the dispatched groups, reading their rows through the UNIQUE (group_id,
# ...) index, not every finished rollout (0.55 s -> 0.02 s at 100k groups,
# bench/bench_restore.py, when a state index tempted SQLite; `+state` keeps it so in a
# file older than v1_13_a, which has one).
_FINISHED_GENERATIONS = Prepared(
    select(rollouts_t.c.group_id, rollouts_t.c.generation_index)
    .join(groups_t, groups_t.c.group_id == rollouts_t.c.group_id)
    .where(groups_t.c.state == "dispatched", literal_column("+rollouts.state") == "finished")
)
_DISPATCHED_GROUPS = Prepared(
    select(groups_t.c.group_id, groups_t.c.sample_seq, groups_t.c.epoch, groups_t.c.prompt_id,
           groups_t.c.target_step, groups_t.c.num_generations)
    .where(groups_t.c.state == "dispatched")
    .order_by(groups_t.c.sample_seq)
)


def _clear_unreferenced(tx: Connection) -> int:
    """Payload rows of no live ledger row (invariant 3). Returns how many were removed."""
    dead = select(groups_t.c.group_id).where(groups_t.c.state.in_(("reserved", "trained", "discarded")))
    live_groups = select(groups_t.c.group_id)
    running = select(rollouts_t.c.attempt_id).where(rollouts_t.c.state == "running")
    statements = (
        delete(samples_t).where(samples_t.c.group_id.in_(dead) | samples_t.c.group_id.not_in(live_groups)),
        delete(chunks_t).where(chunks_t.c.attempt_id.not_in(running)),
        delete(episodes_t).where(episodes_t.c.attempt_id.not_in(running)),
    )
    return sum(tx.execute(s).rowcount for s in statements)


def _read_saved_progress(tx: Connection, segments_dir: Path | None) -> tuple[dict, dict]:
    """Prefix chunks and environment episodes of the running attempts (their groups'
    generations start again), both keyed by (group id, generation index). Chunks whose segment
    cannot give them are left out (their calls restart their turn): the segments' own
    verdict, read before the live store is replaced, refuses a damaged snapshot whole."""
    where = {a: (g, i) for a, g, i in tx.execute(
        select(rollouts_t.c.attempt_id, rollouts_t.c.group_id, rollouts_t.c.generation_index)
        .where(rollouts_t.c.attempt_id.in_(select(chunks_t.c.attempt_id)), rollouts_t.c.state == "running")
    ).all()}
    try:
        chunks = pools.read_chunks_of(tx, sorted(where), segments_dir)
    except SegmentMissing:
        chunks = {}
    prefixes = {where[a]: chunks[a] for a in sorted(where) if a in chunks}
    return prefixes, pools.read_episodes(tx, running_only=True)


def normalize_ledger(tx: Connection, source: Path, step: int, counts: dict[str, int],
                      saved: dict, segments_dir: Path | None = None,
                      phase: Callable[[str], AbstractContextManager] = lambda name: nullcontext()) -> tuple[list, list]:
    """Phase 6, inside one transaction on the copy. `segments_dir`: where the prefix
    chunks the snapshot references are (its checkpoint directory's payload_segments/).
    `phase(name)` times a part: `in_flight` is the work on the running attempts (read
    what they saved; they are abandoned when the pump restarts them)."""
    beyond = tx.execute(
        select(func.count()).where(groups_t.c.state == "trained", groups_t.c.trained_step > step)
    ).scalar_one() + sum(  # and the settled ones (live/compaction.py)
        r.end - r.start for r in queries.settled_runs(tx) if r.outcome == "trained" and (r.trained_step or 0) > step)
    folded = read_prefix(_driver(tx)).through_step
    if folded is not None and folded > step:
        raise SnapshotInconsistent(f"{source}: its settled record folded steps up to {folded}, after step {step}, the "
                                   "snapshot's anchor; the snapshot does not match its trainer checkpoint; restore "
                                   "another snapshot", 1)
    if beyond:
        raise SnapshotInconsistent(f"{source}: {beyond} group(s) trained after step {step}, the snapshot's anchor; "
                                   "the snapshot does not match its trainer checkpoint; restore another snapshot", 1)
    # The running attempts stay as they are: the rollout pump abandons each (reason
    # `restart`) in the transaction that starts its replacement (`ledger.restart_attempts`),
    # so this phase costs what they saved, not how many there are.
    with phase("in_flight"):
        saved["prefixes"], saved["episodes"] = _read_saved_progress(tx, segments_dir)

    reserved = list(tx.execute(
        select(groups_t.c.group_id).where(groups_t.c.state == "reserved").order_by(groups_t.c.sample_seq)
    ).scalars())
    # reserved -> dispatched without starting attempts (dispatch_groups would start
    # them): the pump starts them with start_attempts, as for every restored group.
    ledger.dispatch_without_attempts(tx, reserved, policy_version=step)
    counts["reserved_to_dispatched"] = len(reserved)

    sealed = list(tx.execute(
        select(groups_t.c.group_id).where(groups_t.c.state == "sealed").order_by(groups_t.c.sample_seq)
    ).scalars())
    try:
        ledger.enter_replay(tx, sealed)
    except ReplayFullError as e:
        raise SnapshotInconsistent(f"{source}: cannot put its {len(sealed)} sealed group(s) into replay: {e}", 2) from None
    counts["published_at_restore"] = len(sealed)

    finished: dict[int, set[int]] = {}
    for g, i in _FINISHED_GENERATIONS.run(tx).fetchall():
        finished.setdefault(g, set()).add(i)
    was_reserved = set(reserved)
    redispatch: list[RestoredGroup] = []
    to_finalize: list[RestoredGroup] = []
    for g, seq, epoch, pid, target, n in _DISPATCHED_GROUPS.run(tx).fetchall():
        done = finished.get(g)
        todo = tuple(range(n)) if done is None else tuple(i for i in range(n) if i not in done)
        group = RestoredGroup(g, seq, epoch, pid, target, n, todo, g in was_reserved)
        (redispatch if todo else to_finalize).append(group)
    counts["generations_to_run"] = sum(len(r.generations_to_run) for r in redispatch)
    counts["payload_rows_cleared"] = _clear_unreferenced(tx)
    return redispatch, to_finalize


# --------------------------------------------------------------------------- phase 7


def normalize_without_ledger(tx: Connection, source: Path, step: int, groups_per_step: int,
                              counts: dict[str, int]) -> None:
    """Phase 7: no ledger, so in-flight groups cannot come back. Clear their partial
    payloads and recompute the shortfall of every stamped step above the anchor."""
    ledger_rows = tx.execute(select(func.count()).select_from(groups_t)).scalar_one()
    if ledger_rows:
        raise SnapshotInconsistent(f"{source}: run_meta says no ledger dispatch but the ledger holds {ledger_rows} "
                                   "group(s); restore another snapshot", 1)
    in_replay = select(replay_t.c.group_id)
    cleared = tx.execute(delete(samples_t).where(samples_t.c.group_id.not_in(in_replay))).rowcount
    cleared += tx.execute(delete(chunks_t)).rowcount + tx.execute(delete(episodes_t)).rowcount
    counts["payload_rows_cleared"] = cleared
    saved = pools.get_shortfall(tx)
    stamped = dict(tx.execute(
        select(replay_t.c.target_step, func.count()).where(replay_t.c.target_step.is_not(None)).group_by(replay_t.c.target_step)
    ).all())
    top = max([*saved, *stamped], default=step)
    for s in saved:
        if s <= step:
            pools.set_shortfall(tx, s, 0)  # a trained step needs nothing
    for s in range(step + 1, top + 1):
        pools.set_shortfall(tx, s, max(0, groups_per_step - stamped.get(s, 0)))


