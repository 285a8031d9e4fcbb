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

Each settled group's (epoch, prompt id) sets a bit of its epoch's bitmap in
`settled_prompts` in the same transaction (schema.SettledPrompts): the ranges prove each
position once, the bitmaps each prompt once (`audit_prompts`).

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
    select(groups.c.sample_seq, groups.c.state, groups.c.trained_step, groups.c.target_step, groups.c.discard_reason,
           groups.c.epoch, groups.c.prompt_id)
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
    for run in runs_of([r[:5] for r in rows]):
        _add_run(raw, run)
    mark_settled(raw, [(r[5], r[6]) for r in rows])


def mark_settled(raw: sqlite3.Connection, prompts: Sequence[tuple[int, int]]) -> None:
    """Set the bits of `prompts` ((epoch, prompt id) pairs) in `settled_prompts` and add
    them to their epoch's `settles`. A bit already set is not refused here: the settle
    count then exceeds the set bits and `prompt_problems` (invariant 1, verify) counts
    the prompt as duplicated. One read and one write of the epoch's bitmap per
    transaction (4 KB for 32k prompt ids)."""
    by_epoch: dict[int, list[int]] = {}
    for epoch, prompt_id in prompts:
        by_epoch.setdefault(int(epoch), []).append(int(prompt_id))
    for epoch, ids in by_epoch.items():
        row = raw.execute("SELECT bits, settles FROM settled_prompts WHERE epoch = ?", (epoch,)).fetchone()
        bits = bytearray(row[0]) if row else bytearray()
        need = max(ids) // 8 + 1
        if len(bits) < need:
            bits.extend(bytes(need - len(bits)))
        for p in ids:
            bits[p >> 3] |= 1 << (p & 7)
        raw.execute("INSERT OR REPLACE INTO settled_prompts (epoch, bits, settles) VALUES (?, ?, ?)",
                    (epoch, bytes(bits), (row[1] if row else 0) + len(ids)))


def is_set(bits: bytes, prompt_id: int) -> bool:
    return 0 <= prompt_id and (prompt_id >> 3) < len(bits) and bool(bits[prompt_id >> 3] >> (prompt_id & 7) & 1)


@dataclass
class PromptAudit:
    """Exactly-once over prompts, from `settled_prompts` and the live rows. `twice`: one
    line per duplicated hand-out ('epoch E prompt P xN', or 'epoch E: K prompt(s) settled
    twice' where the bitmap keeps no id); `duplicated`: the hand-outs beyond the first;
    `unrecorded`: settled positions minus recorded settles (a settle that left no bit)."""

    twice: list[str]
    duplicated: int
    unrecorded: int


def audit_prompts(raw: sqlite3.Connection) -> PromptAudit:
    """Every (epoch, prompt id) handed out at most once over the run: live rows (ledger
    and spare pool) counted with the settled bit of their prompt, and each epoch's
    settles against its set bits. Reads the live rows (what is in flight) and one
    bitmap per epoch."""
    has = lambda t: raw.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (t,)).fetchone()  # noqa: E731
    bitmaps = {e: (bytes(b), n) for e, b, n in raw.execute("SELECT epoch, bits, settles FROM settled_prompts")} \
        if has("settled_prompts") else {}
    live = raw.execute("SELECT epoch, prompt_id, count(*) FROM (SELECT epoch, prompt_id FROM prompt_groups UNION ALL "
                       "SELECT epoch, prompt_id FROM spare_prompts) GROUP BY epoch, prompt_id ORDER BY epoch, prompt_id")
    twice: list[str] = []
    duplicated = 0
    for epoch, prompt_id, n in live:
        n += is_set(bitmaps.get(epoch, (b"", 0))[0], prompt_id)
        if n > 1:
            duplicated += n - 1
            twice.append(f"epoch {epoch} prompt {prompt_id} x{n}")
    for epoch, (bits, settles) in sorted(bitmaps.items()):
        extra = settles - sum(bin(b).count("1") for b in bits)
        if extra > 0:  # fewer settles than bits: a bit without its settle, `unrecorded` says it
            duplicated += extra
            twice.append(f"epoch {epoch}: {extra} prompt(s) settled twice")
    unrecorded = 0
    if has("settled_ranges"):
        positions = raw.execute("SELECT coalesce(sum(seq_end - seq_start), 0) FROM settled_ranges").fetchone()[0]
        unrecorded = positions - sum(n for _, n in bitmaps.values())
    return PromptAudit(twice, duplicated, unrecorded)


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
