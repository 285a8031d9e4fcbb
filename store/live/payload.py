"""Sample payload, inline or in an immutable payload segment: the one reader, and the
live store's side of sealing (revision v1_6_a).

A finished sample's token ids and logprobs never change. Until a snapshot seals them
they are inline in ``samples``; the snapshot pump then writes them once into a segment
file (``CHECKPOINT_DIR/payload_segments/segment_<n>.sqlite``: where and under which name
is the checkpoint directory's layout, `store/checkpoints/layout.py`; written and made
durable by `store/checkpoints/segments.py`; this module is given the directory) and then, in write transactions, records the segment in
``payload_segments`` (`record_segment`) and points the samples at it (`point_at_segment`,
a few MiB of payload per transaction), dropping their inline
BLOBs. From then on no snapshot copies that payload again: each snapshot's store file
holds the references and its manifest lists the segments with their checksums.

A segment is a SQLite file with one table::

    payload(sample_id INTEGER PRIMARY KEY, token_ids BLOB NOT NULL, logprobs BLOB NOT NULL)

the same BLOB dtypes as ``samples`` (`codec`: int32 / float32 little-endian). Why SQLite
and not Parquet or Arrow IPC: one file format for the whole project (``inspect`` and
``sqlite3`` open it, ``PRAGMA integrity_check`` checks it, DuckDB's sqlite scanner reads
it: ``SELECT * FROM sqlite_scan('segment_3.sqlite', 'payload')``), no new dependency,
and the BLOBs stay byte-for-byte what the live store held, so the one reader below
returns the same bytes whichever place a payload is in. The price is SQLite's page
overhead (~1-2% for payloads of hundreds of tokens) against Parquet's compression, which
buys little on random token ids and float logprobs.

A prefix segment (revision v1_8_a) is the same file: a prefix cut writes the tokens its
running calls decoded since the last published cut into one, its rows keyed by chunk
(`token_chunks.segment_row`; an empty `logprobs` BLOB for a chunk without them), and
the snapshot's `token_chunks` reference its rows; `pools.read_chunks` reads them back
through `read_segment`. A store file records each segment it references in
``payload_segments``, samples' and chunks' alike, so one listing
(`referenced_segments`) feeds the manifest, retention and the checks.

Every reader of payload goes through `read_samples`: it reads the rows from the store,
then, per segment, opens the segment once with the project's one read-only open
(`open_readonly`: ``immutable``, no side file, writes refused) and takes the payload of
the rows that point there. Nothing in rolloutdb opens a published segment for writing.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, delete, insert, select, update

from ..errors import StoreError
from ..sqlite.readonly import open_readonly
from .codec import TOKEN_DTYPE
from .schema import T

SEGMENT_TABLE = "payload"
SEGMENT_FORMAT = 1  # PRAGMA user_version of a segment file
SEGMENT_DDL = (f"CREATE TABLE {SEGMENT_TABLE} (sample_id INTEGER PRIMARY KEY, token_ids BLOB NOT NULL, "
               "logprobs BLOB NOT NULL)")

_samples = T["samples"]
_segments = T["payload_segments"]


class SegmentMissing(StoreError):
    """A sample points at a segment that is not there, or whose file lacks its payload."""


@dataclass(frozen=True)
class SegmentRef:
    """A segment as the store records it (``payload_segments``)."""

    segment_id: int
    file_name: str
    blake3: str
    bytes: int
    rows: int


# --------------------------------------------------------------------------- reading


def read_samples(conn: Connection | sqlite3.Connection, group_ids: Sequence[int],
                 segments_dir: str | Path | None) -> list[tuple]:
    """The samples of `group_ids` as rows (group_id, generation_index, prompt_id,
    token_ids, logprobs, reward, version_token_counts), by group then generation, with
    the payload BLOBs (still encoded, `codec`) taken inline or from their segment.
    `segments_dir`: where the store's segments are (the caller knows the checkpoint
    directory: `checkpoints.layout.segments_dir_of`);
    None only for a store that references none. Raises SegmentMissing naming the
    segment when one cannot give a payload it should."""
    ids = json.dumps([int(g) for g in group_ids])
    sql = ("SELECT s.group_id, s.generation_index, s.prompt_id, s.token_ids, s.logprobs, s.reward, "
           "s.version_token_counts, s.sample_id, p.file_name FROM samples s "
           "LEFT JOIN payload_segments p ON p.segment_id = s.segment_id "
           "WHERE s.group_id IN (SELECT value FROM json_each(?)) ORDER BY s.group_id, s.generation_index")
    raw = conn.execute(sql, (ids,)).fetchall() if isinstance(conn, sqlite3.Connection) \
        else conn.exec_driver_sql(sql, (ids,)).all()
    rows = [list(r) for r in raw]
    by_file: dict[str, list[list[Any]]] = {}
    for r in rows:
        if r[8] is not None:
            by_file.setdefault(r[8], []).append(r)
    for name, wanted in sorted(by_file.items()):
        found = read_segment(segments_dir, name, [r[7] for r in wanted])
        for r in wanted:
            r[3], r[4] = found[r[7]]
    return [tuple(r[:7]) for r in rows]


def read_segment(segments_dir: str | Path | None, file_name: str, sample_ids: Sequence[int]) -> dict[int, tuple[bytes, bytes]]:
    """row id -> (token_ids, logprobs) of `sample_ids` from one segment, opened once,
    read-only (a payload segment's rows are samples, a prefix segment's are chunks).
    Every id must be there."""
    if segments_dir is None:
        raise SegmentMissing(f"samples reference payload segment {file_name} but no segments directory was given; "
                             "open the store with its checkpoint directory's payload_segments/")
    path = Path(segments_dir) / file_name
    if not path.is_file():
        raise SegmentMissing(f"{path}: missing; samples of this store reference it (restore a snapshot whose "
                             "segments are intact, `rolloutdb verify CHECKPOINT_DIR` names them)")
    found: dict[int, tuple[bytes, bytes]] = {}
    with contextlib.closing(open_readonly(path)) as seg:
        ids = json.dumps([int(i) for i in sample_ids])
        for sid, tok, lp in seg.execute(f"SELECT sample_id, token_ids, logprobs FROM {SEGMENT_TABLE} "
                                        "WHERE sample_id IN (SELECT value FROM json_each(?))", (ids,)):
            found[sid] = (tok, lp)
    lost = sorted(set(sample_ids) - set(found))
    if lost:
        raise SegmentMissing(f"{path}: lacks the payload of sample(s) {', '.join(map(str, lost[:5]))}; "
                             "the segment is damaged: restore a snapshot whose segments verify")
    return found


# --------------------------------------------------------------------------- references


def _chunk_references(conn: sqlite3.Connection | Connection) -> bool:
    """Whether the file's `token_chunks` can reference segments (revision v1_8_a on)."""
    sql = "SELECT count(*) FROM pragma_table_info('token_chunks') WHERE name = 'segment_id'"
    if isinstance(conn, sqlite3.Connection):
        return bool(conn.execute(sql).fetchone()[0])
    return bool(conn.exec_driver_sql(sql).scalar())


def referenced_segments(conn: Connection | sqlite3.Connection) -> list[SegmentRef]:
    """The segments the store's samples and (in a snapshot file) its running calls'
    prefix chunks reference, by id: what its manifest lists and retention keeps."""
    if isinstance(conn, sqlite3.Connection):
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "payload_segments" not in tables:  # a file from before v1_6_a: payload inline
            return []
    chunks = " UNION SELECT segment_id FROM token_chunks WHERE segment_id IS NOT NULL" if _chunk_references(conn) else ""
    sql = ("SELECT segment_id, file_name, blake3, bytes, rows FROM payload_segments WHERE segment_id IN "
           f"(SELECT segment_id FROM samples WHERE segment_id IS NOT NULL{chunks}) ORDER BY segment_id")
    if isinstance(conn, sqlite3.Connection):
        return [SegmentRef(*r) for r in conn.execute(sql).fetchall()]
    return [SegmentRef(*r) for r in conn.exec_driver_sql(sql).all()]


def sample_references(conn: sqlite3.Connection) -> dict[str, list[int]]:
    """Segment file name -> the row ids that must be in it (sorted): the samples that
    point at it, or the prefix chunks (`token_chunks.segment_row`, v1_8_a) that do; a
    segment holds one kind only (a seal's samples or a cut's chunks). What a store file
    says each segment must hold. Empty for a file from before v1_6_a."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "payload_segments" not in tables:
        return {}
    out: dict[str, list[int]] = {}
    for name, sid in conn.execute("SELECT p.file_name, s.sample_id FROM samples s JOIN payload_segments p "
                                  "ON p.segment_id = s.segment_id ORDER BY p.file_name, s.sample_id"):
        out.setdefault(name, []).append(sid)
    if _chunk_references(conn):
        for name, row in conn.execute("SELECT DISTINCT p.file_name, c.segment_row FROM token_chunks c "
                                      "JOIN payload_segments p ON p.segment_id = c.segment_id "
                                      "ORDER BY p.file_name, c.segment_row"):
            out.setdefault(name, []).append(row)
    return out


def file_references(path: str | Path) -> set[str]:
    """The segment file names a store file (live or a snapshot's) references, read
    through `open_readonly` (a live store with a WAL is read from a private copy)."""
    with contextlib.closing(open_readonly(path)) as conn:
        return {r.file_name for r in referenced_segments(conn)}


def next_segment_id(conn: Connection) -> int:
    """The number the next segment gets from this store (AUTOINCREMENT's sequence + 1)."""
    seq = conn.exec_driver_sql("SELECT seq FROM sqlite_sequence WHERE name = 'payload_segments'").scalar()
    return int(seq or 0) + 1


# --------------------------------------------------------------------------- sealing


def inline_payloads(conn: Connection, limit_bytes: int | None = None) -> list[tuple[int, bytes, bytes]]:
    """(sample_id, token_ids, logprobs) of the samples whose payload is still inline, by
    id; up to about `limit_bytes` of payload when given."""
    s = _samples
    q = select(s.c.sample_id, s.c.token_ids, s.c.logprobs).where(s.c.segment_id.is_(None)).order_by(s.c.sample_id)
    out, total = [], 0
    for sid, tok, lp in conn.execute(q):
        out.append((sid, tok, lp))
        total += len(tok) + len(lp)
        if limit_bytes is not None and total >= limit_bytes:
            break
    return out


def record_segment(tx: Connection, segment_id: int, file_name: str, blake3: str, size: int, rows: int) -> None:
    """In the caller's write transaction: record a durable segment, and drop the rows of
    segments no sample references any more (their files go when no kept snapshot lists
    them either: retention). The caller made the segment durable first: a reference is
    never committed before its file is."""
    s = _samples
    tx.execute(delete(_segments).where(_segments.c.segment_id.not_in(
        select(s.c.segment_id).where(s.c.segment_id.is_not(None)).distinct())))
    tx.execute(insert(_segments).values(segment_id=segment_id, file_name=file_name, blake3=blake3, bytes=size,
                                        rows=rows, created_at=time.time()))


def point_at_segment(tx: Connection, segment_id: int, sample_ids: Sequence[int]) -> int:
    """In the caller's write transaction: point the samples of `sample_ids` that still
    hold their payload inline at the recorded segment `segment_id` (a sample trained and
    deleted since the segment was written is simply not there), dropping their inline
    BLOBs. Returns the samples pointed. SQLite walks and frees each dropped BLOB's
    overflow chain here (~1 page per 4 KiB of payload), which is why the caller
    points a few MiB of payload per transaction (segments.POINT_STEP_BYTES)."""
    s = _samples
    moved = 0
    for start in range(0, len(sample_ids), 5000):  # stays under SQLite's bound-variable limit
        chunk = list(sample_ids[start:start + 5000])
        moved += tx.execute(update(s).where(s.c.sample_id.in_(chunk), s.c.segment_id.is_(None))
                            .values(segment_id=segment_id, token_ids=None, logprobs=None)).rowcount
    return moved


def payload_counts(conn: sqlite3.Connection) -> dict[str, int]:
    """Samples with inline payload, samples in segments, and segments referenced (for
    `inspect`); a file from before v1_6_a has only inline payload."""
    cols = {r[1] for r in conn.execute("PRAGMA table_info(samples)")}
    if "segment_id" not in cols:
        (n,) = conn.execute("SELECT count(*) FROM samples").fetchone()
        return {"inline": n, "in_segments": 0, "segments": 0}
    inline, sealed, segs = conn.execute(
        "SELECT count(*) - count(segment_id), count(segment_id), count(DISTINCT segment_id) FROM samples").fetchone()
    return {"inline": inline, "in_segments": sealed, "segments": segs}


def segment_summary(conn: sqlite3.Connection) -> dict[str, Any] | None:
    """What a payload segment file holds (for `inspect`), or None when `conn` is not one:
    a file with the segment's one table and no alembic_version (a store has one)."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if tables != {SEGMENT_TABLE}:
        return None
    columns = [r[1] for r in conn.execute(f"PRAGMA table_info({SEGMENT_TABLE})")]
    if columns != ["sample_id", "token_ids", "logprobs"]:
        return None
    (form,) = conn.execute("PRAGMA user_version").fetchone()
    n, first, last, token_bytes, logprob_bytes = conn.execute(
        f"SELECT count(*), min(sample_id), max(sample_id), total(length(token_ids)), total(length(logprobs)) "
        f"FROM {SEGMENT_TABLE}").fetchone()
    return {"kind": "payload_segment", "format": form, "samples": n, "first_sample_id": first,
            "last_sample_id": last, "tokens": int(token_bytes) // TOKEN_DTYPE.itemsize,
            "payload_bytes": int(token_bytes + logprob_bytes)}
