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

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from functools import lru_cache

from sqlalchemy import Connection, bindparam, case, delete, func, insert, or_, select, update

from .codec import encode_logprobs, encode_tokens, encode_version_counts
from ..errors import IllegalTransition, ReplayFullError
from .schema import ABANDON_REASONS, T

groups = T["prompt_groups"]
rollouts = T["rollouts"]
samples = T["samples"]
replay = T["replay_groups"]
finalizers = T["finalizer_results"]
chunks = T["token_chunks"]
episodes = T["env_episodes"]
run_meta = T["run_meta"]

# Discard reasons the algorithm owns: a group discarded for one of these was settled by
# the algorithm's choice (GRPO learns nothing from a group whose rewards are all equal).
# A discard for any other reason is trained work lost; `verify_run` counts it so. The
# controller discards with these names; the store never imports the controller.
ZERO_REWARD_VARIANCE = "zero_reward_variance"
ALGORITHM_DISCARD_REASONS = frozenset({ZERO_REWARD_VARIANCE})

# Which states each target state may be entered from.
GROUP_SOURCES = {
    "dispatched": ("reserved",),
    "sealed": ("dispatched",),
    "published": ("sealed",),
    "trained": ("published",),
    "discarded": ("reserved", "dispatched", "sealed", "published"),
}

# Hot-path statements are built once, with bind parameters (IN lists as expanding
# parameters): building a Core statement per call and computing its cache key cost
# about three times as much as executing it (measured by bench/bench_transitions.py,
# where it kept a one-transition transaction above 1 ms at p99).
_IDS = bindparam("ids", expanding=True)
_IN_CHUNK = 10_000
_SELECT_GROUP_STATES = select(groups.c.group_id, groups.c.state).where(groups.c.group_id.in_(_IDS))
_SELECT_NUM_GENERATIONS = select(groups.c.group_id, groups.c.num_generations).where(groups.c.group_id.in_(_IDS))
# Per (group, generation): the last attempt number and whether any attempt is not abandoned.
_SELECT_ATTEMPT_HISTORY = (
    select(
        rollouts.c.group_id,
        rollouts.c.generation_index,
        func.max(rollouts.c.attempt),
        func.max(rollouts.c.state != "abandoned"),
    )
    .where(rollouts.c.group_id.in_(_IDS))
    .group_by(rollouts.c.group_id, rollouts.c.generation_index)
)
_SELECT_ATTEMPT_STATES = select(rollouts.c.attempt_id, rollouts.c.state).where(rollouts.c.attempt_id.in_(_IDS))
_SELECT_ATTEMPT_INFO = (
    select(rollouts.c.attempt_id, rollouts.c.group_id, rollouts.c.generation_index, groups.c.prompt_id)
    .join(groups, groups.c.group_id == rollouts.c.group_id)
    .where(rollouts.c.attempt_id.in_(_IDS))
)
_END_ATTEMPTS = (
    update(rollouts)
    .where(rollouts.c.attempt_id.in_(_IDS), rollouts.c.state == "running")
    .values(state=bindparam("new_state"), abandon_reason=bindparam("reason"), ended_at=bindparam("now"))
)
# Only `group_id` in WHERE: with `state = 'finished'` there too, SQLite picked the state
# index and read every finished rollout of the run's history for each seal (125 ms at
# 730k rows, measured for bench/bench_restore.py) instead of the groups' own rows.
_SELECT_FINISHED_COUNTS = (
    select(rollouts.c.group_id, func.sum(case((rollouts.c.state == "finished", 1), else_=0)))
    .where(rollouts.c.group_id.in_(_IDS))
    .group_by(rollouts.c.group_id)
)
_SELECT_CAPACITY = select(run_meta.c.replay_capacity)
_SELECT_PERMITS = select(replay.c.permit)
_SELECT_REPLAY_INFO = select(groups.c.group_id, groups.c.epoch, groups.c.prompt_id, groups.c.target_step).where(
    groups.c.group_id.in_(_IDS)
)
_SELECT_GROUP_TOKENS = (
    select(samples.c.group_id, func.sum(samples.c.num_tokens)).where(samples.c.group_id.in_(_IDS)).group_by(samples.c.group_id)
)
# RETURNING (SQLite >= 3.35) hands back the new ids with the insert, one statement
# instead of an INSERT and a SELECT; rows come back in no promised order, so each carries
# its key.
_INSERT_GROUPS = insert(groups).returning(groups.c.sample_seq, groups.c.group_id)
_INSERT_ROLLOUTS = insert(rollouts).returning(
    rollouts.c.group_id, rollouts.c.generation_index, rollouts.c.attempt, rollouts.c.attempt_id
)
_INSERT_SAMPLES = insert(samples)
_INSERT_REPLAY = insert(replay)
_ATTEMPTS_OF_GROUPS = select(rollouts.c.attempt_id).where(rollouts.c.group_id.in_(_IDS)).scalar_subquery()
_DELETE_CHUNKS_OF_ATTEMPTS = delete(chunks).where(chunks.c.attempt_id.in_(_IDS))
_DELETE_EPISODES_OF_ATTEMPTS = delete(episodes).where(episodes.c.attempt_id.in_(_IDS))
_DROP_PAYLOADS = (
    delete(replay).where(replay.c.group_id.in_(_IDS)),
    delete(samples).where(samples.c.group_id.in_(_IDS)),
    delete(finalizers).where(finalizers.c.group_id.in_(_IDS)),
    delete(chunks).where(chunks.c.attempt_id.in_(_ATTEMPTS_OF_GROUPS)),
    delete(episodes).where(episodes.c.attempt_id.in_(_ATTEMPTS_OF_GROUPS)),
)


@lru_cache(maxsize=None)
def _move_statement(target: str, extra: tuple[str, ...]):
    """UPDATE moving the groups `ids` to `target` from its allowed sources, setting
    `updated_at` (`now`) and the `extra` columns (bound as `v_<column>`)."""
    return (
        update(groups)
        .where(groups.c.group_id.in_(_IDS), or_(*(groups.c.state == s for s in GROUP_SOURCES[target])))
        .values(state=target, updated_at=bindparam("now"), **{k: bindparam(f"v_{k}") for k in extra})
    )


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


def _move_groups(conn: Connection, group_ids: Sequence[int], target: str, **values) -> None:
    """Move every group in `group_ids` to `target`, or raise naming the first misfit."""
    if not group_ids:
        return
    stmt = _move_statement(target, tuple(sorted(values)))
    common = {"now": time.time(), **{f"v_{k}": v for k, v in values.items()}}
    if _update_in_chunks(conn, stmt, group_ids, common) != len(group_ids):
        _raise_group_misfit(conn, group_ids, target)


def _update_in_chunks(conn: Connection, stmt, ids: Sequence[int], params: dict) -> int:
    """Run an UPDATE ... WHERE id IN (:ids) over `ids`; returns the rows changed. One
    statement per chunk rather than an executemany of one row per id (which spent most
    of a batched transition in per-row parameter handling); chunks stay well below
    SQLite's limit on bound variables. A repeated id changes its row once, so the
    count comes up short and the caller names the misfit."""
    ids = list(ids)
    return sum(conn.execute(stmt, {"ids": ids[i : i + _IN_CHUNK], **params}).rowcount for i in range(0, len(ids), _IN_CHUNK))


def _raise_group_misfit(conn: Connection, group_ids: Sequence[int], target: str) -> None:
    found = group_states(conn, group_ids)
    for g in group_ids:
        state = found.get(g)
        if state is None:
            raise IllegalTransition(f"group {g}: no such group in the ledger (asked to become {target})")
        if state not in GROUP_SOURCES[target]:
            raise IllegalTransition(f"group {g}: cannot go from {state} to {target}")
    raise IllegalTransition(f"groups {list(group_ids)}: a group id is listed twice (asked to become {target})")


def group_states(conn: Connection, group_ids: Iterable[int]) -> dict[int, str]:
    return dict(conn.execute(_SELECT_GROUP_STATES, {"ids": list(group_ids)}).all())


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
    now = time.time()
    rows = [
        {
            "sample_seq": r.sample_seq,
            "epoch": r.epoch,
            "prompt_id": r.prompt_id,
            "num_generations": num_generations,
            "target_step": target_step,
            "state": "reserved",
            "created_at": now,
            "updated_at": now,
        }
        for r in reservations
    ]
    by_seq = dict(conn.execute(_INSERT_GROUPS, rows).all())
    return [by_seq[r.sample_seq] for r in reservations]


def dispatch_groups(conn: Connection, group_ids: Sequence[int], *, policy_version: int) -> list[int]:
    """reserved -> dispatched, with one running attempt (attempt 0) per generation.
    Returns the attempt ids, group by group, generation by generation."""
    _move_groups(conn, group_ids, "dispatched", policy_version=policy_version)
    n_by_group = dict(conn.execute(_SELECT_NUM_GENERATIONS, {"ids": list(group_ids)}).all())
    wanted = [(g, i) for g in group_ids for i in range(n_by_group[g])]
    return start_attempts(conn, wanted, policy_version=policy_version)


def dispatch_without_attempts(conn: Connection, group_ids: Sequence[int], *, policy_version: int) -> None:
    """reserved -> dispatched with no attempt: restart normalization hands every group
    back in one state, and the rollout pump starts its attempts (`start_attempts`)."""
    _move_groups(conn, group_ids, "dispatched", policy_version=policy_version)


def start_attempts(conn: Connection, generations: Sequence[tuple[int, int]], *, policy_version: int) -> list[int]:
    """A new running attempt for each (group id, generation index): attempt 0 the first
    time, one more than the last attempt after an abandon. Returns attempt ids in order."""
    if not generations:
        return []
    gids = sorted({g for g, _ in generations})
    history = conn.execute(_SELECT_ATTEMPT_HISTORY, {"ids": gids}).all()
    last = {(g, i): a for g, i, a, _ in history}
    live = {(g, i) for g, i, _, not_abandoned in history if not_abandoned}
    states = group_states(conn, gids)
    now = time.time()
    rows = []
    for g, i in generations:
        if states.get(g) != "dispatched":
            raise IllegalTransition(f"group {g}: cannot start an attempt while {states.get(g, 'missing')} (needs dispatched)")
        if (g, i) in live:
            raise IllegalTransition(f"group {g} generation {i}: already has a running or finished attempt")
        rows.append(
            {
                "group_id": g,
                "generation_index": i,
                "attempt": last.get((g, i), -1) + 1,
                "state": "running",
                "policy_version": policy_version,
                "dispatched_at": now,
            }
        )
    found = {(g, i, a): aid for g, i, a, aid in conn.execute(_INSERT_ROLLOUTS, rows).all()}
    return [found[(r["group_id"], r["generation_index"], r["attempt"])] for r in rows]


def _end_attempts(conn: Connection, attempt_ids: Sequence[int], state: str, reason: str | None) -> None:
    common = {"new_state": state, "reason": reason, "now": time.time()}
    if _update_in_chunks(conn, _END_ATTEMPTS, attempt_ids, common) != len(attempt_ids):
        found = dict(conn.execute(_SELECT_ATTEMPT_STATES, {"ids": list(attempt_ids)}).all())
        for a in attempt_ids:
            if found.get(a) != "running":
                raise IllegalTransition(f"attempt {a}: cannot go from {found.get(a, 'missing')} to {state}")
        raise IllegalTransition(f"attempts {list(attempt_ids)}: an attempt id is listed twice")


def finish_attempts(conn: Connection, finished: Sequence[tuple[int, FinishedGeneration]]) -> None:
    """running -> finished, writing each generation's sample row in the same cut."""
    if not finished:
        return
    ids = [a for a, _ in finished]
    _end_attempts(conn, ids, "finished", None)
    info = {aid: (g, i, pid) for aid, g, i, pid in conn.execute(_SELECT_ATTEMPT_INFO, {"ids": ids}).all()}
    write_samples(conn, [(info[a][0], info[a][1], info[a][2], gen) for a, gen in finished])
    _drop_attempt_payloads(conn, ids)


def _drop_attempt_payloads(conn: Connection, attempt_ids: list[int]) -> None:
    """An attempt that is no longer running keeps no prefix chunks and no environment
    episode (invariant 3). A restart that continues from a prefix reads the chunks
    before it abandons the attempt."""
    conn.execute(_DELETE_CHUNKS_OF_ATTEMPTS, {"ids": attempt_ids})
    conn.execute(_DELETE_EPISODES_OF_ATTEMPTS, {"ids": attempt_ids})


def write_samples(conn: Connection, rows: Sequence[tuple[int, int, int, FinishedGeneration]]) -> None:
    """Insert `samples` rows: (group id, generation index, prompt id, generation).
    Used directly by no-ledger dispatch, where there are no attempt rows."""
    if not rows:
        return
    now = time.time()
    conn.execute(
        _INSERT_SAMPLES,
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
        _drop_attempt_payloads(conn, list(attempt_ids))


def abandon_every_running_attempt(conn: Connection, reason: str) -> int:
    """What `abandon_attempts(conn, <every running attempt>, reason)` does, as three
    statements over the whole table; returns how many were abandoned. Restart
    normalization abandons *every* running attempt, and passing 72k attempt ids through
    IN lists took 0.7 s of a 100k-group restore (bench/bench_restore.py) where these
    take a fraction of it."""
    if reason not in ABANDON_REASONS:
        raise ValueError(f"abandon reason {reason!r} unknown; use one of {', '.join(ABANDON_REASONS)}")
    running = select(rollouts.c.attempt_id).where(rollouts.c.state == "running")
    conn.execute(delete(chunks).where(chunks.c.attempt_id.in_(running)))
    conn.execute(delete(episodes).where(episodes.c.attempt_id.in_(running)))
    return conn.execute(
        update(rollouts).where(rollouts.c.state == "running")
        .values(state="abandoned", abandon_reason=reason, ended_at=time.time())
    ).rowcount


def seal_groups(conn: Connection, group_ids: Sequence[int]) -> None:
    """dispatched -> sealed, only once every generation has a finished attempt."""
    if not group_ids:
        return
    done = dict(conn.execute(_SELECT_FINISHED_COUNTS, {"ids": list(group_ids)}).all())
    need = dict(conn.execute(_SELECT_NUM_GENERATIONS, {"ids": list(group_ids)}).all())
    for g in group_ids:
        if g in need and done.get(g, 0) != need[g]:
            raise IllegalTransition(f"group {g}: cannot seal with {done.get(g, 0)} of {need[g]} generations finished")
    _move_groups(conn, group_ids, "sealed")


def _free_permits(conn: Connection, n: int) -> list[int]:
    capacity = conn.execute(_SELECT_CAPACITY).scalar_one()
    taken = set(conn.execute(_SELECT_PERMITS).scalars())
    free = [p for p in range(capacity) if p not in taken][:n]
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
    _move_groups(conn, group_ids, "published")
    ids = {"ids": list(group_ids)}
    info = {g: (e, p, s) for g, e, p, s in conn.execute(_SELECT_REPLAY_INFO, ids).all()}
    tokens = dict(conn.execute(_SELECT_GROUP_TOKENS, ids).all())
    return insert_replay(conn, [(g, *info[g], tokens.get(g, 0)) for g in group_ids])


def insert_replay(conn: Connection, rows: Sequence[tuple[int, int, int, int | None, int]]) -> list[int]:
    """Add (group id, epoch, prompt id, target step, tokens) to the replay buffer, one
    permit each. Used directly by no-ledger dispatch."""
    permits = _free_permits(conn, len(rows))
    now = time.time()
    conn.execute(
        _INSERT_REPLAY,
        [
            {"group_id": g, "permit": p, "epoch": e, "prompt_id": pid, "target_step": s, "num_tokens": n, "published_at": now}
            for (g, e, pid, s, n), p in zip(rows, permits)
        ],
    )
    return permits


def _drop_payloads(conn: Connection, group_ids: Sequence[int]) -> None:
    ids = {"ids": list(group_ids)}
    for stmt in _DROP_PAYLOADS:
        conn.execute(stmt, ids)


def mark_trained(conn: Connection, group_ids: Sequence[int], *, step: int) -> None:
    """published -> trained: releases the replay permits and drops the payloads."""
    if not group_ids:
        return
    _move_groups(conn, group_ids, "trained", trained_step=step)
    _drop_payloads(conn, group_ids)


def release_replay(conn: Connection, group_ids: Sequence[int]) -> None:
    """No-ledger counterpart of `mark_trained`: drop replay rows and payloads."""
    _drop_payloads(conn, group_ids)


def discard_groups(conn: Connection, group_ids: Sequence[int], *, reason: str) -> None:
    """Any state before trained -> discarded(reason): running attempts are abandoned
    with reason `error`, payloads dropped and the replay permit released."""
    if not group_ids:
        return
    if not reason:
        raise ValueError("a discard needs a reason, e.g. 'zero_reward_variance'")
    _move_groups(conn, group_ids, "discarded", discard_reason=reason)
    conn.execute(
        update(rollouts)
        .where(rollouts.c.group_id.in_(group_ids), rollouts.c.state == "running")
        .values(state="abandoned", abandon_reason="error", ended_at=time.time())
    )
    _drop_payloads(conn, group_ids)
