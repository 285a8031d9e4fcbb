"""Settled groups leave the live store: the commit that trains or discards a group
deletes its ledger row and its attempt rows and records its sampler position in
`settled_ranges` (schema.SettledRange), run-length encoded.

Why at the settling commit and not batched every N settles: the invariants must hold at
every commit, and a batch would leave a window in which a settled group is both a row
and (after the batch) a range; doing it in the same transaction keeps one place per
position at every commit, and the live store's row counts follow what is in flight
(tests/test_bounded_store.py). Cost: two indexed reads and one write per run of
positions settled together; a train step's groups are usually one or two runs
(bench/bench_bounded_store.py measures the store sizes, bench/bench_transitions.py the
transition rate).

The payload rows (samples, replay, finalizer results, chunks, episodes) are dropped by
the ledger's transitions before this runs; here only the ledger and attempt rows go.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, delete, select

from ..errors import IllegalTransition
from ..sqlite.prepared import Prepared, _driver, in_json, json_ids
from .schema import T

groups = T["prompt_groups"]
rollouts = T["rollouts"]
ranges = T["settled_ranges"]

# What a run of positions must share to be one row.
Key = tuple[str, "int | None", "int | None", "str | None"]  # outcome, trained step, target step, reason

_SETTLED_ROWS = Prepared(
    select(groups.c.sample_seq, groups.c.state, groups.c.trained_step, groups.c.target_step, groups.c.discard_reason)
    .where(in_json(groups.c.group_id))
    .order_by(groups.c.sample_seq)
)
_DELETE_ATTEMPTS = Prepared(delete(rollouts).where(in_json(rollouts.c.group_id)))
_DELETE_GROUPS = Prepared(delete(groups).where(in_json(groups.c.group_id)))
_RANGE_COLUMNS = (ranges.c.seq_start, ranges.c.seq_end, ranges.c.outcome, ranges.c.trained_step,
                  ranges.c.target_step, ranges.c.discard_reason)


@dataclass(frozen=True)
class SettledRun:
    """Positions [start, end) that settled the same way."""

    start: int
    end: int
    outcome: str
    trained_step: int | None
    target_step: int | None
    discard_reason: str | None

    @property
    def key(self) -> Key:
        return (self.outcome, self.trained_step, self.target_step, self.discard_reason)


def runs_of(rows: Sequence[tuple]) -> list[SettledRun]:
    """(sample_seq, outcome, trained step, target step, reason) rows sorted by position
    -> maximal runs of consecutive positions with one key."""
    out: list[SettledRun] = []
    for seq, outcome, trained, target, reason in rows:
        last = out[-1] if out else None
        if last is not None and last.end == seq and last.key == (outcome, trained, target, reason):
            out[-1] = SettledRun(last.start, seq + 1, *last.key)
        else:
            out.append(SettledRun(seq, seq + 1, outcome, trained, target, reason))
    return out


def settle_groups(conn: Connection, group_ids: Sequence[int]) -> None:
    """Compact `group_ids`, just moved to trained or discarded in this transaction:
    their positions join `settled_ranges` and their ledger and attempt rows go.
    Raises IllegalTransition if a position is already recorded as settled (it would be
    settled twice: invariant 1)."""
    if not group_ids:
        return
    ids = {"ids": json_ids(group_ids)}
    rows = _SETTLED_ROWS.run(conn, ids).fetchall()
    _DELETE_ATTEMPTS.run(conn, ids)
    _DELETE_GROUPS.run(conn, ids)
    raw = _driver(conn)
    for run in runs_of(rows):
        _add_run(raw, run)


def _add_run(raw: sqlite3.Connection, run: SettledRun) -> None:
    """Insert one run, merged with the range that ends where it starts and the one that
    starts where it ends when they have its key. Plain sqlite3 text on the driver
    connection of the same transaction: three short statements on the primary key."""
    before = raw.execute(
        "SELECT seq_start, seq_end, outcome, trained_step, target_step, discard_reason FROM settled_ranges "
        "WHERE seq_start < ? ORDER BY seq_start DESC LIMIT 1", (run.end,)).fetchone()
    if before is not None and before[1] > run.start:
        raise IllegalTransition(f"sampler positions {max(run.start, before[0])}..{min(run.end, before[1]) - 1}: "
                                f"already settled ({before[2]}); a position settles once")
    start, end = run.start, run.end
    if before is not None and before[1] == run.start and tuple(before[2:]) == run.key:
        start = before[0]
        raw.execute("DELETE FROM settled_ranges WHERE seq_start = ?", (start,))
    after = raw.execute(
        "SELECT seq_end, outcome, trained_step, target_step, discard_reason FROM settled_ranges WHERE seq_start = ?",
        (run.end,)).fetchone()
    if after is not None and tuple(after[1:]) == run.key:
        end = after[0]
        raw.execute("DELETE FROM settled_ranges WHERE seq_start = ?", (run.end,))
    raw.execute("INSERT INTO settled_ranges (seq_start, seq_end, outcome, trained_step, target_step, discard_reason) "
                "VALUES (?, ?, ?, ?, ?, ?)", (start, end, *run.key))


def settled_ranges(conn: Connection | sqlite3.Connection) -> list[SettledRun]:
    """Every recorded range, by position (empty in a file older than v1_4_a)."""
    raw = conn if isinstance(conn, sqlite3.Connection) else _driver(conn)
    if not raw.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'settled_ranges'").fetchone():
        return []
    return [SettledRun(*r) for r in raw.execute(
        "SELECT seq_start, seq_end, outcome, trained_step, target_step, discard_reason FROM settled_ranges "
        "ORDER BY seq_start")]


def settled_counts(conn: Connection | sqlite3.Connection) -> dict[str, int]:
    """{'trained': n, 'discarded': n}: groups recorded in ranges."""
    out = {"trained": 0, "discarded": 0}
    for r in settled_ranges(conn):
        out[r.outcome] = out.get(r.outcome, 0) + r.end - r.start
    return out
