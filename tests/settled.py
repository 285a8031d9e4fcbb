"""What a store file says about every sampler position, read with plain sqlite3.

Since revision v1_4_a a trained or discarded group is no ledger row: its position is in a
`settled_ranges` row (seq_start, seq_end, outcome, trained_step, target_step,
discard_reason). Tests that check what a run trained read both through these helpers,
written against the table's documented meaning, not through the store's own code (which
is what they check).
"""

from __future__ import annotations

import sqlite3
from collections import Counter

# seq -> (state, trained_step, target_step, discard_reason)
Outcome = tuple[str, "int | None", "int | None", "str | None"]


def _has_ranges(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'settled_ranges'").fetchone() is not None


def positions(conn: sqlite3.Connection) -> dict[int, list[Outcome]]:
    """Every position the ledger accounts for (live rows and settled ranges), each with
    every record of it (more than one: recorded twice)."""
    out: dict[int, list[Outcome]] = {}
    for seq, state, trained, target, reason in conn.execute(
            "SELECT sample_seq, state, trained_step, target_step, discard_reason FROM prompt_groups"):
        out.setdefault(seq, []).append((state, trained, target, reason))
    if _has_ranges(conn):
        for start, end, outcome, trained, target, reason in conn.execute(
                "SELECT seq_start, seq_end, outcome, trained_step, target_step, discard_reason FROM settled_ranges"):
            for seq in range(start, end):
                out.setdefault(seq, []).append((outcome, trained, target, reason))
    return out


def states(conn: sqlite3.Connection) -> Counter:
    """Groups per state, settled ones included."""
    return Counter(o[0] for records in positions(conn).values() for o in records)


def trained_per_step(conn: sqlite3.Connection) -> dict[int, int]:
    """Groups trained per step, settled ones included."""
    return dict(Counter(o[1] for records in positions(conn).values() for o in records if o[0] == "trained"))


def discarded_for(conn: sqlite3.Connection, reason: str) -> int:
    return sum(1 for records in positions(conn).values() for o in records if o[0] == "discarded" and o[3] == reason)
