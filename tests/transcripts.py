"""Saved episode transcripts as one value each, read with plain SQL and joined here from
the format docs/schema.md states (revision v1_11_a: pieces of `episode_tokens`, in
`first_token` order, contiguous from 0, summing to `env_episodes.transcript_tokens`),
not through the store's reader (`pools.read_episodes`), so tests check the store
against the documented layout rather than against itself."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Transcript:
    """`token_ids` and `logprobs` as the joined BLOBs, `version_token_counts` as the
    joined JSON runs text (adjacent runs of one version merged); all three None when the
    episode saved no transcript. `problem`: why the pieces do not make one transcript
    (then the three are None), or None."""

    token_ids: bytes | None
    logprobs: bytes | None
    version_token_counts: str | None
    problem: str | None = None


def saved_transcripts(conn: sqlite3.Connection) -> dict[int, Transcript]:
    """attempt id -> its episode's saved transcript, for every `env_episodes` row."""
    pieces: dict[int, list[tuple[int, bytes, bytes, str]]] = {}
    for attempt_id, *piece in conn.execute("SELECT attempt_id, first_token, token_ids, logprobs, version_token_counts "
                                           "FROM episode_tokens ORDER BY attempt_id, first_token"):
        pieces.setdefault(attempt_id, []).append(tuple(piece))
    out = {}
    for attempt_id, n in conn.execute("SELECT attempt_id, transcript_tokens FROM env_episodes"):
        out[attempt_id] = _joined(n, pieces.get(attempt_id, []))
    return out


def read_transcripts(path: Path) -> dict[int, Transcript]:
    """`saved_transcripts` of a file, through a read-only connection of its own."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as conn:
        return saved_transcripts(conn)


def _joined(n: int | None, pieces: list[tuple[int, bytes, bytes, str]]) -> Transcript:
    if n is None:
        return Transcript(None, None, None, f"{len(pieces)} pieces without a transcript length" if pieces else None)
    at, runs = 0, []
    for first, tokens, logprobs, text in pieces:
        if first != at:
            return Transcript(None, None, None, f"a piece at token {first} where {at} was expected")
        if len(tokens) % 4 or len(logprobs) != len(tokens):
            return Transcript(None, None, None, f"the piece at token {first} has {len(tokens)} token bytes and "
                                                f"{len(logprobs)} logprob bytes")
        for version, count in json.loads(text):
            if runs and runs[-1][0] == version:
                runs[-1][1] += count
            else:
                runs.append([version, count])
        at += len(tokens) // 4
    if at != n:
        return Transcript(None, None, None, f"pieces of {at} tokens for a transcript of {n}")
    return Transcript(b"".join(p[1] for p in pieces), b"".join(p[2] for p in pieces), json.dumps(runs, separators=(",", ":")))
