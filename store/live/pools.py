"""Runtime state beside the ledger: sampler cursor, spare-prompt pool, per-step shortfall,
prefix chunks and environment episodes. Functions over an open
transaction, like `ledger.py`."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sqlalchemy import Connection, bindparam, delete, insert, literal_column, select, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from .codec import (
    LOGPROB_DTYPE,
    TOKEN_DTYPE,
    decode_logprobs,
    decode_tokens,
    decode_version_counts,
    encode_logprobs,
    encode_tokens,
    encode_version_counts,
    version_runs,
)
from ..errors import IllegalTransition
from ..sqlite.prepared import Prepared, in_json, json_ids
from .ledger import Reservation
from .payload import SegmentRef, read_segment
from .schema import T

sampler = T["sampler_state"]
spare = T["spare_prompts"]
shortfall = T["step_shortfall"]
chunks = T["token_chunks"]
episodes = T["env_episodes"]
episode_tokens = T["episode_tokens"]
rollouts = T["rollouts"]

# Built and compiled once (`Prepared`, see ledger.py): the cursor, the spare pool and the
# shortfall are read and written in every group-commit batch that dispatches.
_READ_CURSOR = Prepared(select(sampler.c.next_seq, sampler.c.epoch, sampler.c.seed, sampler.c.stamping))
# The check and the move in one statement: a cursor that would move back is not
# matched (rowcount 0), and only then is it read to name the positions.
_ADVANCE_CURSOR = Prepared(
    update(sampler).where(sampler.c.next_seq <= bindparam("to_seq"))
    .values(next_seq=bindparam("to_seq"), epoch=bindparam("to_epoch"))
)
_COVER_CURSOR = Prepared(
    update(sampler).where(sampler.c.next_seq < bindparam("to_seq"))
    .values(next_seq=bindparam("to_seq"), epoch=bindparam("to_epoch"))
)
_PUSH_SPARE = Prepared(insert(spare).values({c: bindparam(c) for c in ("sample_seq", "epoch", "prompt_id", "added_at")}))
# Oldest first; DELETE ... RETURNING takes them in one statement.
_POP_SPARE = Prepared(
    delete(spare)
    .where(spare.c.sample_seq.in_(select(spare.c.sample_seq).order_by(spare.c.sample_seq)
                              .limit(bindparam("n")).offset(literal_column("0"))))
    .returning(spare.c.sample_seq, spare.c.epoch, spare.c.prompt_id)
)
_DELETE_SHORTFALL = Prepared(delete(shortfall).where(shortfall.c.step == bindparam("step")))
_UPSERT_SHORTFALL_STMT = sqlite_insert(shortfall).values(step=bindparam("step"), needed=bindparam("needed"))
_UPSERT_SHORTFALL = Prepared(
    _UPSERT_SHORTFALL_STMT.on_conflict_do_update(index_elements=["step"], set_={"needed": _UPSERT_SHORTFALL_STMT.excluded.needed})
)
_GET_SHORTFALL = Prepared(select(shortfall.c.step, shortfall.c.needed))


# ---------------------------------------------------------------- sampler cursor


@dataclass(frozen=True)
class Cursor:
    next_seq: int
    epoch: int
    seed: int
    stamping: str


def read_cursor(conn: Connection) -> Cursor:
    return Cursor(*_READ_CURSOR.run(conn).fetchone())


def advance_cursor(conn: Connection, next_seq: int, epoch: int) -> None:
    """Record that the sampler has handed out every prompt below `next_seq`. The cursor
    never moves back: a restore relies on it covering every saved group."""
    if _ADVANCE_CURSOR.run(conn, {"to_seq": next_seq, "to_epoch": epoch}).rowcount != 1:
        current = read_cursor(conn)
        raise IllegalTransition(f"sampler cursor: cannot move back from {current.next_seq} to {next_seq}")


def cover_cursor(conn: Connection, next_seq: int, epoch: int) -> None:
    """Advance the cursor to `next_seq` (and `epoch`) if it is below; else leave it."""
    _COVER_CURSOR.run(conn, {"to_seq": next_seq, "to_epoch": epoch})


# ---------------------------------------------------------------- spare pool


def push_spare(conn: Connection, prompts: Sequence[Reservation]) -> None:
    if prompts:
        now = time.time()
        _PUSH_SPARE.many(
            conn,
            [{"sample_seq": p.sample_seq, "epoch": p.epoch, "prompt_id": p.prompt_id, "added_at": now} for p in prompts],
        )


def pop_spare(conn: Connection, n: int) -> list[Reservation]:
    """Take up to `n` spare prompts, oldest (lowest sampler position) first."""
    if n <= 0:
        return []
    # RETURNING hands rows back in no promised order: sort by sampler position.
    return [Reservation(*r) for r in sorted(_POP_SPARE.run(conn, {"n": n}).fetchall())]


# ---------------------------------------------------------------- shortfall


def set_shortfall(conn: Connection, step: int, needed: int) -> None:
    """Set how many groups `step` still needs; 0 removes the row."""
    if needed < 0:
        raise ValueError(f"step {step}: shortfall cannot be negative ({needed})")
    if needed == 0:
        _DELETE_SHORTFALL.run(conn, {"step": step})
        return
    _UPSERT_SHORTFALL.run(conn, {"step": step, "needed": needed})


def add_shortfall(conn: Connection, step: int, delta: int) -> int:
    """Change a step's shortfall by `delta`; returns the new value."""
    new = get_shortfall(conn).get(step, 0) + delta
    set_shortfall(conn, step, new)
    return new


def get_shortfall(conn: Connection) -> dict[int, int]:
    return dict(_GET_SHORTFALL.run(conn).fetchall())


# ---------------------------------------------------------------- prefix chunks
# Prefix-level recovery: at a snapshot's cut the tokens every running call had
# decoded go into the snapshot's own file (`put_chunk_references` on the copy, from the
# snapshot pump: rows naming the segment each chunk's bytes were written to once;
# `put_prefixes` writes them inline, as files before v1_8_a hold them); the live store
# never holds them, so there is nothing to delete when a call finishes. A restore reads
# the chunks of the attempts it abandons (`read_chunks`, inline or from their segment)
# and the pump continues each call from its prefix (`CallPrefix.of`).


@dataclass(frozen=True)
class Chunk:
    attempt_id: int
    chunk_index: int
    prefix_count: int
    token_ids: list[int]
    max_tokens: int
    min_tokens: int
    policy_version: int
    logprobs: list[float] | None = None  # None: written before v1_3_a
    sampler: str | None = None  # what decoded it (v1_10_a); None: unknown or more than one


@dataclass(frozen=True)
class CallPrefix:
    """What a running call had decoded at a cut: its output so far (one logprob and one
    policy version per token) and the limits it was started with."""

    attempt_id: int
    token_ids: Sequence[int]
    logprobs: Sequence[float] | None
    token_versions: Sequence[int]
    max_tokens: int
    min_tokens: int
    # `GenerationEngine.sampler_identity` of what decoded every token; None: unknown (a
    # chunk from before v1_10_a) or more than one (then no continuation is bitwise).
    sampler: str | None = None

    @classmethod
    def of(cls, chunks: Sequence[Chunk]) -> CallPrefix | None:
        """The prefix a restore's chunks (in order) add up to; None when they do not line
        up (a gap, or logprobs in some chunks only): such a call restarts its turn."""
        if not chunks:
            return None
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for c in chunks:
            if c.prefix_count != len(tokens) or (c.logprobs is None) != (chunks[0].logprobs is None):
                return None
            if c.logprobs is not None and len(c.logprobs) != len(c.token_ids):
                return None
            tokens += c.token_ids
            logprobs += c.logprobs or []
            versions += [c.policy_version] * len(c.token_ids)
        first = chunks[0]
        sampler = first.sampler if all(c.sampler == first.sampler for c in chunks) else None
        return cls(first.attempt_id, tokens, logprobs if first.logprobs is not None else None, versions,
                   first.max_tokens, first.min_tokens, sampler)


_CHUNK_COLUMNS = ("attempt_id", "chunk_index", "prefix_count", "token_ids", "max_tokens", "min_tokens",
                  "policy_version", "created_at", "logprobs", "sampler")
_INSERT_CHUNKS = Prepared(insert(chunks).values({c: bindparam(c) for c in _CHUNK_COLUMNS}))


def put_prefixes(conn: Connection | sqlite3.Connection, prefixes: Sequence[CallPrefix]) -> int:
    """Save running calls' prefixes: one chunk per run of tokens of one policy version.
    Every prefix is checked before anything is written. Returns the chunks written."""
    now = time.time()
    params = []
    for p in prefixes:
        n = len(p.token_ids)
        if len(p.token_versions) != n or (p.logprobs is not None and len(p.logprobs) != n):
            raise ValueError(f"prefix of attempt {p.attempt_id}: {n} tokens, {len(p.token_versions)} versions and "
                             f"{'no' if p.logprobs is None else len(p.logprobs)} logprobs; give one version and one "
                             "logprob per token (nothing was written)")
        start = 0
        for index, (version, count) in enumerate(version_runs(p.token_versions)):
            params.append({
                "attempt_id": p.attempt_id, "chunk_index": index, "prefix_count": start,
                "token_ids": encode_tokens(p.token_ids[start:start + count]), "max_tokens": p.max_tokens,
                "min_tokens": p.min_tokens, "policy_version": version, "created_at": now,
                "logprobs": None if p.logprobs is None else encode_logprobs(p.logprobs[start:start + count]),
                "sampler": p.sampler,
            })
            start += count
    _INSERT_CHUNKS.many(conn, params)
    return len(params)


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
    """Append one chunk (without logprobs) after a call's earlier chunks; the restore
    tests write old-style chunks with it. `prefix_count` is how many tokens earlier
    chunks hold; max/min tokens are the call's original limits."""
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


@dataclass(frozen=True)
class ChunkReference:
    """A prefix chunk whose bytes are row `segment_row` of the segment `segment`: what a
    snapshot's `token_chunks` row says of a chunk written once, by this cut or an
    earlier one (revision v1_8_a)."""

    attempt_id: int
    chunk_index: int
    prefix_count: int
    max_tokens: int
    min_tokens: int
    policy_version: int
    segment: SegmentRef
    segment_row: int
    sampler: str | None = None  # what decoded the tokens (v1_10_a; CallPrefix.sampler)


_REFERENCE_COLUMNS = ("attempt_id", "chunk_index", "prefix_count", "max_tokens", "min_tokens", "policy_version",
                      "created_at", "segment_id", "segment_row", "sampler")
_INSERT_REFERENCES = Prepared(insert(chunks).values({c: bindparam(c) for c in _REFERENCE_COLUMNS}))


def put_chunk_references(conn: sqlite3.Connection, references: Sequence[ChunkReference]) -> int:
    """In a snapshot file's transaction (the cut's `into_copy`): record each segment the
    chunks name in `payload_segments` (the file's one list of what it references: its
    manifest lists and hashes them; a row the file already has is kept), then one
    `token_chunks` row per chunk. Returns the chunks written."""
    segments = {r.segment.segment_id: r.segment for r in references}
    conn.executemany("INSERT OR IGNORE INTO payload_segments (segment_id, file_name, blake3, bytes, rows, created_at) "
                     "VALUES (?, ?, ?, ?, ?, ?)",
                     [(g.segment_id, g.file_name, g.blake3, g.bytes, g.rows, time.time()) for g in segments.values()])
    now = time.time()
    _INSERT_REFERENCES.many(conn, [{
        "attempt_id": r.attempt_id, "chunk_index": r.chunk_index, "prefix_count": r.prefix_count,
        "max_tokens": r.max_tokens, "min_tokens": r.min_tokens, "policy_version": r.policy_version,
        "created_at": now, "segment_id": r.segment.segment_id, "segment_row": r.segment_row, "sampler": r.sampler}
        for r in references])
    return len(references)


def read_chunks(conn: Connection, attempt_id: int, segments_dir: str | Path | None = None) -> list[Chunk]:
    """One attempt's chunks, in order (`read_chunks_of`)."""
    return read_chunks_of(conn, [attempt_id], segments_dir).get(attempt_id, [])


def read_chunks_of(conn: Connection, attempt_ids: Sequence[int],
                   segments_dir: str | Path | None = None) -> dict[int, list[Chunk]]:
    """attempt id -> its chunks in order, their bytes inline or from the segment each
    names (revision v1_8_a; `segments_dir`: the checkpoint directory's payload_segments/,
    needed only when a chunk references a segment), each segment opened once through the
    one segment reader (`payload.read_segment`). Raises SegmentMissing naming the
    segment when one cannot give a chunk it should. A segment's empty logprobs BLOB is a
    chunk without logprobs."""
    columns = {r[1] for r in conn.exec_driver_sql("PRAGMA table_info(token_chunks)").all()}
    has_refs = "segment_id" in columns
    refs = "c.segment_row, p.file_name" if has_refs else "NULL, NULL"
    sampler = "c.sampler" if "sampler" in columns else "NULL"
    join = " LEFT JOIN payload_segments p ON p.segment_id = c.segment_id" if has_refs else ""
    sql = (f"SELECT c.attempt_id, c.chunk_index, c.prefix_count, c.token_ids, c.max_tokens, c.min_tokens, "
           f"c.policy_version, c.logprobs, {refs}, {sampler} FROM token_chunks c{join} "
           "WHERE c.attempt_id IN (SELECT value FROM json_each(?)) ORDER BY c.attempt_id, c.chunk_index")
    rows = [list(r) for r in conn.exec_driver_sql(sql, (json.dumps([int(a) for a in attempt_ids]),)).all()]
    by_file: dict[str, list[list]] = {}
    for r in rows:
        if r[9] is not None:
            by_file.setdefault(r[9], []).append(r)
    for name, wanted in sorted(by_file.items()):
        found = read_segment(segments_dir, name, sorted({r[8] for r in wanted}))
        for r in wanted:
            r[3], logprobs = found[r[8]]
            r[7] = logprobs or None
    out: dict[int, list[Chunk]] = {}
    for a, i, p, t, mx, mn, v, lp, _, _, who in rows:
        out.setdefault(a, []).append(Chunk(a, i, p, decode_tokens(t).tolist(), mx, mn, v,
                                           None if lp is None else [float(x) for x in decode_logprobs(lp)], who))
    return out


def delete_chunks(conn: Connection, attempt_ids: Sequence[int]) -> None:
    conn.execute(delete(chunks).where(chunks.c.attempt_id.in_(list(attempt_ids))))


# ---------------------------------------------------------------- environment episodes
# Turn-level recovery: after every finished turn the rollout pump saves the
# episode in its next group-commit transaction (`put_episodes`); a restore reads the
# episodes of the attempts it abandons (`read_episodes`) so the pump continues each from
# its last committed turn. A finished or abandoned attempt keeps no row (invariant 3;
# `ledger.finish_attempts` and `ledger.abandon_attempts` drop them).

# One key per running attempt: its small row (turn, JSON state, transcript length)
# replaced on every turn, the transcript's new tokens appended as a piece of
# `episode_tokens` (revision v1_11_a). Built once: these run in every group-commit batch
# that finished a turn.
_EPISODE_COLUMNS = ("episode_key", "attempt_id", "turn", "state", "updated_at", "transcript_tokens")
_INSERT_EPISODES = sqlite_insert(episodes).values({c: bindparam(c) for c in _EPISODE_COLUMNS})
_UPSERT_EPISODES = Prepared(_INSERT_EPISODES.on_conflict_do_update(
    index_elements=["episode_key"],
    set_={c: _INSERT_EPISODES.excluded[c] for c in _EPISODE_COLUMNS[1:]},
))
_PIECE_COLUMNS = ("attempt_id", "first_token", "token_ids", "logprobs", "version_token_counts")
_APPEND_PIECES = Prepared(insert(episode_tokens).values({c: bindparam(c) for c in _PIECE_COLUMNS}))
# Pieces from the first token this save writes on: none in the common case (a primary-key
# range probe that finds nothing); a save that starts over (a new attempt's first save,
# an export written whole, a transcript that shrank) drops what it replaces.
_DROP_PIECES_FROM = Prepared(delete(episode_tokens).where(episode_tokens.c.attempt_id == bindparam("attempt_id"),
                                                          episode_tokens.c.first_token >= bindparam("first_token")))


@dataclass(frozen=True)
class EpisodeProgress:
    """An episode after its last finished turn, as turn-level recovery saves it.

    The transcript is every token after the prompt so far, the policy's replies and the
    environment's observations in order, with one logprob (0.0 for environment tokens)
    and one policy version (-1 for environment tokens: the loss mask is "version != -1",
    as for samples) per token."""

    attempt_id: int
    group_id: int
    generation_index: int
    attempt: int  # attempt number (0, 1, ...): part of the key
    turn: int  # turns finished so far (the next turn's index)
    state: dict  # the environment's JSON-able state after that turn
    token_ids: Sequence[int] | None  # None (all three): the state only, no transcript
    logprobs: Sequence[float] | None
    token_versions: Sequence[int] | None  # one per token; -1 for environment tokens
    # Tokens of this transcript already saved under this attempt (`put_episodes` appends
    # the rest): what the attempt's last committed save wrote. 0: write it whole.
    saved_tokens: int = 0

    @property
    def key(self) -> str:
        return episode_key(self.group_id, self.generation_index, self.attempt)


@dataclass(frozen=True)
class SavedEpisode:
    """What an abandoned attempt's episode had saved at its last committed turn."""

    key: str  # the episode_key of the abandoned attempt
    attempt: int  # that attempt's number
    turn: int
    state: dict
    token_ids: list[int] | None  # None: no transcript (state only, or written before v1_2_a)
    logprobs: list[float] | None
    token_versions: list[int] | None  # expanded from the runs


def episode_key(group_id: int, generation_index: int, attempt: int) -> str:
    """The backend-neutral row key of an environment episode: `<rollout id>-a<attempt>`."""
    return f"{group_id}.{generation_index}-a{attempt}"


def _episode_rows(p: EpisodeProgress, now: float) -> tuple[dict, int, dict | None]:
    """(the episode's row, the first token this save writes, its new piece or None)."""
    row = {"episode_key": p.key, "attempt_id": p.attempt_id, "turn": p.turn, "state": _state_json(p),
           "updated_at": now, "transcript_tokens": None}
    if p.token_ids is None and p.logprobs is None and p.token_versions is None:
        return row, 0, None
    if p.token_ids is None or p.logprobs is None or p.token_versions is None:
        raise ValueError(f"episode {p.key}: give token ids, logprobs and token versions, or none of them "
                         "(nothing was written)")
    n_tokens, n_logprobs, n_versions = len(p.token_ids), len(p.logprobs), len(p.token_versions)
    if not n_tokens == n_logprobs == n_versions:
        raise ValueError(
            f"episode {p.key}: transcript of {n_tokens} token ids, {n_logprobs} logprobs and "
            f"{n_versions} token versions; pass one logprob and one version per token (nothing was written)"
        )
    row["transcript_tokens"] = n_tokens
    first = p.saved_tokens if 0 <= p.saved_tokens <= n_tokens else 0  # shrank or nonsense: start over
    if first == n_tokens:
        return row, first, None
    # Slices of what is new only: the cost of a save follows the turn, not the transcript.
    return row, first, {
        "attempt_id": p.attempt_id, "first_token": first,
        "token_ids": encode_tokens(p.token_ids[first:]), "logprobs": encode_logprobs(p.logprobs[first:]),
        "version_token_counts": encode_version_counts(version_runs(p.token_versions[first:])),
    }


def _state_json(p: EpisodeProgress) -> str:
    try:
        return json.dumps(p.state)
    except (TypeError, ValueError) as e:
        raise ValueError(f"episode {p.key}: state is not JSON-able ({e}); pass plain dicts, lists, "
                         "strings and numbers (nothing was written)") from None


def put_episodes(conn: Connection | sqlite3.Connection, rows: Sequence[EpisodeProgress]) -> None:
    """Save episodes after their last finished turn: one executemany upsert of their rows
    keyed by the episode key, and their transcripts' new tokens appended as pieces
    (`EpisodeProgress.saved_tokens` says where the new tokens begin), no SELECT (it runs
    inside the pump's group-commit transaction). Every row is checked and encoded before
    anything is written: a transcript whose tokens, logprobs and versions differ in
    length is refused with a ValueError.

    Write progress only for running attempts, and before `ledger.finish_attempts` of
    the same batch: finishing drops the row, so an upsert after it would leave a row of
    a finished attempt (invariant 3)."""
    if not rows:
        return
    now = time.time()
    encoded = [_episode_rows(p, now) for p in rows]
    _UPSERT_EPISODES.many(conn, [row for row, _, _ in encoded])
    _DROP_PIECES_FROM.many(conn, [{"attempt_id": row["attempt_id"], "first_token": first} for row, first, _ in encoded])
    pieces = [piece for _, _, piece in encoded if piece is not None]
    if pieces:
        _APPEND_PIECES.many(conn, pieces)


def put_episode(conn: Connection, attempt_id: int, *, turn: int, state: dict) -> str:
    """Save an episode's state only, without a transcript (an environment that saves
    only its state): not resumable at turn level; the pump restarts such an episode.
    Replaces a transcript saved earlier under the same key."""
    g, i, a = conn.execute(
        select(rollouts.c.group_id, rollouts.c.generation_index, rollouts.c.attempt).where(rollouts.c.attempt_id == attempt_id)
    ).one()
    put_episodes(conn, [EpisodeProgress(attempt_id, g, i, a, turn, state, None, None, None)])
    return episode_key(g, i, a)


_Transcript = tuple[list[int] | None, list[float] | None, list[int] | None]
_NO_TRANSCRIPT: _Transcript = (None, None, None)


def _transcript(n_tokens: int | None, pieces: Sequence[tuple[int, bytes, bytes, str]]) -> _Transcript:
    """Join a saved transcript's pieces ((first token, token ids, logprobs, version runs),
    in order); (None, None, None) when there is none (`n_tokens` NULL), or when the pieces
    do not line up (a gap, an overlap, a total other than `n_tokens`, payloads of
    different lengths: not written by `put_episodes`): such an episode is restarted, like
    one saved without a transcript, rather than resumed from tokens that do not line up."""
    if n_tokens is None:
        return _NO_TRANSCRIPT
    ids: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    for first, tokens, logprobs, runs in pieces:
        if first != len(ids) or type(tokens) is not bytes or type(logprobs) is not bytes:
            return _NO_TRANSCRIPT
        if len(tokens) % TOKEN_DTYPE.itemsize or len(logprobs) % LOGPROB_DTYPE.itemsize:
            return _NO_TRANSCRIPT
        try:
            pairs = decode_version_counts(runs)
        except (ValueError, TypeError):
            return _NO_TRANSCRIPT
        piece_ids, piece_lps = decode_tokens(tokens), decode_logprobs(logprobs)
        piece_versions = np.repeat(np.array([v for v, _ in pairs], dtype=np.int64),
                                   np.array([n for _, n in pairs], dtype=np.int64)) if pairs else np.zeros(0, np.int64)
        if not len(piece_ids) == len(piece_lps) == len(piece_versions) > 0:
            return _NO_TRANSCRIPT
        ids += piece_ids.tolist()
        lps += piece_lps.tolist()
        versions += piece_versions.tolist()
    return (ids, lps, versions) if len(ids) == n_tokens else _NO_TRANSCRIPT


def read_episodes(conn: Connection, *, running_only: bool = False) -> dict[tuple[int, int], SavedEpisode]:
    """(group id, generation index) -> the episode its attempt saved; with
    `running_only`, only episodes of attempts still running (a restore reads these before
    abandoning them). A generation has one running attempt, so one episode. Two reads:
    the episodes, then their transcripts' pieces in order."""
    query = (
        select(episodes.c.attempt_id, episodes.c.episode_key, rollouts.c.group_id, rollouts.c.generation_index,
               rollouts.c.attempt, episodes.c.turn, episodes.c.state, episodes.c.transcript_tokens)
        .join(rollouts, rollouts.c.attempt_id == episodes.c.attempt_id)
        .order_by(rollouts.c.attempt_id)
    )
    if running_only:  # `+`: driven from the episodes, not from every running attempt's index entry
        query = query.where(literal_column("+rollouts.state") == "running")
    rows = conn.execute(query).all()
    pieces: dict[int, list[tuple[int, bytes, bytes, str]]] = {}
    with_transcript = [r[0] for r in rows if r[7] is not None]
    if with_transcript:
        for attempt_id, *piece in conn.execute(
                select(episode_tokens.c.attempt_id, episode_tokens.c.first_token, episode_tokens.c.token_ids,
                       episode_tokens.c.logprobs, episode_tokens.c.version_token_counts)
                .where(in_json(episode_tokens.c.attempt_id))
                .order_by(episode_tokens.c.attempt_id, episode_tokens.c.first_token),
                {"ids": json_ids(with_transcript)}).all():
            pieces.setdefault(attempt_id, []).append(tuple(piece))
    return {
        (g, i): SavedEpisode(k, a, t, json.loads(s), *_transcript(n, pieces.get(attempt_id, ())))
        for attempt_id, k, g, i, a, t, s, n in rows
    }

