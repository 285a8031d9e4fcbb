"""The four invariants of the architecture, checked over any store or snapshot file.

1. Exactly once: every prompt the sampler handed out (every sampler position below the
   cursor) is in exactly one of the ledger, the spare pool or a settled record (revision
   v1_4_a: settled groups leave the ledger, `compaction.py`; v1_5_a: one `settled_steps`
   row per step; v1_12_a: the old steps' positions one folded run from 0, `settled_prefix`), never two, never missing; no position is settled in two records; no prompt of an epoch is settled twice or settled and
   live at once (`settled_prompts` bitmaps); a live group is in one state and never twice (UNIQUE
   (epoch, prompt_id)).
2. A group is in the replay buffer or in flight, never both: replay rows belong to
   `published` groups only, every published group holds one permit below capacity, and
   no group in replay has a running attempt.
3. Every payload row is referenced by a live ledger row (samples, chunks, episodes).
4. The sampler cursor covers every saved group, spare prompt and settled position.

Plain SQL over a sqlite3 connection, so `verify` can run it on a read-only file. With
no-ledger dispatch the ledger is empty by design and 1, 3 and 4 only check the pool.
"""

from __future__ import annotations

import bisect
import sqlite3
from collections.abc import Collection
from dataclasses import dataclass, field

from .compaction import check_types
from .queries import SettledRun, settled_runs
from .schema import PROMPT_CHUNK

# Each check: (invariant number, description, SQL returning offending rows as text).
_LEDGER_CHECKS: list[tuple[int, str, str]] = [
    (
        1,
        "prompts both in the ledger and in the spare pool",
        """SELECT 'epoch ' || s.epoch || ' prompt ' || s.prompt_id FROM spare_prompts s
           JOIN prompt_groups g ON g.epoch = s.epoch AND g.prompt_id = s.prompt_id""",
    ),
    (
        2,
        "replay rows whose group is not published",
        """SELECT 'group ' || r.group_id || ' is ' || coalesce(g.state, 'missing') FROM replay_groups r
           LEFT JOIN prompt_groups g ON g.group_id = r.group_id
           WHERE g.state IS NOT 'published'""",
    ),
    (
        2,
        "published groups without a replay permit",
        """SELECT 'group ' || g.group_id FROM prompt_groups g
           WHERE g.state = 'published' AND g.group_id NOT IN (SELECT group_id FROM replay_groups)""",
    ),
    (
        2,
        "groups in replay that still have a running attempt",
        # CROSS JOIN keeps replay the outer loop (probing each group's attempts by index):
        # SQLite's own choice walked every running attempt, 83 of the copy check's ~300 ms
        # with 40,000 running (publish.py checks every copy with these).
        """SELECT DISTINCT 'group ' || r.group_id FROM replay_groups r
           CROSS JOIN rollouts a ON a.group_id = r.group_id WHERE a.state = 'running'""",
    ),
    (
        3,
        "samples of no live group",
        """SELECT 'sample ' || s.sample_id || ' (group ' || s.group_id || ')' FROM samples s
           LEFT JOIN prompt_groups g ON g.group_id = s.group_id
           WHERE g.state IS NULL OR g.state IN ('trained', 'discarded', 'reserved')""",
    ),
    (
        3,
        "token chunks of no running attempt",
        """SELECT 'chunk ' || c.chunk_id FROM token_chunks c
           LEFT JOIN rollouts a ON a.attempt_id = c.attempt_id
           WHERE a.state IS NOT 'running'""",
    ),
    (
        3,
        "environment episodes of no running attempt",
        """SELECT 'episode ' || e.episode_key FROM env_episodes e
           LEFT JOIN rollouts a ON a.attempt_id = e.attempt_id
           WHERE a.state IS NOT 'running'""",
    ),
    (
        4,
        "ledger groups beyond the sampler cursor",
        """SELECT 'group ' || group_id || ' at sample_seq ' || sample_seq FROM prompt_groups
           WHERE sample_seq >= (SELECT next_seq FROM sampler_state)""",
    ),
]

_ALWAYS_CHECKS: list[tuple[int, str, str]] = [
    (
        4,
        "spare prompts beyond the sampler cursor",
        """SELECT 'sample_seq ' || sample_seq FROM spare_prompts
           WHERE sample_seq >= (SELECT next_seq FROM sampler_state)""",
    ),
    (
        2,
        "replay permits at or above capacity",
        """SELECT 'permit ' || permit || ' of group ' || group_id FROM replay_groups
           WHERE permit >= (SELECT replay_capacity FROM run_meta)""",
    ),
    (
        0,
        "foreign keys that point nowhere",
        "SELECT \"table\" || ' rowid ' || rowid || ' -> ' || parent FROM pragma_foreign_key_check",
    ),
]

MAX_EXAMPLES = 5


@dataclass
class InvariantReport:
    """`problems`: one line each; `invariants[i]`: the number of the invariant
    `problems[i]` breaks (0: the file's integrity, not one of the four). Callers read
    the number here, never back out of the line."""

    counts: dict[str, int]
    problems: list[str] = field(default_factory=list)
    invariants: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, invariant: int, line: str) -> None:
        self.problems.append(line)
        self.invariants.append(invariant)


# Tables a store holds exactly one row of: every check reads its settings from them.
SINGLETONS = ("run_meta", "sampler_state")


def check_invariants(conn: sqlite3.Connection, only: Collection[int] | None = None) -> InvariantReport:
    """Run every check; each failing one adds a line with its count and examples.
    A store whose singleton tables do not hold exactly one row is reported as such (the
    checks below read their settings from those rows) and checked no further. `only`:
    the numbers of the invariants to check (0: the foreign keys); None, all of them."""
    counts = dict(conn.execute("SELECT state, count(*) FROM prompt_groups GROUP BY state").fetchall())
    counts["spare"] = conn.execute("SELECT count(*) FROM spare_prompts").fetchone()[0]
    counts["replay"] = conn.execute("SELECT count(*) FROM replay_groups").fetchone()[0]
    report = InvariantReport(counts=counts)
    for table in SINGLETONS:
        n = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        if n != 1:
            report.add(0, f"integrity: {table} holds {n} rows, a store holds exactly 1 "
                                   "(not an initialised store, or damaged); restore it from another snapshot")
    if report.problems:
        return report
    ledger = bool(conn.execute("SELECT ledger_dispatch FROM run_meta").fetchone()[0])
    counts["cursor"] = conn.execute("SELECT next_seq FROM sampler_state").fetchone()[0]
    checks = (_LEDGER_CHECKS if ledger else []) + _ALWAYS_CHECKS
    found = [(n, what, [r[0] for r in conn.execute(sql).fetchall()]) for n, what, sql in checks
             if only is None or n in only]
    if ledger and (only is None or 1 in only or 4 in only):
        # Decoded once for both checks: a snapshot's publish runs these on its copy
        # (copy_problems), and the decode is Python over every settled_steps row (one per
        # step: ~20 ms at 3000 steps, 2 shared cores), the one part of the check that
        # grows with the run (BENCHMARKS.md, "Per-event costs against the run's length").
        runs = settled_runs(conn)
        _check_prompts(conn, report, runs)
        found = _settled_checks(conn, counts["cursor"], runs) + found
    for number, what, rows in found:
        if rows:
            label = f"invariant {number}" if number else "integrity"
            examples = ", ".join(rows[:MAX_EXAMPLES]) + (", ..." if len(rows) > MAX_EXAMPLES else "")
            report.add(number, f"{label}: {len(rows)} {what}: {examples}")
    return report


def _settled_checks(conn: sqlite3.Connection, cursor: int, runs: list[SettledRun]) -> list[tuple[int, str, list[str]]]:
    """Invariants 1 and 4 over the settled record (`queries.settled_runs`, the one
    decoder of `settled_steps`; empty in a file older than v1_4_a, whose settled groups
    are still ledger rows) and the live positions: every position below the cursor in
    exactly one of a settled row, the ledger or the spare pool; none beyond the cursor.
    Python over the decoded runs (one row per step) and the live positions (what is in
    flight): a merge, no per-position SQL. SQLite dedups and orders the live positions
    (a merge of the ledger's sample_seq index with the spare pool), and each settled span
    finds the live positions inside it by bisection: O(spans x log live), not a bisection
    per live position (6.5 -> 3 ms for the positions, 2 ms -> ~0 for the spans at 10k
    groups in flight; every snapshot's copy check runs this)."""
    live = [r[0] for r in conn.execute("SELECT sample_seq FROM prompt_groups UNION SELECT sample_seq FROM spare_prompts "
                                       "ORDER BY 1")]
    settled = sum(r.end - r.start for r in runs)
    missing = [f"missing {cursor - len(live) - settled} of {cursor} positions"] if len(live) + settled < cursor else []
    both, twice, beyond = [], [], []
    union: list[list[int]] = []  # the settled positions as disjoint spans, in order
    for r in runs:  # sorted by start
        if union and r.start < union[-1][1]:
            twice.append(f"positions {r.start}..{min(r.end, union[-1][1]) - 1}")
        if union and r.start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], r.end)
        else:
            union.append([r.start, r.end])
        if r.end > cursor:
            beyond.append(f"positions {r.start}..{r.end - 1}")
    for start, end in union:
        inside = live[bisect.bisect_left(live, start):bisect.bisect_left(live, end)]
        both += [f"position {seq}" for seq in inside]
    return [
        (1, "sampler positions handed out but neither in the ledger nor in the spare pool", missing),
        (1, "sampler positions both settled (settled_steps) and in the ledger or the spare pool", both),
        (1, "settled records that overlap (positions settled twice)", twice),
        (4, "settled positions beyond the sampler cursor", beyond),
    ]


def _check_prompts(conn: sqlite3.Connection, report: InvariantReport, runs: list[SettledRun]) -> None:
    """Invariant 1 over prompts: no (epoch, prompt id) settled twice or settled and live at
    once, and every settled position left its prompt's bit (`settled_prompts`). Python
    over the bitmaps, which SQL cannot test bit by bit (`audit_prompts`)."""
    audit = audit_prompts(conn, runs)
    if audit.twice:
        examples = ", ".join(audit.twice[:MAX_EXAMPLES]) + (", ..." if len(audit.twice) > MAX_EXAMPLES else "")
        report.add(1, f"invariant 1: {audit.duplicated} prompt(s) handed out more than once "
                      f"(settled twice, or settled and live): {examples}")
    if audit.unrecorded:
        report.add(1, f"invariant 1: settled positions and settled prompts (settled_prompts) differ by "
                      f"{audit.unrecorded}: a settle that left no prompt bit, or a bit without a position")


@dataclass
class PromptAudit:
    """Exactly-once over prompts, from `settled_prompts` and the live rows. `twice`: one
    line per duplicated hand-out ('epoch E prompt P xN', or 'epoch E: K prompt(s) settled
    twice' where the bitmap keeps no id); `duplicated`: the hand-outs beyond the first;
    `unrecorded`: settled positions minus recorded settles (a settle that left no bit)."""

    twice: list[str]
    duplicated: int
    unrecorded: int


_PROMPT_COLUMNS = (("epoch", "int"), ("chunk", "int"), ("bits", "blob"), ("settles", "int"))


def _prompt_chunks(raw: sqlite3.Connection) -> tuple[dict[tuple[int, int], tuple[bytes, int]], int | None]:
    """`settled_prompts` as {(epoch, chunk): (bits, settles)} and the prompt ids per chunk;
    a file older than v1_9_a (one bitmap per epoch) reads as chunk 0 of unbounded width
    (None)."""
    if not raw.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'settled_prompts'").fetchone():
        return {}, None
    chunked = any(r[1] == "chunk" for r in raw.execute("PRAGMA table_info(settled_prompts)"))
    sql = ("SELECT epoch, chunk, bits, settles FROM settled_prompts" if chunked
           else "SELECT epoch, 0, bits, settles FROM settled_prompts")
    out: dict[tuple[int, int], tuple[bytes, int]] = {}
    for row in raw.execute(sql):
        # bytes(an INTEGER) would allocate it
        check_types(f"settled_prompts row epoch={row[0]!r:.40} chunk={row[1]!r:.40}", row, _PROMPT_COLUMNS)
        out[(row[0], row[1])] = (row[2], row[3])
    return out, PROMPT_CHUNK if chunked else None


# The audit below reads the live rows through their UNIQUE (epoch, prompt_id) indexes:
# the prompts handed out more than once among them (a GROUP BY that follows each index's
# order, and the two tables' overlap), and, per chunk of the bitmaps, the live prompts in
# that chunk's range, whose bits are tested. It was one GROUP BY over both tables (a sort
# of every live row) and a Python step per live row: 10-12 -> 2.4-4.4 ms at 10k groups in
# flight, run by every snapshot's copy check and every restore.
_TWICE_IN = "SELECT epoch, prompt_id, count(*) FROM {} GROUP BY epoch, prompt_id HAVING count(*) > 1"
_IN_BOTH = ("SELECT DISTINCT g.epoch, g.prompt_id FROM spare_prompts s "  # CROSS JOIN: driven from the (small) pool
            "CROSS JOIN prompt_groups g ON g.epoch = s.epoch AND g.prompt_id = s.prompt_id")
_IN_RANGE = ("SELECT prompt_id FROM prompt_groups WHERE epoch = ?1 AND prompt_id >= ?2 AND prompt_id < ?3 UNION ALL "
             "SELECT prompt_id FROM spare_prompts WHERE epoch = ?1 AND prompt_id >= ?2 AND prompt_id < ?3")


def _live_hand_outs(raw: sqlite3.Connection) -> dict[tuple[int, int], int]:
    """(epoch, prompt id) -> how many live rows (ledger and spare pool) hold it, for the
    prompts more than one does; the rest hold theirs once."""
    ledger = {(e, p): n for e, p, n in raw.execute(_TWICE_IN.format("prompt_groups"))}
    spare = {(e, p): n for e, p, n in raw.execute(_TWICE_IN.format("spare_prompts"))}
    both = {(e, p) for e, p in raw.execute(_IN_BOTH)}
    # per table: its count where it holds the prompt twice or more, else 1 where `both` finds it there
    return {k: ledger.get(k, int(k in both)) + spare.get(k, int(k in both)) for k in ledger.keys() | spare.keys() | both}


def _live_prompts_settled(raw: sqlite3.Connection, epoch: int, base: int, bits: bytes) -> list[int]:
    """The live rows' prompt ids of `epoch` whose bit is set in `bits` (the bitmap of the
    prompt ids from `base`), each once however many rows hold it."""
    rows = raw.execute(_IN_RANGE, (epoch, base, base + 8 * len(bits))).fetchall()
    return list({p for (p,) in rows if bits[(p - base) >> 3] >> ((p - base) & 7) & 1})


def audit_prompts(raw: sqlite3.Connection, runs: list[SettledRun] | None = None) -> PromptAudit:
    """Every (epoch, prompt id) handed out at most once over the run: live rows (ledger
    and spare pool) counted with the settled bit of their prompt, and each epoch's
    settles (summed over its chunks) against its set bits. Reads the live rows (what is
    in flight) and every chunk of the bitmaps; `runs`, the settled record already decoded
    (`settled_runs`), spares a second decode."""
    has = lambda t: raw.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (t,)).fetchone()  # noqa: E731
    chunks, width = _prompt_chunks(raw)
    held = _live_hand_outs(raw)
    for (epoch, chunk), (bits, _) in chunks.items():
        base = chunk * width if width else 0
        # a chunk's bits past its width (a damaged row) belong to no prompt of it
        for prompt_id in _live_prompts_settled(raw, epoch, base, bits[:width // 8] if width else bits):
            held[(epoch, prompt_id)] = held.get((epoch, prompt_id), 1) + 1
    twice: list[str] = []
    duplicated = 0
    for (epoch, prompt_id), n in sorted(held.items()):
        if n > 1:
            duplicated += n - 1
            twice.append(f"epoch {epoch} prompt {prompt_id} x{n}")
    extra_by_epoch: dict[int, int] = {}
    for (epoch, _), (bits, settles) in chunks.items():
        # popcount in C: a snapshot checks every chunk of every epoch (copy_problems), and a
        # per-byte Python count was ~1 us per byte of bitmap, per epoch, at every snapshot
        ones = int.from_bytes(bits, "little").bit_count()
        extra_by_epoch[epoch] = extra_by_epoch.get(epoch, 0) + settles - ones
    for epoch, extra in sorted(extra_by_epoch.items()):
        if extra > 0:  # fewer settles than bits: a bit without its settle, `unrecorded` says it
            duplicated += extra
            twice.append(f"epoch {epoch}: {extra} prompt(s) settled twice")
    unrecorded = 0
    if has("settled_steps") or has("settled_ranges"):
        positions = sum(r.end - r.start for r in (settled_runs(raw) if runs is None else runs))
        unrecorded = positions - sum(n for _, n in chunks.values())
    return PromptAudit(twice, duplicated, unrecorded)
