"""One settled row per train step: ``settled_steps`` replaces ``settled_ranges``.

Revision ID: v1_5_a
Revises: v1_4_a
Create Date: 2026-12-01

v1_4_a recorded settled positions as run-length ranges keyed by outcome, steps and
reason, so every zero-variance discard among a step's positions split the step's run:
~3 rows per step, and the quickstart's live store grew 1.28x from 30 to 300 steps
(goal <= 1.2x; BENCHMARKS.md "A bounded live store"). From here on:

* table ``settled_steps``: ``seq_start`` (primary key, a position settled in the row),
  ``seq_end`` (one past the last position), ``trained_step``, ``target_step`` (the
  stamped step of its trained positions), ``others`` (BLOB, NULL when empty): the
  positions of [seq_start, seq_end) not trained at ``trained_step``, as entries of three
  unsigned LEB128 varints (gap after the previous entry's end, length, code): code 0 =
  not settled in this row, k >= 1 = discarded for ``discard_reasons.code`` k. A row of
  discards only has ``trained_step`` NULL and lists all its positions.

* table ``discard_reasons``: ``code`` (primary key), ``reason``.

Data migration: the trained ranges of one (trained step, stamped step) become one row
spanning them (the positions between, open); each discarded range joins the row with
the highest start at or below it (an open stretch of its span takes the reason's code,
or the row extends to it), or starts a row of discards when none can take it. A file
whose ranges overlap (a position settled twice) is refused: it breaks invariant 1 and
the new record could not keep both. Then ``settled_ranges`` goes.

Frozen: the tables and the encoding are written out here as they are at this revision;
nothing reads the application's code.
"""

import bisect

from alembic import op

revision = "v1_5_a"
down_revision = "v1_4_a"
branch_labels = None
depends_on = None

CREATE_STEPS = """CREATE TABLE settled_steps (
\tseq_start INTEGER NOT NULL,
\tseq_end INTEGER NOT NULL,
\ttrained_step INTEGER,
\ttarget_step INTEGER,
\tothers BLOB,
\tCONSTRAINT pk_settled_steps PRIMARY KEY (seq_start),
\tCONSTRAINT ck_settled_steps_nonempty CHECK (seq_end > seq_start)
)"""

CREATE_REASONS = """CREATE TABLE discard_reasons (
\tcode INTEGER NOT NULL,
\treason VARCHAR(64) NOT NULL,
\tCONSTRAINT pk_discard_reasons PRIMARY KEY (code)
)"""

CREATE_RANGES = """CREATE TABLE settled_ranges (
\tseq_start INTEGER NOT NULL,
\tseq_end INTEGER NOT NULL,
\toutcome VARCHAR(16) NOT NULL,
\ttrained_step INTEGER,
\ttarget_step INTEGER,
\tdiscard_reason VARCHAR(64),
\tCONSTRAINT pk_settled_ranges PRIMARY KEY (seq_start),
\tCONSTRAINT ck_settled_ranges_nonempty CHECK (seq_end > seq_start),
\tCONSTRAINT ck_settled_ranges_outcome CHECK (outcome IN ('trained', 'discarded'))
)"""

OPEN, TRAINED = 0, -1
MAX_EXTENDS = 16  # discards one row takes past its end before a new row starts


def _varint(out: bytearray, value: int) -> None:
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)


class _Row:
    """A row being built: `codes` holds every position of its span not trained here."""

    def __init__(self, start: int, step, target):
        self.start, self.end, self.step, self.target = start, start, step, target
        self.codes: dict[int, int] = {}
        self.extends = 0

    def set(self, a: int, b: int, code: int) -> None:
        for seq in range(self.end, a):
            self.codes[seq] = OPEN
        for seq in range(a, b):
            if seq < self.end and self.codes.get(seq, TRAINED) != OPEN:
                raise RuntimeError(f"settled_ranges: position {seq} is settled twice (invariant 1); this file cannot "
                                   "be upgraded: restore another snapshot")
            if code == TRAINED:
                self.codes.pop(seq, None)
            else:
                self.codes[seq] = code
        self.end = max(self.end, b)

    def others(self) -> bytes | None:
        out, at = bytearray(), self.start
        seqs = sorted(self.codes)
        i = 0
        while i < len(seqs):
            j = i
            while j + 1 < len(seqs) and seqs[j + 1] == seqs[j] + 1 and self.codes[seqs[j + 1]] == self.codes[seqs[i]]:
                j += 1
            for value in (seqs[i] - at, j - i + 1, self.codes[seqs[i]]):
                _varint(out, value)
            at = seqs[j] + 1
            i = j + 1
        return bytes(out) or None


def _rows(ranges, codes: dict) -> list[_Row]:
    trained: dict[tuple, _Row] = {}
    for a, b, outcome, step, target, _ in ranges:
        if outcome == "trained":
            row = trained.get((step, target))
            if row is None:
                row = trained[(step, target)] = _Row(a, step, target)
            row.set(a, b, TRAINED)
    rows = sorted(trained.values(), key=lambda r: r.start)
    starts = [r.start for r in rows]
    for a, b, outcome, _, _, reason in ranges:
        if outcome != "discarded":
            continue
        i = bisect.bisect_right(starts, a) - 1
        row = rows[i] if i >= 0 else None
        if row is not None and (b <= row.end or row.extends < MAX_EXTENDS):
            row.extends += b > row.end
        else:
            row = _Row(a, None, None)
            rows.insert(i + 1, row)
            starts.insert(i + 1, a)
        row.set(a, b, codes[reason])
    return rows


def upgrade() -> None:
    bind = op.get_bind()
    run = bind.exec_driver_sql
    run(CREATE_STEPS)
    run(CREATE_REASONS)
    ranges = run("SELECT seq_start, seq_end, outcome, trained_step, target_step, discard_reason "
                 "FROM settled_ranges ORDER BY seq_start").fetchall()
    codes = {r: i + 1 for i, r in enumerate(sorted({r[5] for r in ranges if r[2] == "discarded"}, key=str))}
    for reason, code in codes.items():
        run("INSERT INTO discard_reasons (code, reason) VALUES (?, ?)", (code, reason))
    rows = _rows(ranges, codes)
    if rows:
        # One statement for every row (100k settled groups: ~2k rows).
        bind.connection.driver_connection.executemany(
            "INSERT INTO settled_steps (seq_start, seq_end, trained_step, target_step, others) VALUES (?, ?, ?, ?, ?)",
            [(r.start, r.end, r.step, r.target, r.others()) for r in rows])
    run("DROP TABLE settled_ranges")


def _decode(start: int, end: int, others: bytes | None) -> list[tuple[int, int, int]]:
    values, value, shift = [], 0, 0
    for byte in others or b"":
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            values.append(value)
            value, shift = 0, 0
    runs, at = [], start
    for i in range(0, len(values) - 2, 3):
        gap, length, code = values[i:i + 3]
        if gap:
            runs.append((at, at + gap, TRAINED))
        runs.append((at + gap, at + gap + length, code))
        at += gap + length
    if at < end:
        runs.append((at, end, TRAINED))
    return runs


def downgrade() -> None:
    # Back to ranges: every settled run of a row becomes a range (adjacent ones of one
    # key are not merged again; v1_4_a reads them all the same).
    bind = op.get_bind()
    run = bind.exec_driver_sql
    reasons = dict(run("SELECT code, reason FROM discard_reasons").fetchall())
    out = []
    for start, end, step, target, others in run(
            "SELECT seq_start, seq_end, trained_step, target_step, others FROM settled_steps").fetchall():
        for a, b, code in _decode(start, end, others):
            if code == TRAINED:
                out.append((a, b, "trained", step, target, None))
            elif code != OPEN:
                out.append((a, b, "discarded", None, None, reasons.get(code)))
    run(CREATE_RANGES)
    if out:
        bind.connection.driver_connection.executemany(
            "INSERT INTO settled_ranges (seq_start, seq_end, outcome, trained_step, target_step, discard_reason) "
            "VALUES (?, ?, ?, ?, ?, ?)", out)
    op.drop_table("discard_reasons")
    op.drop_table("settled_steps")
