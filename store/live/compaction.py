"""Settled groups leave the live store: the commit that trains or discards a group
deletes its ledger row and its attempt rows and records its sampler position in
`settled_steps` (schema.SettledStep): about one row per train step.

Why at the settling commit and not batched every N settles: the invariants must hold at
every commit, and a batch would leave a window in which a settled group is both a row
and (after the batch) a record; doing it in the same transaction keeps one place per
position at every commit, and the live store's row counts follow what is in flight
(tests/test_bounded_store.py).

Where a position goes. Trained positions of one (trained step, stamped step) go to the
row with the highest start at or below their first position if it is that step's row
(a step trained in several commits stays one row), else to a new row starting there;
positions of its span trained elsewhere or still live are open entries of its blob.
A discarded position goes to the row with the highest start at or below it: an open
entry of its span takes the discard's reason code, a position past its end extends it
(the gap open). So a zero-variance discard among a step's positions costs a few bytes
of a neighbouring row, not a split of the step's run and a row of its own (v1_4_a's
ranges: ~3 rows per step; BENCHMARKS.md "A bounded live store"). A row whose blob would
pass MAX_OTHERS bytes is not extended: the discard starts a row of its own, so one
rewrite stays small however many discards a stretch of positions has.

Cost per settling commit: one primary-key probe and one write per step trained, two
probes and one write per batch of discards joining one row, plus one read of
`discard_reasons` when there is a discard
(bench/bench_transitions.py measures the transition rate). The blob is decoded and
encoded here (`decode_row`, `encode_row`: the one codec of the record); every reader
expands rows through `queries.settled_runs`.

Each settled group's (epoch, prompt id) sets a bit of its epoch's bitmap in
`settled_prompts` in the same transaction (schema.SettledPrompts): the record proves
each position once, the bitmaps each prompt once (`invariants.audit_prompts`). The
bitmap is kept in chunks of PROMPT_CHUNK prompt ids, and a settle rewrites only the
chunk its prompt is in.

The payload rows (samples, replay, chunks, episodes) are dropped by
the ledger's transitions before this runs; here only the ledger and attempt rows go.

One row per step is still O(run): ~27 bytes a step that every snapshot copied and
~20 us a step that every snapshot's copy check decoded. So every FOLD_EVERY train steps
the settle folds the positions below both the lowest live position and the first row of
a step it keeps into `settled_prefix` (revision v1_12_a): counts, not rows
(`fold_settled`). The rows stay about KEEP_STEPS + FOLD_EVERY whatever the run's length;
a rewind below the folded steps is refused (restore/rewind.py).
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Connection, delete, select

from .. import faults
from ..errors import IllegalTransition, RecordDamaged
from ..sqlite.prepared import Prepared, _driver, in_json, json_ids
from .schema import PROMPT_CHUNK, T

groups = T["prompt_groups"]
rollouts = T["rollouts"]

# --------------------------------------------------------------------------- the blob

OPEN = 0  # code of a position not settled in a `settled_steps` row
TRAINED = -1  # in memory only: a position trained at its row's step (not in the blob)


# A position, a length or a reason code fits in SQLite's 64-bit integer: 10 bytes of
# LEB128. A longer varint is damage or forgery, refused before Python builds (in time
# quadratic in its length) an integer too long to print.
MAX_VARINT_BYTES = 10


def _where(seq_start: object) -> str:
    return f"settled_steps row seq_start={seq_start if isinstance(seq_start, int) else type(seq_start).__name__}"


def _varints(blob: bytes, where: str = "settled_steps") -> list[int]:
    out, value, shift, size = [], 0, 0, 0
    for byte in blob:
        size += 1
        if size > MAX_VARINT_BYTES:
            raise RecordDamaged(f"{where}: others holds a varint longer than {MAX_VARINT_BYTES} bytes; "
                                "the record is damaged: restore another snapshot")
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            out.append(value)
            value, shift, size = 0, 0, 0
    if shift or len(out) % 3:
        raise RecordDamaged(f"{where}: others is a truncated blob ({len(blob)} bytes); "
                            "the record is damaged: restore another snapshot")
    return out


def _sql_type(value: object) -> str:
    return {int: "INTEGER", float: "REAL", str: "TEXT", bytes: "BLOB"}.get(type(value), type(value).__name__)


def check_types(where: str, row: Sequence[object], columns: Sequence[tuple[str, str]]) -> None:
    """Refuse a row whose columns are not of the declared SQLite types (SQLite stores
    any type in any column: a forged file can hold TEXT where a BLOB belongs). Each of
    `columns` is (name, expected): "int", "int?" (or NULL), "text", "text?", "blob?"."""
    for value, (name, expected) in zip(row, columns):
        kind = expected.rstrip("?")
        if value is None and expected.endswith("?"):
            continue
        ok = {"int": type(value) is int, "text": type(value) is str, "blob": type(value) is bytes}[kind]
        if not ok:
            want = {"int": "INTEGER", "text": "TEXT", "blob": "BLOB"}[kind] + (" or NULL" if expected.endswith("?") else "")
            raise RecordDamaged(f"{where}: {name} is {_sql_type(value) if value is not None else 'NULL'}, "
                                f"expected {want}; the record is damaged: restore another snapshot")


_STEP_COLUMNS = (("seq_start", "int"), ("seq_end", "int"), ("others", "blob?"))
# A row's stamps, checked by every reader that uses them (queries.settled_runs, fold_settled).
STAMP_COLUMNS = (("trained_step", "int?"), ("target_step", "int?"))


def decode_row(seq_start: int, seq_end: int, others: bytes | None) -> list[tuple[int, int, int]]:
    """One `settled_steps` row (schema.SettledStep) -> (start, end, code) runs covering
    [seq_start, seq_end) in order: code TRAINED, OPEN or a discard reason's code. The
    only decoder of the blob: `queries.settled_runs` (the one reader of the record)
    expands rows through it, and the writer below rewrites a row through it and
    `encode_row`. Raises RecordDamaged naming the row when a column is not of its type
    or the blob is not a sequence of (gap, length, code) varints."""
    where = _where(seq_start)
    check_types(where, (seq_start, seq_end, others), _STEP_COLUMNS)
    runs: list[tuple[int, int, int]] = []
    at = seq_start
    values = _varints(others or b"", where)
    for i in range(0, len(values), 3):
        gap, length, code = values[i:i + 3]
        if gap:
            runs.append((at, at + gap, TRAINED))
        runs.append((at + gap, at + gap + length, code))
        at += gap + length
    if at < seq_end:
        runs.append((at, seq_end, TRAINED))
    return runs


def encode_row(runs: Sequence[tuple[int, int, int]]) -> bytes | None:
    """The inverse of `decode_row`: runs (contiguous, in order) -> the `others` blob
    (None when every position is trained). Adjacent runs of one code become one entry."""
    out = bytearray()
    at = runs[0][0] if runs else 0
    merged: list[list[int]] = []
    for a, b, code in runs:
        if merged and merged[-1][2] == code and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b, code])
    for a, b, code in merged:
        if code == TRAINED:
            continue
        for value in (a - at, b - a, code):
            while value > 0x7F:
                out.append(value & 0x7F | 0x80)
                value >>= 7
            out.append(value)
        at = b
    return bytes(out) or None



# --------------------------------------------------------------------------- the writer


# A blob longer than this is not extended by a discard (a new row starts instead): a
# rewrite re-encodes the row, so this bounds the bytes one settle rewrites. 64 bytes is
# ~20 entries; a quickstart step's row holds 1-3.
MAX_OTHERS = 64

_SETTLED_ROWS = Prepared(
    select(groups.c.sample_seq, groups.c.state, groups.c.trained_step, groups.c.target_step, groups.c.discard_reason,
           groups.c.epoch, groups.c.prompt_id)
    .where(in_json(groups.c.group_id))
    .order_by(groups.c.sample_seq)
)
_DELETE_ATTEMPTS = Prepared(delete(rollouts).where(in_json(rollouts.c.group_id)))
_DELETE_GROUPS = Prepared(delete(groups).where(in_json(groups.c.group_id)))
_ROW_AT = ("SELECT seq_start, seq_end, trained_step, target_step, others FROM settled_steps "
           "WHERE seq_start <= ? ORDER BY seq_start DESC LIMIT 1")


@dataclass
class _Row:
    """A `settled_steps` row being rewritten: its runs from `decode_row`."""

    start: int
    trained_step: int | None
    target_step: int | None
    runs: list[tuple[int, int, int]]
    new: bool

    @property
    def end(self) -> int:
        return self.runs[-1][1]


def _row_at(raw: sqlite3.Connection, seq: int) -> _Row | None:
    r = raw.execute(_ROW_AT, (seq,)).fetchone()
    return None if r is None else _Row(r[0], r[2], r[3], decode_row(r[0], r[1], r[4]), False)


def _refuse(seq: int, code: int) -> IllegalTransition:
    what = "trained" if code == TRAINED else "discarded"
    return IllegalTransition(f"sampler positions {seq}..{seq}: already settled ({what}); a position settles once")


def _paint(runs: list[tuple[int, int, int]], paints: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """`runs` (contiguous, in order) with each (position, code) of `paints` (in order)
    set: a position inside must be OPEN (else IllegalTransition: settled twice), one
    past the end extends the runs, the gap OPEN."""
    out: list[tuple[int, int, int]] = []
    rest = list(reversed(runs))  # a stack, the next run on top
    for seq, code in paints:
        while rest and rest[-1][1] <= seq:
            out.append(rest.pop())
        if rest and rest[-1][0] <= seq:
            a, b, old = rest.pop()
            if old != OPEN:
                raise _refuse(seq, old)
            if a < seq:
                out.append((a, seq, OPEN))
            if seq + 1 < b:
                rest.append((seq + 1, b, OPEN))
        elif out and out[-1][1] < seq:
            out.append((out[-1][1], seq, OPEN))
        out.append((seq, seq + 1, code))
    out += reversed(rest)
    return out


def _write(raw: sqlite3.Connection, row: _Row) -> None:
    others = encode_row(row.runs)
    if row.new:
        raw.execute("INSERT INTO settled_steps (seq_start, seq_end, trained_step, target_step, others) "
                    "VALUES (?, ?, ?, ?, ?)", (row.start, row.end, row.trained_step, row.target_step, others))
    else:
        raw.execute("UPDATE settled_steps SET seq_end = ?, others = ? WHERE seq_start = ?", (row.end, others, row.start))


def _add_trained(raw: sqlite3.Connection, step: int | None, target: int | None, seqs: list[int]) -> None:
    """Positions `seqs` (in order) trained at `step`, stamped `target`."""
    row = _row_at(raw, seqs[0])
    if row is None or (row.trained_step, row.target_step) != (step, target) or step is None:
        if row is not None:  # positions inside its span must be open there
            _paint(row.runs, [(s, TRAINED) for s in seqs if s < row.end])
        row = _Row(seqs[0], step, target, [], True)
    row.runs = _paint(row.runs, [(s, TRAINED) for s in seqs])
    _write(raw, row)


def _add_discards(raw: sqlite3.Connection, discards: list[tuple[int, int]]) -> None:
    """Discarded positions (in order, with their reason codes): each batch of positions
    below the next row's start joins the row with the highest start at or below them
    (past its end only while its blob stays within MAX_OTHERS), the rest a new row of
    discards. One probe and one write per batch (40k discards in one commit: one row)."""
    i = 0
    while i < len(discards):
        first = discards[i][0]
        row = _row_at(raw, first)
        nxt = raw.execute("SELECT min(seq_start) FROM settled_steps WHERE seq_start > ?", (first,)).fetchone()[0]
        j = i
        while j < len(discards) and (nxt is None or discards[j][0] < nxt):
            j += 1
        batch = discards[i:j]
        i = j
        if row is not None:
            painted = _paint(row.runs, batch)
            if batch[-1][0] < row.end or len(encode_row(painted) or b"") <= MAX_OTHERS:
                row.runs = painted
                _write(raw, row)
                continue
            inside = [d for d in batch if d[0] < row.end]
            if inside:
                row.runs = _paint(row.runs, inside)
                _write(raw, row)
            batch = batch[len(inside):]
        _write(raw, _Row(batch[0][0], None, None, _paint([], batch), True))


def _reason_codes(raw: sqlite3.Connection, reasons: set[str]) -> dict[str, int]:
    """Each reason's code in `discard_reasons`, added (next code) if new."""
    codes = {r: c for c, r in raw.execute("SELECT code, reason FROM discard_reasons")}
    for reason in sorted(reasons - codes.keys()):
        codes[reason] = max(codes.values(), default=0) + 1
        raw.execute("INSERT INTO discard_reasons (code, reason) VALUES (?, ?)", (codes[reason], reason))
    return codes


def settle_groups(conn: Connection, group_ids: Sequence[int]) -> None:
    """Compact `group_ids`, just moved to trained or discarded in this transaction:
    their positions join `settled_steps` and their ledger and attempt rows go.
    Raises IllegalTransition if a position is already recorded as settled in the row
    it would join (it would be settled twice: invariant 1)."""
    if not group_ids:
        return
    ids = {"ids": json_ids(group_ids)}
    rows = _SETTLED_ROWS.run(conn, ids).fetchall()
    raw = _driver(conn)
    folded = raw.execute("SELECT seq_end FROM settled_prefix").fetchone()
    if rows and folded and rows[0][0] < folded[0]:  # rows are in position order
        raise IllegalTransition(f"sampler positions {rows[0][0]}..{rows[0][0]}: already settled (folded into "
                                f"settled_prefix below {folded[0]}); a position settles once")
    _DELETE_ATTEMPTS.run(conn, ids)
    _DELETE_GROUPS.run(conn, ids)
    trained: dict[tuple[int | None, int | None], list[int]] = {}
    discarded: list[tuple[int, str]] = []
    for seq, state, step, target, reason, *_ in rows:  # in position order
        if state == "trained":
            trained.setdefault((step, target), []).append(seq)
        else:
            discarded.append((seq, reason))
    for (step, target), seqs in trained.items():
        _add_trained(raw, step, target, seqs)
    if discarded:
        codes = _reason_codes(raw, {r for _, r in discarded})
        _add_discards(raw, [(seq, codes[reason]) for seq, reason in discarded])
    mark_settled(raw, [(r[5], r[6]) for r in rows])


def _chunks_of(raw: sqlite3.Connection,
               prompts: Sequence[tuple[int, int]]) -> Iterator[tuple[tuple[int, int], list[int], Any]]:
    """((epoch, chunk), bit offsets in the chunk, its (bits, settles) row or None) for the
    chunks `prompts` ((epoch, prompt id) pairs) fall in: one key read per chunk."""
    by_chunk: dict[tuple[int, int], list[int]] = {}
    for epoch, prompt_id in prompts:
        chunk, bit = divmod(int(prompt_id), PROMPT_CHUNK)
        by_chunk.setdefault((int(epoch), chunk), []).append(bit)
    for (epoch, chunk), ids in by_chunk.items():
        yield (epoch, chunk), ids, raw.execute("SELECT bits, settles FROM settled_prompts WHERE epoch = ? AND chunk = ?",
                                               (epoch, chunk)).fetchone()


def mark_settled(raw: sqlite3.Connection, prompts: Sequence[tuple[int, int]]) -> None:
    """Set the bits of `prompts` ((epoch, prompt id) pairs) in `settled_prompts` and add
    them to their chunk's `settles`. A bit already set is not refused here: the epoch's
    settle count then exceeds its set bits and `prompt_problems` (invariant 1, verify)
    counts the prompt as duplicated. One primary-key read and one write of a chunk of at
    most PROMPT_CHUNK bits (512 bytes) per (epoch, chunk) the transaction touches: the cost
    of a settle does not grow with the dataset (one whole-epoch bitmap was 36 KB at 300k
    prompts, rewritten at every settle)."""
    for (epoch, chunk), ids, row in _chunks_of(raw, prompts):
        bits = bytearray(row[0]) if row else bytearray()
        need = max(ids) // 8 + 1
        if len(bits) < need:
            bits.extend(bytes(need - len(bits)))
        for p in ids:
            bits[p >> 3] |= 1 << (p & 7)
        raw.execute("INSERT OR REPLACE INTO settled_prompts (epoch, chunk, bits, settles) VALUES (?, ?, ?, ?)",
                    (epoch, chunk, bytes(bits), (row[1] if row else 0) + len(ids)))


def unsettle_trained_after(raw: sqlite3.Connection, step: int) -> list[int]:
    """The positions trained at steps after `step` leave the record (a resume from the
    trainer checkpoint of `step` alone, restore/rewind.py): their rows are deleted and
    the discards those rows carried are written back (`_add_discards`), so every other
    position keeps its outcome. Returns the positions unsettled, in order. One read of
    the rows after `step` (no index on trained_step: a scan of about one row per step,
    once per such resume)."""
    through = read_prefix(raw).through_step
    if through is not None and through > step:
        raise RecordDamaged(f"settled_prefix: the steps up to {through} are folded (which positions they trained is "
                            f"no longer recorded), so the record cannot be rolled back to step {step}")
    rows = raw.execute("SELECT seq_start, seq_end, others FROM settled_steps WHERE trained_step > ? "
                       "ORDER BY seq_start", (step,)).fetchall()
    trained: list[int] = []
    discards: list[tuple[int, int]] = []
    for start, end, others in rows:
        for a, b, code in decode_row(start, end, others):
            if code == TRAINED:
                trained.extend(range(a, b))
            elif code != OPEN:
                discards.extend((s, code) for s in range(a, b))
    raw.execute("DELETE FROM settled_steps WHERE trained_step > ?", (step,))
    if discards:
        _add_discards(raw, sorted(discards))
    return sorted(trained)


def unmark_settled(raw: sqlite3.Connection, prompts: Sequence[tuple[int, int]]) -> None:
    """The inverse of `mark_settled`: clear the bits of `prompts` ((epoch, prompt id)
    pairs settled once) and take them off their chunk's `settles`. A bit that is not set
    means the record and the sampler disagree on which prompt a position holds: refused
    (RecordDamaged), the caller's transaction rolls back."""
    for (epoch, chunk), ids, row in _chunks_of(raw, prompts):
        bits = bytearray(row[0]) if row else bytearray()
        for p in ids:
            if p >> 3 >= len(bits) or not bits[p >> 3] & (1 << (p & 7)):
                raise RecordDamaged(f"settled_prompts: prompt {chunk * PROMPT_CHUNK + p} of epoch {epoch} is not marked "
                                    "settled although its position is trained; the record does not match the sampler")
            bits[p >> 3] &= ~(1 << (p & 7)) & 0xFF
        raw.execute("UPDATE settled_prompts SET bits = ?, settles = ? WHERE epoch = ? AND chunk = ?",
                    (bytes(bits.rstrip(b"\0")), row[1] - len(ids), epoch, chunk))


# --------------------------------------------------------------------------- the folded prefix

# The record keeps a row per step for the last KEEP_STEPS train steps at least, and a
# train step whose number is a multiple of FOLD_EVERY folds what is older into
# `settled_prefix` (schema.SettledPrefix): the table then holds at most about
# KEEP_STEPS + FOLD_EVERY rows whatever the run's length, and a fold decodes about
# FOLD_EVERY rows (BENCHMARKS.md, "The settled record keeps the recent steps"). A resume
# from a trainer checkpoint alone rewinds to a step after the newest fold; the controller
# keeps more steps when its checkpoints are further apart (`keep_steps_for`).
KEEP_STEPS = 256
FOLD_EVERY = 64


@dataclass(frozen=True)
class Prefix:
    """The folded prefix: positions [0, seq_end) settled once each, `trained` of them
    trained, `discarded` {reason: count} the rest; `through_step`: the latest step folded."""

    seq_end: int = 0
    trained: int = 0
    discarded: dict[str, int] = field(default_factory=dict)
    through_step: int | None = None


_PREFIX_COLUMNS = (("seq_end", "int"), ("trained", "int"), ("discarded", "text"), ("through_step", "int?"))


def read_prefix(raw: sqlite3.Connection) -> Prefix:
    """`settled_prefix`'s row; an empty Prefix when nothing is folded or the file is older
    than v1_12_a. Raises RecordDamaged when its columns are not of their types or its
    counts do not add up to its positions."""
    if not raw.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'settled_prefix'").fetchone():
        return Prefix()
    row = raw.execute("SELECT seq_end, trained, discarded, through_step FROM settled_prefix").fetchone()
    if row is None:
        return Prefix()
    where = "settled_prefix row id=1"
    check_types(where, row, _PREFIX_COLUMNS)
    try:
        discarded = json.loads(row[2])
    except ValueError:
        discarded = None
    if not isinstance(discarded, dict) or not all(type(n) is int and n >= 0 for n in discarded.values()):
        raise RecordDamaged(f"{where}: discarded is not a JSON object of reason -> count; the record is "
                            "damaged: restore another snapshot")
    if row[1] + sum(discarded.values()) != row[0]:
        raise RecordDamaged(f"{where}: {row[1]} trained and {sum(discarded.values())} discarded positions do not "
                            f"add up to its {row[0]} positions; the record is damaged: restore another snapshot")
    return Prefix(row[0], row[1], discarded, row[3])


def keep_steps_for(interval_steps: int, keep_last: int) -> int:
    """The steps the record keeps a row for, given the trainer checkpoints' interval and
    how many are kept: a rewind can go back to the oldest kept checkpoint, so its steps
    stay rows, and never fewer than KEEP_STEPS."""
    return max(KEEP_STEPS, interval_steps * (keep_last + 1))


def fold_settled(raw: sqlite3.Connection, *, through_step: int) -> int:
    """Fold into `settled_prefix` the settled positions below `end`: the lowest live
    position (the ledger, the spare pool, the sampler cursor) or the lowest start of a
    row of a step after `through_step`, whichever is lower. Every row starting below
    `end` gives up its positions below it: they become counts, and the row goes, or
    keeps what it settles from `end` on as a row starting at its first such position (a
    discard joins the row below it, so old rows reach forward over newer ones: a fold of
    whole rows only would stop at the first of them). Returns the positions folded.
    The folded positions are checked to be settled once each, in order after the prefix
    (RecordDamaged otherwise: the settle's transaction rolls back). Reads the rows below
    the lowest live position (about KEEP_STEPS + FOLD_EVERY) and decodes the ones it folds."""
    prefix = read_prefix(raw)
    (cursor,) = raw.execute("SELECT next_seq FROM sampler_state").fetchone()
    lows = raw.execute("SELECT min(sample_seq) FROM prompt_groups UNION ALL SELECT min(sample_seq) FROM spare_prompts")
    end = min([cursor, *(r[0] for r in lows if r[0] is not None)])
    rows = raw.execute("SELECT seq_start, seq_end, trained_step, target_step, others FROM settled_steps "
                       "WHERE seq_start < ? ORDER BY seq_start", (end,)).fetchall()
    end = min([end, *(r[0] for r in rows if type(r[2]) is int and r[2] > through_step)])
    folding = [r for r in rows if r[0] < end]
    if not folding:
        return 0
    reasons = dict(raw.execute("SELECT code, reason FROM discard_reasons").fetchall())
    below: list[tuple[int, int, int]] = []
    kept: list[tuple[int, int | None, int | None, list[tuple[int, int, int]]]] = []
    top = prefix.through_step
    for start, stop, trained_step, target_step, others in folding:
        check_types(_where(start), (trained_step, target_step), STAMP_COLUMNS)
        runs = decode_row(start, stop, others)
        below += [(a, min(b, end), code) for a, b, code in runs if a < end and code != OPEN]
        rest = [(max(a, end), b, code) for a, b, code in runs if b > end]
        while rest and rest[0][2] == OPEN:  # a row starts at a position it settles
            rest.pop(0)
        while rest and rest[-1][2] == OPEN:
            rest.pop()
        if rest:  # what it settles from `end` on; a row of discards only has no step (schema.SettledStep)
            stamps = (trained_step, target_step) if any(code == TRAINED for *_, code in rest) else (None, None)
            kept.append((rest[0][0], *stamps, rest))
        if trained_step is not None and any(code == TRAINED for a, _, code in runs if a < end):
            top = trained_step if top is None else max(top, trained_step)
    trained, discarded, at = prefix.trained, dict(prefix.discarded), prefix.seq_end
    for a, b, code in sorted(below):
        if a != at:
            what = f"positions {at}..{a - 1} are not settled" if a > at else f"positions {a}..{min(b, at) - 1} are settled twice"
            raise RecordDamaged(f"settled_steps: cannot fold the positions below {end}: {what}; the record is "
                                "damaged: restore another snapshot")
        if code == TRAINED:
            trained += b - a
        else:
            reason = reasons.get(code, f"unknown code {code}")
            discarded[reason] = discarded.get(reason, 0) + b - a
        at = b
    if at != end:
        raise RecordDamaged(f"settled_steps: cannot fold the positions below {end}: positions {at}..{end - 1} are "
                            "not settled; the record is damaged: restore another snapshot")
    raw.execute("DELETE FROM settled_steps WHERE seq_start < ?", (end,))
    try:
        for start, trained_step, target_step, runs in kept:
            raw.execute("INSERT INTO settled_steps (seq_start, seq_end, trained_step, target_step, others) "
                        "VALUES (?, ?, ?, ?, ?)", (start, runs[-1][1], trained_step, target_step, encode_row(runs)))
    except sqlite3.IntegrityError:  # two rows settle one position: their starts clash
        raise RecordDamaged(f"settled_steps: cannot fold the positions below {end}: two rows settle position "
                            f"{start}; the record is damaged: restore another snapshot") from None
    faults.point("settle.rows_folded")
    raw.execute("INSERT OR REPLACE INTO settled_prefix (id, seq_end, trained, discarded, through_step) "
                "VALUES (1, ?, ?, ?, ?)", (end, trained, json.dumps(discarded, sort_keys=True), top))
    return end - prefix.seq_end
