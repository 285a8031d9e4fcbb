"""The recovery ledger's transitions, as functions over an open transaction.

Each function takes the connection `Store.atomic()` yields, so a pump can compose several
transitions into one cut. All of them are SQLAlchemy Core with executemany on the hot
paths. A transition that finds a row in the wrong state raises `IllegalTransition`
naming the group (or attempt) and both states, and the enclosing transaction rolls back.

Group states:    reserved -> dispatched -> sealed -> published -> trained
                 (`published` is the stored value for "in the replay buffer": the verb
                 is `enter_replay`; old files hold the value, so it stays)
                 any state before trained -> discarded (with a reason)
Rollout states:  running -> finished | abandoned (restart, deadline, error)
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from functools import lru_cache

from sqlalchemy import Connection, Integer, bindparam, case, delete, func, insert, literal_column, or_, select, type_coerce, update

from ..sqlite.prepared import Prepared, _driver, in_json, json_ids
from .compaction import FOLD_EVERY, KEEP_STEPS, fold_settled, settle_groups
from .codec import encode_logprobs, encode_tokens, encode_version_counts
from ..errors import IllegalTransition, ReplayFullError
from .schema import ABANDON_REASONS, T

groups = T["prompt_groups"]
rollouts = T["rollouts"]
samples = T["samples"]
replay = T["replay_groups"]
chunks = T["token_chunks"]
episodes = T["env_episodes"]
run_meta = T["run_meta"]

# Discard reasons the algorithm owns: a group discarded for one of these was settled by
# the algorithm's choice (GRPO learns nothing from a group whose rewards are all equal).
# A discard for any other reason is trained work lost; `verify_run` counts it so. The
# controller discards with these names; the store never imports the controller.
ZERO_REWARD_VARIANCE = "zero_reward_variance"
ALGORITHM_DISCARD_REASONS = frozenset({ZERO_REWARD_VARIANCE})
# The trace's reason for a group a resume from a trainer checkpoint alone withdrew
# (`withdraw_every_group`): it left the ledger untrained and its prompt went back to the
# spare pool, to be reserved again as a new group. Never a store discard (no settled row).
REWIND_WITHDRAWAL = "rewind"

# Which states each target state may be entered from.
GROUP_SOURCES = {
    "dispatched": ("reserved",),
    "sealed": ("dispatched",),
    "published": ("sealed",),
    "trained": ("published",),
    "discarded": ("reserved", "dispatched", "sealed", "published"),
}

def _qualified(column):
    """`table.column` as written text: in a RETURNING clause SQLAlchemy writes columns
    without their table, so a subquery there would read `group_id = group_id` (both
    the subquery's own column) instead of correlating with the updated row."""
    return literal_column(f"{column.table.name}.{column.name}", type_=column.type)


# Hot-path statements are built once with Core and compiled once (`Prepared`, see
# store/sqlite/prepared.py): building a Core statement per call and computing its cache
# key cost about three times as much as executing it, and SQLAlchemy's execution of a
# cached statement still cost 30-40 µs against 5-7 µs for sqlite3 running its text
# (bench/bench_transitions.py). Id lists are one JSON parameter (`in_json`, `json_ids`).
_SELECT_GROUP_STATES = Prepared(select(groups.c.group_id, groups.c.state).where(in_json(groups.c.group_id)))
# Per (group, generation): the last attempt number and whether any attempt is not abandoned.
_SELECT_ATTEMPT_HISTORY = Prepared(
    select(
        rollouts.c.group_id,
        rollouts.c.generation_index,
        func.max(rollouts.c.attempt),
        func.max(type_coerce(rollouts.c.state != "abandoned", Integer)),  # 0/1, not a bool
    )
    .where(in_json(rollouts.c.group_id))
    .group_by(rollouts.c.group_id, rollouts.c.generation_index)
)
# A restarted group's running attempts abandoned, through the UNIQUE (group_id, ...)
# index, in one statement that returns what the trace records of each.
_ABANDON_RUNNING_FOR_RESTART = Prepared(
    update(rollouts)
    .where(in_json(rollouts.c.group_id), rollouts.c.state == "running")
    .values(state=literal_column("'abandoned'"), abandon_reason=literal_column("'restart'"), ended_at=bindparam("now"))
    .returning(rollouts.c.attempt_id, rollouts.c.group_id, rollouts.c.generation_index, rollouts.c.attempt,
               rollouts.c.policy_version)
)
_SELECT_ATTEMPT_STATES = Prepared(select(rollouts.c.attempt_id, rollouts.c.state).where(in_json(rollouts.c.attempt_id)))
_END_ATTEMPTS = Prepared(
    update(rollouts)
    .where(in_json(rollouts.c.attempt_id), rollouts.c.state == "running")
    .values(state=bindparam("new_state"), abandon_reason=bindparam("reason"), ended_at=bindparam("now"))
    .returning(
        rollouts.c.attempt_id, rollouts.c.group_id, rollouts.c.generation_index,
        select(groups.c.prompt_id).where(_qualified(groups.c.group_id) == _qualified(rollouts.c.group_id)).scalar_subquery(),
    )
)
# Only `group_id` in WHERE: with `state = 'finished'` there too, SQLite picked the state
# index and read every finished rollout of the run's history for each seal (125 ms at
# 730k rows, measured for bench/bench_restore.py) instead of the groups' own rows.
# Groups with no rollout row at all come back with 0 (LEFT JOIN), next to their
# num_generations: one statement where there were two.
_SELECT_SEAL_COUNTS = Prepared(
    select(
        groups.c.group_id,
        groups.c.num_generations,
        func.coalesce(func.sum(case((rollouts.c.state == "finished", 1), else_=0)), 0),
    )
    .select_from(groups.outerjoin(rollouts, rollouts.c.group_id == groups.c.group_id))
    .where(in_json(groups.c.group_id))
    .group_by(groups.c.group_id)
)
_SELECT_CAPACITY = Prepared(select(run_meta.c.replay_capacity))
_SELECT_PERMITS = Prepared(select(replay.c.permit))


def _insert_from_json(table, columns: tuple[str, ...], common: dict, returning):
    """INSERT ... SELECT over a JSON array of rows (`:rows`, each row a JSON array in
    `columns` order), the `common` columns bound once, RETURNING `returning`: many rows
    and their new ids in one statement (sqlite3's executemany cannot return rows)."""
    rows = func.json_each(bindparam("rows")).table_valued("value")
    picked = [func.json_extract(rows.c.value, f"$[{i}]") for i in range(len(columns))]
    return Prepared(
        insert(table)
        .from_select([*columns, *common], select(*picked, *common.values()))
        .returning(*returning)
    )


# Rows come back in no promised order, so each carries its key.
_INSERT_GROUPS = _insert_from_json(
    groups,
    ("sample_seq", "epoch", "prompt_id"),
    {"num_generations": bindparam("num_generations"), "target_step": bindparam("target_step"),
     "state": literal_column("'reserved'"), "created_at": bindparam("now"), "updated_at": bindparam("now")},
    (groups.c.sample_seq, groups.c.group_id),
)
_INSERT_ROLLOUTS = _insert_from_json(
    rollouts,
    ("group_id", "generation_index", "attempt"),
    {"state": literal_column("'running'"), "policy_version": bindparam("policy_version"),
     "dispatched_at": bindparam("now")},
    (rollouts.c.group_id, rollouts.c.generation_index, rollouts.c.attempt, rollouts.c.attempt_id),
)
_SAMPLE_COLUMNS = ("group_id", "generation_index", "prompt_id", "num_tokens", "token_ids", "logprobs", "reward",
                   "policy_version", "version_token_counts", "created_at")
_INSERT_SAMPLES = Prepared(insert(samples).values({c: bindparam(c) for c in _SAMPLE_COLUMNS}))
_INSERT_REPLAY = Prepared(insert(replay).values({c.name: bindparam(c.name) for c in replay.c}))
_ATTEMPTS_OF_GROUPS = select(rollouts.c.attempt_id).where(in_json(rollouts.c.group_id)).scalar_subquery()
_DELETE_CHUNKS_OF_ATTEMPTS = Prepared(delete(chunks).where(in_json(chunks.c.attempt_id)))
_DELETE_EPISODES_OF_ATTEMPTS = Prepared(delete(episodes).where(in_json(episodes.c.attempt_id)))
_DROP_PAYLOADS = tuple(
    Prepared(stmt)
    for stmt in (
        delete(replay).where(in_json(replay.c.group_id)),
        delete(samples).where(in_json(samples.c.group_id)),
        delete(chunks).where(chunks.c.attempt_id.in_(_ATTEMPTS_OF_GROUPS)),
        delete(episodes).where(episodes.c.attempt_id.in_(_ATTEMPTS_OF_GROUPS)),
    )
)
_ABANDON_RUNNING_OF_GROUPS = Prepared(
    update(rollouts)
    .where(in_json(rollouts.c.group_id), rollouts.c.state == "running")
    .values(state=literal_column("'abandoned'"), abandon_reason=literal_column("'error'"), ended_at=bindparam("now"))
)


@lru_cache(maxsize=None)
def _move_statement(target: str, extra: tuple[str, ...], returning: tuple[str, ...] = ()) -> Prepared:
    """UPDATE moving the groups `ids` to `target` from its allowed sources, setting
    `updated_at` (`now`) and the `extra` columns (bound as `v_<column>`); returns each
    moved group's id and the `returning` values (`_RETURNABLE`)."""
    return Prepared(
        update(groups)
        .where(in_json(groups.c.group_id), or_(*(groups.c.state == s for s in GROUP_SOURCES[target])))
        .values(state=literal_column(f"'{target}'"), updated_at=bindparam("now"), **{k: bindparam(f"v_{k}") for k in extra})
        .returning(groups.c.group_id, *(_RETURNABLE[k] for k in returning))
    )


# What a move can hand back with the ids it moved, so the transition needs no SELECT of
# the rows it has just written (RETURNING may hold scalar subqueries).
_RETURNABLE = {
    "num_generations": groups.c.num_generations,
    "epoch": groups.c.epoch,
    "prompt_id": groups.c.prompt_id,
    "target_step": groups.c.target_step,
    "tokens": select(func.coalesce(func.sum(samples.c.num_tokens), 0))
    .where(_qualified(samples.c.group_id) == _qualified(groups.c.group_id)).scalar_subquery(),
}


@dataclass(frozen=True)
class Reservation:
    """A prompt the sampler handed out: its place in sampler order and dataset identity."""

    sample_seq: int
    epoch: int
    prompt_id: int


@dataclass(frozen=True)
class FinishedGeneration:
    """A finished call's payload, written as one `samples` row."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    reward: float
    # [(policy_version, token_count), ...] in decode order; see codec.version_runs.
    version_token_counts: Sequence[tuple[int, int]]


def _move_groups(
    conn: Connection, group_ids: Sequence[int], target: str, returning: tuple[str, ...] = (), **values
) -> list[tuple]:
    """Move every group in `group_ids` to `target`, or raise naming the first misfit.
    Returns (group id, *returning) per group, in no promised order."""
    if not group_ids:
        return []
    stmt = _move_statement(target, tuple(sorted(values)), returning)
    params = {"ids": json_ids(group_ids), "now": time.time(), **{f"v_{k}": v for k, v in values.items()}}
    # One UPDATE ... WHERE state IN (sources) checks and moves them all; it returns the
    # ids it moved, fewer than asked if any group is missing or in another state (a
    # repeated id moves once, so fewer too), and only then a SELECT names the misfit.
    # (The ids, not just the count: after the UPDATE the moved groups are in `target`
    # too, so only the ids tell them from a group that was there before.)
    moved = stmt.run(conn, params).fetchall()
    if len(moved) != len(group_ids):
        _raise_group_misfit(conn, group_ids, target, {row[0] for row in moved})
    return moved


def _raise_group_misfit(conn: Connection, group_ids: Sequence[int], target: str, moved: set[int]) -> None:
    """Name the first group the UPDATE did not move (its state is still what it was)."""
    misfits = [g for g in group_ids if g not in moved]
    found = group_states(conn, misfits)
    for g in misfits:
        state = found.get(g)
        if state is None:
            raise IllegalTransition(f"group {g}: no such group in the ledger (asked to become {target})")
        if state not in GROUP_SOURCES[target]:
            raise IllegalTransition(f"group {g}: cannot go from {state} to {target}")
    twice = next(g for g, n in Counter(group_ids).items() if n > 1)
    raise IllegalTransition(f"group {twice}: listed twice in one transition (asked to become {target})")


def group_states(conn: Connection, group_ids: Iterable[int]) -> dict[int, str]:
    return dict(_SELECT_GROUP_STATES.run(conn, {"ids": json_ids(group_ids)}).fetchall())


def reserve_groups(
    conn: Connection,
    reservations: Sequence[Reservation],
    *,
    num_generations: int,
    target_step: int | None,
) -> list[int]:
    """Record prompts handed out by the sampler as `reserved` groups; returns group ids
    in the same order. A prompt already in the ledger (same epoch and prompt id) is
    refused by the UNIQUE constraint: that is invariant 1 enforced by the schema."""
    if not reservations:
        return []
    params = {
        "rows": json_ids([[r.sample_seq, r.epoch, r.prompt_id] for r in reservations]),
        "num_generations": num_generations,
        "target_step": target_step,
        "now": time.time(),
    }
    by_seq = dict(_INSERT_GROUPS.run(conn, params).fetchall())
    return [by_seq[r.sample_seq] for r in reservations]


def dispatch_groups(conn: Connection, group_ids: Sequence[int], *, policy_version: int) -> list[int]:
    """reserved -> dispatched, with one running attempt (attempt 0) per generation.
    Returns the attempt ids, group by group, generation by generation."""
    n_by_group = dict(_move_groups(conn, group_ids, "dispatched", ("num_generations",), policy_version=policy_version))
    # A group leaves `reserved` only here or in dispatch_without_attempts and never comes
    # back, and attempts start only for dispatched groups: a group just moved from
    # reserved has no attempt yet, so each generation's is attempt 0 with no look at the
    # history `start_attempts` reads (the UNIQUE (group, generation, attempt) key would
    # refuse a second attempt 0 anyway).
    return _insert_attempts(conn, [(g, i, 0) for g in group_ids for i in range(n_by_group[g])], policy_version)


def dispatch_without_attempts(conn: Connection, group_ids: Sequence[int], *, policy_version: int) -> None:
    """reserved -> dispatched with no attempt: restart normalization hands every group
    back in one state, and the rollout pump starts its attempts (`start_attempts`)."""
    _move_groups(conn, group_ids, "dispatched", policy_version=policy_version)


def start_attempts(conn: Connection, generations: Sequence[tuple[int, int]], *, policy_version: int) -> list[int]:
    """A new running attempt for each (group id, generation index): attempt 0 the first
    time, one more than the last attempt after an abandon. Returns attempt ids in order."""
    if not generations:
        return []
    gids = json_ids(sorted({g for g, _ in generations}))
    history = _SELECT_ATTEMPT_HISTORY.run(conn, {"ids": gids}).fetchall()
    last = {(g, i): a for g, i, a, _ in history}
    live = {(g, i) for g, i, _, not_abandoned in history if not_abandoned}
    states = dict(_SELECT_GROUP_STATES.run(conn, {"ids": gids}).fetchall())
    rows = []
    for g, i in generations:
        if states.get(g) != "dispatched":
            raise IllegalTransition(f"group {g}: cannot start an attempt while {states.get(g, 'missing')} (needs dispatched)")
        if (g, i) in live:
            raise IllegalTransition(f"group {g} generation {i}: already has a running or finished attempt (a restored "
                                    "group's generations start again with ledger.restart_attempts)")
        rows.append((g, i, last.get((g, i), -1) + 1))
    return _insert_attempts(conn, rows, policy_version)


def restart_attempts(conn: Connection, generations: Sequence[tuple[int, int]], *,
                     policy_version: int) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """A restored group's generations started again: the attempts a restore left
    running for them (the stopped run's) become `abandoned` with reason `restart`, their
    saved chunks and episode go with them (invariant 3), and each generation gets a new
    running attempt (`start_attempts`), all in the caller's transaction. A group's
    generations are restarted together: a running attempt of a named group whose
    generation is not named is refused (IllegalTransition). Returns the new attempt ids
    in order and the attempts abandoned, as (group id, generation index, attempt, policy
    version), what the trace records.

    Why here and not at restore: restart normalization left every running attempt as
    it was, so its work does not grow with what was in flight (a 74k-attempt UPDATE was
    a third of a 50k-group restore, BENCHMARKS.md "A restore leaves the running
    attempts to their restart"); each is abandoned by the transaction that replaces it,
    which reads its group's rows by key anyway. Until then a snapshot still holds the
    saved progress, so a stop soon after a resume keeps it."""
    if not generations:
        return [], []
    wanted = set(generations)
    left = sorted(_ABANDON_RUNNING_FOR_RESTART.run(
        conn, {"ids": json_ids(sorted({g for g, _ in wanted})), "now": time.time()}).fetchall())
    if left:
        stray = next((row for row in left if (row[1], row[2]) not in wanted), None)
        if stray is not None:  # the whole transaction rolls back
            raise IllegalTransition(f"group {stray[1]} generation {stray[2]}: attempt {stray[3]} is running and was not "
                                    "named for restart (a restored group restarts all its running generations at once)")
        _drop_attempt_payloads(conn, {"ids": json_ids([row[0] for row in left])})
    return start_attempts(conn, generations, policy_version=policy_version), [tuple(row[1:]) for row in left]


def _insert_attempts(conn: Connection, rows: list[tuple[int, int, int]], policy_version: int) -> list[int]:
    """Running attempts for (group id, generation index, attempt); their ids in order."""
    params = {"rows": json_ids(rows), "policy_version": policy_version, "now": time.time()}
    found = {(g, i, a): aid for g, i, a, aid in _INSERT_ROLLOUTS.run(conn, params).fetchall()}
    return [found[r] for r in rows]


def _end_attempts(conn: Connection, attempt_ids: Sequence[int], state: str, reason: str | None) -> list[tuple]:
    """End running attempts, or raise naming the first misfit; returns (attempt id,
    group id, generation index, prompt id) per attempt, in no promised order."""
    params = {"ids": json_ids(attempt_ids), "new_state": state, "reason": reason, "now": time.time()}
    ended = _END_ATTEMPTS.run(conn, params).fetchall()
    if len(ended) != len(attempt_ids):  # name the first attempt not ended (see _move_groups)
        done = {row[0] for row in ended}
        misfits = [a for a in attempt_ids if a not in done]
        found = dict(_SELECT_ATTEMPT_STATES.run(conn, {"ids": json_ids(misfits)}).fetchall())
        for a in misfits:
            if found.get(a) != "running":
                raise IllegalTransition(f"attempt {a}: cannot go from {found.get(a, 'missing')} to {state}")
        twice = next(a for a, n in Counter(attempt_ids).items() if n > 1)
        raise IllegalTransition(f"attempt {twice}: listed twice in one transition (asked to become {state})")
    return ended


def finish_attempts(conn: Connection, finished: Sequence[tuple[int, FinishedGeneration]]) -> None:
    """running -> finished, writing each generation's sample row in the same cut."""
    if not finished:
        return
    ids = [a for a, _ in finished]
    info = {aid: (g, i, pid) for aid, g, i, pid in _end_attempts(conn, ids, "finished", None)}
    write_samples(conn, [(info[a][0], info[a][1], info[a][2], gen) for a, gen in finished])
    _drop_attempt_payloads(conn, {"ids": json_ids(ids)})


def _drop_attempt_payloads(conn: Connection, ids: dict[str, str]) -> None:
    """An attempt that is no longer running keeps no prefix chunks and no environment
    episode (invariant 3). A restart that continues from a prefix reads the chunks
    before it abandons the attempt. `ids`: {"ids": json_ids(attempt ids)}."""
    _DELETE_CHUNKS_OF_ATTEMPTS.run(conn, ids)
    _DELETE_EPISODES_OF_ATTEMPTS.run(conn, ids)


def write_samples(conn: Connection, rows: Sequence[tuple[int, int, int, FinishedGeneration]]) -> None:
    """Insert `samples` rows: (group id, generation index, prompt id, generation).
    Used directly by no-ledger dispatch, where there are no attempt rows."""
    if not rows:
        return
    now = time.time()
    _INSERT_SAMPLES.many(
        conn,
        [
            {
                "group_id": g,
                "generation_index": i,
                "prompt_id": pid,
                "num_tokens": len(gen.token_ids),
                "token_ids": encode_tokens(gen.token_ids),
                "logprobs": encode_logprobs(gen.logprobs),
                "reward": float(gen.reward),
                "policy_version": gen.version_token_counts[0][0] if gen.version_token_counts else 0,
                "version_token_counts": encode_version_counts(gen.version_token_counts),
                "created_at": now,
            }
            for g, i, pid, gen in rows
        ],
    )


def abandon_attempts(conn: Connection, attempt_ids: Sequence[int], reason: str) -> None:
    """running -> abandoned(reason). The group stays dispatched; start a new attempt."""
    if reason not in ABANDON_REASONS:
        raise ValueError(f"abandon reason {reason!r} unknown; use one of {', '.join(ABANDON_REASONS)}")
    if attempt_ids:
        _end_attempts(conn, attempt_ids, "abandoned", reason)
        _drop_attempt_payloads(conn, {"ids": json_ids(attempt_ids)})


def require_every_generation_finished(conn: Connection, group_ids: Sequence[int], doing: str) -> None:
    """IllegalTransition naming the first group with a generation not finished (`doing`:
    what needs them all, for the message)."""
    if not group_ids:
        return
    for g, need, done in _SELECT_SEAL_COUNTS.run(conn, {"ids": json_ids(group_ids)}).fetchall():
        if done != need:
            raise IllegalTransition(f"group {g}: cannot {doing} with {done} of {need} generations finished")


def seal_groups(conn: Connection, group_ids: Sequence[int]) -> None:
    """dispatched -> sealed, only once every generation has a finished attempt."""
    if not group_ids:
        return
    require_every_generation_finished(conn, group_ids, "seal")
    _move_groups(conn, group_ids, "sealed")


def _free_permits(conn: Connection, n: int) -> list[int]:
    (capacity,) = _SELECT_CAPACITY.run(conn).fetchone()
    taken = {p for (p,) in _SELECT_PERMITS.run(conn).fetchall()}
    # The lowest free permits; stops after n, rather than walking the whole capacity.
    free = list(itertools.islice((p for p in range(capacity) if p not in taken), n))
    if len(free) < n:
        raise ReplayFullError(
            f"replay buffer full: {len(taken)} of {capacity} permits taken; train or discard a group first"
        )
    return free


def enter_replay(conn: Connection, group_ids: Sequence[int]) -> list[int]:
    """sealed -> published: each group enters the replay buffer holding one capacity
    permit. Returns the permits. (The state value keeps its old word, `published`:
    every store and snapshot file holds it.)"""
    if not group_ids:
        return []
    moved = _move_groups(conn, group_ids, "published", ("epoch", "prompt_id", "target_step", "tokens"))
    info = {g: (e, p, s, n) for g, e, p, s, n in moved}
    return insert_replay(conn, [(g, *info[g]) for g in group_ids])


def insert_replay(conn: Connection, rows: Sequence[tuple[int, int, int, int | None, int]]) -> list[int]:
    """Add (group id, epoch, prompt id, target step, tokens) to the replay buffer, one
    permit each. Used directly by no-ledger dispatch."""
    permits = _free_permits(conn, len(rows))
    now = time.time()
    _INSERT_REPLAY.many(
        conn,
        [
            {"group_id": g, "permit": p, "epoch": e, "prompt_id": pid, "target_step": s, "num_tokens": n, "published_at": now}
            for (g, e, pid, s, n), p in zip(rows, permits)
        ],
    )
    return permits


def _drop_payloads(conn: Connection, group_ids: Sequence[int]) -> None:
    ids = {"ids": json_ids(group_ids)}
    for stmt in _DROP_PAYLOADS:
        stmt.run(conn, ids)


def mark_trained(conn: Connection, group_ids: Sequence[int], *, step: int, keep_steps: int = KEEP_STEPS) -> None:
    """published -> trained: releases the replay permits and drops the payloads; the
    groups then leave the ledger for `settled_steps` (compaction.py). Every FOLD_EVERY
    steps the record's rows older than `keep_steps` steps fold into `settled_prefix`
    (`compaction.fold_settled`), so the record stays bounded by `keep_steps`."""
    if not group_ids:
        return
    _move_groups(conn, group_ids, "trained", trained_step=step)
    _drop_payloads(conn, group_ids)
    settle_groups(conn, group_ids)
    if step % FOLD_EVERY == 0 and step > keep_steps:
        fold_settled(_driver(conn), through_step=step - keep_steps)


def release_replay(conn: Connection, group_ids: Sequence[int]) -> None:
    """No-ledger counterpart of `mark_trained`: drop replay rows and payloads."""
    _drop_payloads(conn, group_ids)


def discard_groups(conn: Connection, group_ids: Sequence[int], *, reason: str) -> None:
    """Any state before trained -> discarded(reason): running attempts are abandoned
    with reason `error`, payloads dropped and the replay permit released; the groups
    then leave the ledger for `settled_steps` (compaction.py)."""
    if not group_ids:
        return
    if not reason:
        raise ValueError("a discard needs a reason, e.g. 'zero_reward_variance'")
    _move_groups(conn, group_ids, "discarded", discard_reason=reason)
    _ABANDON_RUNNING_OF_GROUPS.run(conn, {"ids": json_ids(group_ids), "now": time.time()})
    _drop_payloads(conn, group_ids)
    settle_groups(conn, group_ids)


def withdraw_every_group(conn: Connection) -> tuple[list[Reservation], list[tuple], list[tuple]]:
    """Every ledger row leaves unsettled, with its attempts, its payload and its replay
    permit: a resume from a trainer checkpoint alone (restore/rewind.py) hands these
    positions out again, because what they hold was decoded or trained under weights
    newer than the checkpoint. Returns their reservations (in sampler order, for the
    spare pool); the groups as (group_id, prompt_id, target_step, policy_version) and
    their running attempts as (group_id, prompt_id, generation_index, attempt,
    target_step, policy_version): what the trace records as withdrawn and abandoned.
    Every payload row belongs to a live ledger row (invariant 3), so with the ledger
    gone the payload tables are emptied whole: a few statements, not one per group."""
    rows = conn.execute(select(groups.c.sample_seq, groups.c.epoch, groups.c.prompt_id, groups.c.group_id,
                               groups.c.target_step, groups.c.policy_version).order_by(groups.c.sample_seq)).all()
    held = [Reservation(s, e, p) for s, e, p, *_ in rows]
    withdrawn = [(g, p, step, version) for _, _, p, g, step, version in rows]
    running = [tuple(r) for r in conn.execute(
        select(rollouts.c.group_id, groups.c.prompt_id, rollouts.c.generation_index, rollouts.c.attempt,
               groups.c.target_step, rollouts.c.policy_version)
        .join(groups, groups.c.group_id == rollouts.c.group_id)
        .where(rollouts.c.state == "running").order_by(rollouts.c.attempt_id)).all()]
    for table in (chunks, episodes, replay, samples, rollouts, groups):
        conn.execute(delete(table))
    return held, withdrawn, running
