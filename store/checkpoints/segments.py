"""Payload segments on disk: sealing the live store's inline payload into an immutable
segment, checking the segments a snapshot lists, and removing the ones nothing needs.

    CHECKPOINT_DIR/
      payload_segments/
        segment_<n>.sqlite      one table `payload` (store/live/payload.py says why SQLite;
                                the place and the names are checkpoints/layout.py's)
        .segment_<n>.sqlite.seal.<pid>.tmp     being written (a crash leaves it; next save removes it)
        .segment_<n>.sqlite.<pid>.trash        being removed (idem)

Sealing (`seal_inline_payload`), called by the snapshot pump before its cut, under the
save lock, in this order:

1. read the samples whose payload is still inline (a read transaction, outside any cut:
   a finished sample never changes, it can only be deleted when its group is trained);
2. write them into a new segment file through the one file commit (`fsio.write_file_atomic`:
   temporary name, fsync, rename, fsync the directory), hashing it (BLAKE3, the hash of
   manifest format 2) before the rename. A segment is never opened for writing again;
3. write transactions record it in ``payload_segments`` and point those samples at it,
   dropping their inline BLOBs (`payload.record_segment`, `payload.point_at_segment`),
   a few MiB of payload per transaction (`POINT_STEP_BYTES`: the pumps wait for one
   step at most);
4. the pages the dropped BLOBs leave are given back (`Store.reclaim_free_pages`).

So a reference is never committed before its segment is durable. A crash before 3
leaves a segment no store file references (or a temporary file); the next save removes
it (`remove_unreferenced`), and a restore never looks at it. A crash during 3 leaves
some samples pointed and the rest inline (each sample is one or the other: two CHECK
constraints); the next seal writes the rest into a new segment. The snapshot taken right
after captures a store file without that payload; its manifest lists the segments the
file references with the checksum recorded at sealing (`referenced_entries`), so a
snapshot costs its new payload once plus its metadata file, not the payload in flight.

Removal: a segment goes only when neither a kept snapshot's manifest, nor a snapshot
being published (held or in progress: `pinned`), nor the live store references it, and
only when the caller can say what the live store references (a Publisher without
`live_references` removes no segment). The removal renames to a trash name, fsyncs the
directory, then unlinks: as retention removes a snapshot directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .. import faults
from ..fsio import TEMP_SUFFIX, TRASH_SUFFIX, fsync_dir, rename, trash_path_beside, write_file_atomic
from ..live.payload import (
    SEGMENT_DDL,
    SEGMENT_FORMAT,
    SEGMENT_TABLE,
    SegmentRef,
    inline_payloads,
    next_segment_id,
    point_at_segment,
    record_segment,
    referenced_segments,
    sample_references,
)
from ..errors import NotAStoreError, RecordDamaged
from ..live.invariants import check_invariants
from ..sqlite.readonly import open_readonly
from .hashing import BLAKE3, Hashing
from .layout import SEGMENTS_DIR, segment_file_name, segments_dir_of
from .manifest import FileEntry, ManifestError, member_path

log = logging.getLogger(__name__)

_NAME = re.compile(r"^segment_(\d+)\.sqlite$")
# Segment pages: SQLite's default 4 KiB. A row larger than a page keeps only a small
# local part on its leaf page and fills whole overflow pages with the rest, so the waste
# stays under one leaf slot per row. Measured with 1024-token samples (8 KiB a row):
# 16 KiB pages held one row per page (a row fits locally, two do not), 2.0x the payload;
# 4 KiB pages 1.0x.
PAGE_SIZE = 4096
# Payload pointed at its segment per write transaction. Dropping the inline BLOBs frees
# their overflow pages (~1 per 4 KiB); 10 MiB in one transaction held the write lock
# 40-115 ms (bench/bench_snapshot_segments.py profile), so the pumps wait for one step
# of this size at most.
POINT_STEP_BYTES = 2 * 1024 * 1024


def _steps(rows: list[tuple[int, bytes, bytes]], limit: int) -> list[list[int]]:
    """Sample ids in runs of about `limit` bytes of payload (at least one sample each)."""
    out: list[list[int]] = [[]]
    size = 0
    for sid, tok, lp in rows:
        if out[-1] and size + len(tok) + len(lp) > limit:
            out.append([])
            size = 0
        out[-1].append(sid)
        size += len(tok) + len(lp)
    return out


@dataclass
class Sealed:
    """One sealing: the new segment and what it took."""

    file_name: str
    path: Path
    rows: int  # samples written into the segment
    pointed: int  # of them, still in the store when the reference was committed
    bytes: int
    digest: str
    timings: dict[str, float]


def segment_number(name: str) -> int | None:
    """n of `segment_<n>.sqlite`, also of its temporary or trash names; else None."""
    if name.startswith(".") and (name.endswith(TEMP_SUFFIX) or name.endswith(TRASH_SUFFIX)):
        name = name[1:].split(".sqlite", 1)[0] + ".sqlite"
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def _highest_on_disk(directory: Path) -> int:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    return max([n for n in map(segment_number, names) if n is not None] + [0])


def _build(rows: list[tuple[int, bytes, bytes]], hashing: Hashing, out: dict):
    def build(tmp: Path) -> None:
        with contextlib.closing(sqlite3.connect(tmp, isolation_level=None)) as conn:
            # No journal, no fsync: the file is fsynced once by the commit that publishes
            # it, and a crash before that leaves only a temporary file.
            conn.execute("PRAGMA journal_mode = OFF")
            conn.execute("PRAGMA synchronous = OFF")
            conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")
            conn.execute(f"PRAGMA user_version = {SEGMENT_FORMAT}")
            conn.execute("BEGIN")
            conn.execute(SEGMENT_DDL)
            conn.executemany(f"INSERT INTO {SEGMENT_TABLE} (sample_id, token_ids, logprobs) VALUES (?, ?, ?)", rows)
            conn.execute("COMMIT")
        faults.point("segment.built")
        out["size"], out["digest"] = hashing.file(tmp)

    return build


def seal_inline_payload(store, checkpoint_dir: str | Path, *, hashing: Hashing = BLAKE3) -> Sealed | None:
    """Move the live store's inline payload into one new segment (module docstring,
    steps 1-3). None when no payload is inline. The caller holds the save lock (no
    retention or other sealing runs meanwhile). Raises OSError on a failing disk (the
    samples keep their inline payload; the temporary file is removed)."""
    t0 = time.perf_counter()
    with store.read() as conn:
        rows = inline_payloads(conn)
        from_store = next_segment_id(conn)
    if not rows:
        return None
    t_read = time.perf_counter()
    number, name, path, out = _write_new_segment(checkpoint_dir, from_store, rows, hashing)
    faults.point("segment.durable")
    t_written = time.perf_counter()
    pointed = 0
    for k, step in enumerate(_steps(rows, POINT_STEP_BYTES)):
        with store.atomic() as tx:
            if k == 0:
                record_segment(tx, number, name, out["digest"], out["size"], len(rows))
            pointed += point_at_segment(tx, number, step)
    faults.point("segment.referenced")
    t_referenced = time.perf_counter()
    store.reclaim_free_pages()  # the sealed payload's pages leave the live file (and every later copy of it)
    return Sealed(name, path, len(rows), pointed, out["size"], out["digest"], {
        "seal_read": t_read - t0, "seal_write": t_written - t_read, "seal_reference": t_referenced - t_written,
        "seal_vacuum": time.perf_counter() - t_referenced})


def write_chunk_segment(store, checkpoint_dir: str | Path, rows: list[tuple[int, bytes, bytes]], *,
                        hashing: Hashing = BLAKE3) -> SegmentRef:
    """A prefix cut's new chunks, (row, token_ids, logprobs) each, written once into a new
    segment through the same file commit as a seal (`write_file_atomic`: temporary name,
    fsync, rename, fsync the directory), hashed before the rename. Numbered from the
    live store's sequence and above every name on disk, as a seal's. Nothing references it yet: the snapshot whose cut wrote it records it in its
    own file (`pools.put_chunk_references`); if that snapshot is never published,
    retention removes the file (`remove_unreferenced`: no kept snapshot lists it). The
    caller holds the save lock."""
    with store.read() as conn:
        from_store = next_segment_id(conn)
    number, name, _, out = _write_new_segment(checkpoint_dir, from_store, rows, hashing)
    return SegmentRef(number, name, out["digest"], out["size"], len(rows))


def _write_new_segment(checkpoint_dir: str | Path, from_store: int, rows: list, hashing: Hashing,
                       ) -> tuple[int, str, Path, dict]:
    """Write `rows` into a new segment file under a fresh number; returns (number, name,
    path, {"digest", "size"}). The number is above the store's sequence and above every
    name on disk: a restore to an older snapshot rewinds the store's sequence, while the
    newer branch's segments may still be there (until retention removes them); a name is
    never reused for other bytes."""
    directory = segments_dir_of(checkpoint_dir)
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        fsync_dir(directory.parent)
    number = max(from_store, _highest_on_disk(directory) + 1)
    name = segment_file_name(number)
    path = directory / name
    out: dict = {}
    write_file_atomic(path, _build(rows, hashing, out), tag="seal")
    return number, name, path, out


# --------------------------------------------------------------------------- manifests


def referenced_entries(db_path: str | Path) -> list[FileEntry]:
    """The segments a captured store file references, as manifest entries (file name,
    size, BLAKE3 recorded when the segment was sealed): no segment is read again."""
    with contextlib.closing(open_readonly(db_path)) as conn:
        return [FileEntry(r.file_name, r.bytes, r.blake3) for r in referenced_segments(conn)]


def verify_segments(checkpoint_dir: str | Path, entries: Iterable[FileEntry], hashing: Hashing,
                    where: str, lister: str = "the manifest") -> list[str]:
    """Every listed segment against its size and checksum (a full read). One line per
    problem, naming the segment and who listed it (`lister`); empty when sound."""
    problems = []
    for e in entries:
        if segment_number(e.path) is None or e.path.startswith("."):
            problems.append(f"{where}: lists segment {e.path!r}, not a segment file name")
            continue
        try:
            path = segment_path(checkpoint_dir, e.path, where)
        except ManifestError as err:
            problems.append(str(err))
            continue
        if not path.is_file():
            problems.append(f"{path}: missing ({lister} lists this payload segment)")
            continue
        size, digest = hashing.file(path)
        if size != e.size:
            problems.append(f"{path}: payload segment of size {size} bytes, {lister} says {e.size}")
        elif digest != e.digest:
            problems.append(f"{path}: payload segment's {hashing.name} differs from {lister} "
                            "(the segment was changed or damaged)")
    return problems


def segment_path(checkpoint_dir: str | Path, name: str, where: str) -> Path:
    """CHECKPOINT_DIR/payload_segments/`name`, refusing (ManifestError) a path that
    resolves outside the checkpoint directory: a symlinked segment or a symlinked
    payload_segments/. The manifest's one rule for the files it lists (`member_path`)."""
    return member_path(Path(checkpoint_dir), f"{SEGMENTS_DIR}/{name}", where)


def read_sample_references(db_path: str | Path) -> dict[str, list[int]]:
    """`sample_references` of a store file, opened read-only."""
    with contextlib.closing(open_readonly(db_path)) as conn:
        return sample_references(conn)


def missing_payload(checkpoint_dir: str | Path, references: dict[str, list[int]], where: str) -> list[str]:
    """Every sample a store file points at a segment (`references`, file name -> sample
    ids) must have its payload in that segment: a store naming the wrong (listed, sound)
    segment passes every checksum, then fails the run at training. One probe of the
    segment's integer primary key per id: the b-tree pages of those ids, never the
    payload's overflow pages. Measured per snapshot (bench/bench_snapshot_segments.py's
    setup: 10,000 groups x 8 generations, 1 GiB of payload in flight in segments, 2
    shared cores at load ~12): ~8,400 ids in 2-6 segments, 88 ms (median of 5), where
    hashing those segments (which verify and restore do first) took 3.5 s. One line per
    problem; empty when sound. The one check of restore, verify (snapshot and run
    directory) and publication alike."""
    problems = []
    for name, ids in sorted(references.items()):
        try:
            path = segment_path(checkpoint_dir, name, where)
        except ManifestError as e:
            problems.append(str(e))
            continue
        if not path.is_file():
            problems.append(f"{path}: missing; {where} points {len(ids)} sample(s) at this payload segment")
            continue
        held = f"SELECT sample_id FROM {SEGMENT_TABLE} WHERE sample_id IN (SELECT value FROM json_each(?))"
        try:
            with contextlib.closing(open_readonly(path)) as seg:
                # Counted in SQLite; the ids are read back only when some are lacking (a
                # Python set of every id was a third of this check: 8.4 -> 5.6 ms for
                # 8,352 ids in 3 segments).
                wanted = json.dumps(ids)
                (present,) = seg.execute(f"SELECT count(*) FROM ({held})", (wanted,)).fetchone()
                found = None if present == len(set(ids)) else {r[0] for r in seg.execute(held, (wanted,))}
        except (NotAStoreError, sqlite3.DatabaseError) as e:
            problems.append(f"{path}: unreadable payload segment ({' '.join(str(e).split())})")
            continue
        lost = [] if found is None else [i for i in ids if i not in found]
        if lost:
            more = ", ..." if len(lost) > 5 else ""
            problems.append(f"{where}: {len(lost)} sample(s) point at payload segment {name}, which lacks their payload "
                            f"(sample ids {', '.join(map(str, lost[:5]))}{more}): the store names the wrong segment or "
                            "the segment is damaged; restore another snapshot")
    return problems


def copy_problems(checkpoint_dir: str | Path, db_path: str | Path) -> list[str]:
    """What `verify` and a restore would refuse in a captured copy, checked before its
    manifest is written (publish.py): the four invariants (`check_invariants`) and every
    sample's payload in the segment it names (`missing_payload`). The copy holds what
    is in flight, its sealed payload as references, so both read little. Measured per
    snapshot with bench/bench_snapshot_segments.py's setup (10,000 groups x 8
    generations, 1 GiB in flight in segments, 10 MiB new per interval; a copy of 9.3 MiB;
    2 shared cores at load ~1, 2026-12-05): 0.026 s of a 0.107 s snapshot, on a helper
    thread beside the files' fsync and hash (publish.py); the invariants ~0.012 s of it
    (the foreign-key check ~5 ms, the prompt audit ~2.5 ms), the references ~0.01 s.
    (At load ~12, before the settled record was bounded: 0.47 s of 1.90 s.)
    One line per problem; empty when sound."""
    try:
        with contextlib.closing(open_readonly(db_path)) as conn:
            conn.set_authorizer(None)  # our own SQL: the invariants read table-valued pragmas
            problems = check_invariants(conn).problems
            return problems or missing_payload(checkpoint_dir, sample_references(conn), str(db_path))
    except RecordDamaged as e:
        return [str(e)]
    except sqlite3.DatabaseError as e:
        return [f"{db_path}: could not check invariants: {' '.join(str(e).split())}"]


def store_segment_problems(store_path: str | Path, checkpoint_dir: str | Path) -> list[str]:
    """Every segment a store file references (a live store: `rolloutdb verify RUN_DIR`)
    against the size and BLAKE3 recorded when it was sealed: a full read of each; then
    every sample's payload in the segment the store names (`missing_payload`). One
    line per problem, naming the segment; empty when sound or when nothing is sealed."""
    problems = verify_segments(checkpoint_dir, referenced_entries(store_path), BLAKE3, where=str(store_path),
                               lister=f"{store_path}'s payload_segments")
    return problems or missing_payload(checkpoint_dir, read_sample_references(store_path), str(store_path))


def unlisted_segments(references: dict[str, list[int]], entries: Iterable[FileEntry]) -> list[str]:
    """Segments a store file references (its `read_sample_references`) that its manifest
    does not list (`entries`), sorted."""
    listed = {e.path for e in entries}
    return sorted(set(references) - listed)


# --------------------------------------------------------------------------- removal


@dataclass
class SegmentReport:
    removed: list[Path]
    errors: list[str]


def remove_unreferenced(checkpoint_dir: str | Path, keep: set[str]) -> SegmentReport:
    """Remove every segment not in `keep`, and leftovers (temporary and trash files of
    an earlier crash). Renamed to a trash name, the directory fsynced, then unlinked.
    Failures are reported, never raised (the next save retries)."""
    directory = segments_dir_of(checkpoint_dir)
    report = SegmentReport([], [])
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return report
    for name in names:
        path = directory / name
        number = segment_number(name)
        if number is None or name in keep:
            continue
        try:
            if not name.startswith("."):
                trash = trash_path_beside(path)
                rename(path, trash)
                fsync_dir(directory)
                faults.point("segment.trashed")
                path = trash
            path.unlink(missing_ok=True)
            faults.point("segment.removed")
            report.removed.append(directory / name)
        except OSError as e:
            msg = f"retention: could not remove segment {directory / name} ({e.strerror or e}); will retry at the next save"
            log.warning(msg)
            report.errors.append(msg)
    return report


__all__ = ["SEGMENTS_DIR", "Sealed", "SegmentReport", "copy_problems", "missing_payload", "read_sample_references", "referenced_entries",
           "remove_unreferenced", "seal_inline_payload", "segment_number", "segment_path", "unlisted_segments",
           "verify_segments", "write_chunk_segment"]
