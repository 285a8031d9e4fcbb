"""What a store file says about every sampler position, read over a plain sqlite3
connection.

Since revision v1_4_a a trained or discarded group is no ledger row; since v1_5_a its
position is in a `settled_steps` row (about one per train step, the discards and the
positions settled elsewhere in a small blob). The blob has one decoder, the store's
`queries.settled_runs` (the brief of W2-G item 1: every reader of the record goes
through it); these helpers expand its runs per position beside the live rows, so tests
that check what a run trained see one record per position and can tell a position
recorded twice. What the record itself holds is checked against hand-computed rows
in tests/test_bounded_store.py.
"""

from __future__ import annotations

import sqlite3
from collections import Counter

from rolloutdb.store import queries

# seq -> (state, trained_step, target_step, discard_reason)
Outcome = tuple[str, "int | None", "int | None", "str | None"]


def positions(conn: sqlite3.Connection) -> dict[int, list[Outcome]]:
    """Every position the ledger accounts for (live rows and the settled record), each
    with every record of it (more than one: recorded twice). A settled discard has no
    stamped step (the record keeps only the trained positions' stamp)."""
    out: dict[int, list[Outcome]] = {}
    for seq, state, trained, target, reason in conn.execute(
            "SELECT sample_seq, state, trained_step, target_step, discard_reason FROM prompt_groups"):
        out.setdefault(seq, []).append((state, trained, target, reason))
    for r in queries.settled_runs(conn):
        for seq in range(r.start, r.end):
            out.setdefault(seq, []).append((r.outcome, r.trained_step, r.target_step, r.discard_reason))
    return out


def states(conn: sqlite3.Connection) -> Counter:
    """Groups per state, settled ones included."""
    return Counter(o[0] for records in positions(conn).values() for o in records)


def trained_per_step(conn: sqlite3.Connection) -> dict[int, int]:
    """Groups trained per step, settled ones included."""
    return dict(Counter(o[1] for records in positions(conn).values() for o in records if o[0] == "trained"))


def discarded_for(conn: sqlite3.Connection, reason: str) -> int:
    return sum(1 for records in positions(conn).values() for o in records if o[0] == "discarded" and o[3] == reason)


def settled_prompt_ids(conn: sqlite3.Connection) -> set[tuple[int, int]]:
    """(epoch, prompt id) of every set bit of `settled_prompts`, decoded here from the
    format docs/schema.md states (bit p % 8 of byte p // 8 of chunk c: prompt c * 4096 + p),
    not with the store's code."""
    return {(epoch, chunk * 4096 + 8 * i + b) for epoch, chunk, bits in
            conn.execute("SELECT epoch, chunk, bits FROM settled_prompts")
            for i, byte in enumerate(bits) for b in range(8) if byte >> b & 1}
