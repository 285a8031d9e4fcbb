"""Runtime state beside the ledger: sampler cursor, spare-prompt pool, per-step shortfall,
finalizer results, prefix chunks and environment episodes. Functions over an open
transaction, like `ledger.py`."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, bindparam, delete, insert, select, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from .codec import decode_tokens, encode_tokens
from ..errors import IllegalTransition
from .ledger import Reservation
from .schema import T

sampler = T["sampler_state"]
spare = T["spare_prompts"]
shortfall = T["step_shortfall"]
finalizers = T["finalizer_results"]
chunks = T["token_chunks"]
episodes = T["env_episodes"]
rollouts = T["rollouts"]

# Built once: the cursor is read and advanced in every reserve transaction, and building
# a Core statement per call costs more than running it (see ledger.py).
_READ_CURSOR = select(sampler.c.next_seq, sampler.c.epoch, sampler.c.seed, sampler.c.stamping)
_ADVANCE_CURSOR = update(sampler).values(next_seq=bindparam("to_seq"), epoch=bindparam("to_epoch"))


# ---------------------------------------------------------------- sampler cursor


@dataclass(frozen=True)
class Cursor:
    next_seq: int
    epoch: int
    seed: int
    stamping: str


def read_cursor(conn: Connection) -> Cursor:
    row = conn.execute(_READ_CURSOR).one()
    return Cursor(*row)


def advance_cursor(conn: Connection, next_seq: int, epoch: int) -> None:
    """Record that the sampler has handed out every prompt below `next_seq`. The cursor
    never moves back: a restore relies on it covering every saved group."""
    current = read_cursor(conn)
    if next_seq < current.next_seq:
        raise IllegalTransition(f"sampler cursor: cannot move back from {current.next_seq} to {next_seq}")
    conn.execute(_ADVANCE_CURSOR, {"to_seq": next_seq, "to_epoch": epoch})


# ---------------------------------------------------------------- spare pool


def push_spare(conn: Connection, prompts: Sequence[Reservation]) -> None:
    if prompts:
        now = time.time()
        conn.execute(
            insert(spare),
            [{"sample_seq": p.sample_seq, "epoch": p.epoch, "prompt_id": p.prompt_id, "added_at": now} for p in prompts],
        )


def pop_spare(conn: Connection, n: int) -> list[Reservation]:
    """Take up to `n` spare prompts, oldest (lowest sampler position) first."""
    rows = conn.execute(
        select(spare.c.sample_seq, spare.c.epoch, spare.c.prompt_id).order_by(spare.c.sample_seq).limit(n)
    ).all()
    if rows:
        conn.execute(delete(spare).where(spare.c.sample_seq.in_([r[0] for r in rows])))
    return [Reservation(*r) for r in rows]


# ---------------------------------------------------------------- shortfall


def set_shortfall(conn: Connection, step: int, needed: int) -> None:
    """Set how many groups `step` still needs; 0 removes the row."""
    if needed < 0:
        raise ValueError(f"step {step}: shortfall cannot be negative ({needed})")
    if needed == 0:
        conn.execute(delete(shortfall).where(shortfall.c.step == step))
        return
    stmt = sqlite_insert(shortfall).values(step=step, needed=needed)
    conn.execute(stmt.on_conflict_do_update(index_elements=["step"], set_={"needed": needed}))


def add_shortfall(conn: Connection, step: int, delta: int) -> int:
    """Change a step's shortfall by `delta`; returns the new value."""
    new = get_shortfall(conn).get(step, 0) + delta
    set_shortfall(conn, step, new)
    return new


def get_shortfall(conn: Connection) -> dict[int, int]:
    return dict(conn.execute(select(shortfall.c.step, shortfall.c.needed)).all())


# ---------------------------------------------------------------- finalizer results
# No writer in this version: the restore and invariant 3 already handle the table (tests
# fill it through `put_finalizer_result`); a per-group finalizer writes it when one lands.


def put_finalizer_result(conn: Connection, group_id: int, payload: dict) -> None:
    stmt = sqlite_insert(finalizers).values(group_id=group_id, payload=json.dumps(payload), created_at=time.time())
    conn.execute(stmt.on_conflict_do_update(index_elements=["group_id"], set_={"payload": stmt.excluded.payload}))


def get_finalizer_result(conn: Connection, group_id: int) -> dict | None:
    text = conn.execute(select(finalizers.c.payload).where(finalizers.c.group_id == group_id)).scalar()
    return None if text is None else json.loads(text)


# ---------------------------------------------------------------- prefix chunks
# Written and deleted by prefix recovery (W2-C); today only the restore reads them
# (`read_chunks`) and tests write them. Kept: the restore's handling of chunks is tested
# through these, and W2-C wires `add_chunk`/`delete_chunks` into the cut and the finish.


@dataclass(frozen=True)
class Chunk:
    attempt_id: int
    chunk_index: int
    prefix_count: int
    token_ids: list[int]
    max_tokens: int
    min_tokens: int
    policy_version: int


def add_chunk(
    conn: Connection,
    attempt_id: int,
    token_ids: Sequence[int],
    *,
    prefix_count: int,
    max_tokens: int,
    min_tokens: int,
    policy_version: int,
) -> int:
    """Save the tokens a running call decoded since its last chunk. `prefix_count` is
    how many tokens earlier chunks hold; max/min tokens are the call's original limits."""
    index = conn.execute(select(chunks.c.chunk_index).where(chunks.c.attempt_id == attempt_id).order_by(chunks.c.chunk_index.desc()).limit(1)).scalar()
    index = 0 if index is None else index + 1
    conn.execute(
        insert(chunks).values(
            attempt_id=attempt_id,
            chunk_index=index,
            prefix_count=prefix_count,
            token_ids=encode_tokens(token_ids),
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            policy_version=policy_version,
            created_at=time.time(),
        )
    )
    return index


def read_chunks(conn: Connection, attempt_id: int) -> list[Chunk]:
    rows = conn.execute(
        select(
            chunks.c.attempt_id, chunks.c.chunk_index, chunks.c.prefix_count, chunks.c.token_ids,
            chunks.c.max_tokens, chunks.c.min_tokens, chunks.c.policy_version,
        )
        .where(chunks.c.attempt_id == attempt_id)
        .order_by(chunks.c.chunk_index)
    ).all()
    return [Chunk(a, i, p, decode_tokens(t).tolist(), mx, mn, v) for a, i, p, t, mx, mn, v in rows]


def delete_chunks(conn: Connection, attempt_ids: Sequence[int]) -> None:
    conn.execute(delete(chunks).where(chunks.c.attempt_id.in_(list(attempt_ids))))


# ---------------------------------------------------------------- environment episodes
# Written by turn recovery (W2-B, streaming rollouts: an episode's state at the cut);
# today only the restore reads them (`read_episodes`) and tests write them.


def episode_key(group_id: int, generation_index: int, attempt: int) -> str:
    """The backend-neutral row key of an environment episode: `<rollout id>-a<attempt>`."""
    return f"{group_id}.{generation_index}-a{attempt}"


def put_episode(conn: Connection, attempt_id: int, *, turn: int, state: dict) -> str:
    g, i, a = conn.execute(
        select(rollouts.c.group_id, rollouts.c.generation_index, rollouts.c.attempt).where(rollouts.c.attempt_id == attempt_id)
    ).one()
    key = episode_key(g, i, a)
    stmt = sqlite_insert(episodes).values(
        episode_key=key, attempt_id=attempt_id, turn=turn, state=json.dumps(state), updated_at=time.time()
    )
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["episode_key"],
            set_={"turn": stmt.excluded.turn, "state": stmt.excluded.state, "updated_at": stmt.excluded.updated_at},
        )
    )
    return key


def read_episodes(conn: Connection) -> dict[str, tuple[int, int, dict]]:
    """episode key -> (attempt id, turn, state)."""
    return {
        k: (a, t, json.loads(s))
        for k, a, t, s in conn.execute(select(episodes.c.episode_key, episodes.c.attempt_id, episodes.c.turn, episodes.c.state)).all()
    }


# TEMP SHIM (lead, replaced by the w2b-store branch)
from dataclasses import dataclass as _dc


@_dc(frozen=True)
class EpisodeProgress:
    attempt_id: int
    group_id: int
    generation_index: int
    attempt: int
    turn: int
    state: dict
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    token_versions: Sequence[int]


@_dc(frozen=True)
class SavedEpisode:
    key: str
    attempt: int
    turn: int
    state: dict
    token_ids: list[int] | None
    logprobs: list[float] | None
    token_versions: list[int] | None


def put_episodes(conn: Connection, rows: Sequence[EpisodeProgress]) -> None:
    for r in rows:
        put_episode(conn, r.attempt_id, turn=r.turn, state=r.state)
