"""Verifying store files, snapshot directories, trainer checkpoints and whole checkpoint
directories. Read-only: files are opened with `open_readonly` (no -wal/-shm created)
and only read for hashing.

Every function returns a `Report`: `problems` (each one line; empty means sound) and
`notes` (facts worth saying that are not problems, such as an older schema revision).
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import NotAStoreError, RecordDamaged, SchemaTooNewError
from ..live.invariants import check_invariants
from ..checkpoints.layout import (
    BAD_MANIFEST,
    BOOTSTRAP,
    COMPLETE,
    NO_MANIFEST,
    SNAPSHOT_DB,
    SNAPSHOTS_DIR,
    anchor_step,
    scan,
    segments_dir_of,
    snapshot_name,
)
from ..checkpoints.manifest import (
    KIND_SNAPSHOT,
    KIND_TRAINER,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    read_manifest,
    verify_files,
)
from ..checkpoints.segments import missing_payload, read_sample_references, unlisted_segments, verify_segments
from ..sqlite.identity import identify
from ..sqlite.integrity import integrity_problems
from ..sqlite.readonly import listing_manifest, open_readonly
from ..sqlite.revision import file_revision, head_revision

INTEGRITY_LINES = 3


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def extend(self, other: Report) -> Report:
        self.problems += other.problems
        self.notes += other.notes
        self.checked += other.checked
        return self


def open_for_checks(path: str | Path) -> sqlite3.Connection:
    """`open_readonly` for our own checks. The connection is read-only at the file level
    (``mode=ro`` or ``immutable``); the write-refusing authorizer, meant for user
    queries, also refuses the table-valued pragmas the invariants use, so it is off."""
    conn = open_readonly(path)
    conn.set_authorizer(None)
    return conn


def verify_store_file(path: str | Path, *, manifest: Manifest | None = None, beside: bool = True) -> Report:
    """integrity_check, known revision (older is a note, newer a problem), the
    invariants, and, when a manifest.json sits beside the file (`beside`), the
    checksums of every file it lists. `manifest` cross-checks the schema revision."""
    path = Path(path)
    report = Report(checked=[str(path)])
    try:
        conn = open_for_checks(path)
    except NotAStoreError as e:
        report.problems.append(str(e))
        return report
    try:
        revision = _check_open_file(path, conn, report)
        if revision is _UNREAD:  # refused before its revision was read: read it for the cross-check
            revision = _revision_of(conn)
    finally:
        conn.close()
    if beside and manifest is None and (path.parent / MANIFEST_NAME).exists():
        try:
            manifest = read_manifest(path.parent)
        except ManifestError as e:
            report.problems.append(str(e))
        else:
            report.problems += verify_files(path.parent, manifest, skip_dirs=_skip(manifest))
    if manifest is not None and manifest.kind == KIND_SNAPSHOT and revision and manifest.schema_revision != revision:
        report.problems.append(
            f"{path}: schema revision {revision} but its manifest says {manifest.schema_revision} "
            "(upgraded in place after publication?)"
        )
    return report


def _revision_of(conn: sqlite3.Connection) -> str | None:
    try:
        return file_revision(conn)
    except (sqlite3.DatabaseError, NotAStoreError):  # already a problem of _check_open_file
        return None


_UNREAD = "<unread>"  # `_check_open_file` stopped before reading the revision


def _check_open_file(path: Path, conn: sqlite3.Connection, report: Report) -> str | None:
    """The file's checks, into `report`; returns the revision it read (`_UNREAD` when
    a refusal came first)."""
    try:
        rows = integrity_problems(conn, INTEGRITY_LINES + 1)
    except sqlite3.DatabaseError as e:
        report.problems.append(f"{path}: integrity_check failed: {e}; restore it from another snapshot")
        return _UNREAD
    if rows:
        more = " ..." if len(rows) > INTEGRITY_LINES else ""
        report.problems.append(f"{path}: integrity_check failed: {'; '.join(rows[:INTEGRITY_LINES])}{more}; "
                               "restore it from another snapshot")
        return _UNREAD
    try:
        revision, status = identify(conn, path)  # one alembic_version row, known, its schema
    except (NotAStoreError, SchemaTooNewError) as e:
        report.problems.append(str(e))
        return _UNREAD
    if status == "old":
        if listing_manifest(path) is not None:  # a published file is never changed in place
            how = (f"it is a published snapshot file, so upgrade a copy: `rolloutdb upgrade {path} --out COPY.sqlite` "
                   "(restore upgrades a copy itself)")
        else:
            how = f"`rolloutdb upgrade {path}` migrates it (restore upgrades a copy)"
        report.notes.append(f"{path}: schema revision {revision} is older than head {head_revision()}; {how}")
    try:
        inv = check_invariants(conn)
    except sqlite3.DatabaseError as e:
        report.problems.append(f"{path}: could not check invariants: {e}")
        return revision
    except RecordDamaged as e:  # the settled record's decoder names the table and row
        report.problems.append(f"{path}: {e}")
        return revision
    report.problems += [f"{path}: {p}" for p in inv.problems]
    return revision


def _skip(manifest: Manifest) -> tuple[str, ...]:
    return (SNAPSHOTS_DIR,) if manifest.kind == KIND_TRAINER else ()


def verify_snapshot_dir(path: str | Path, manifest: Manifest | None = None) -> Report:
    """Every file against the manifest, then the snapshot file's own checks. `manifest`:
    the snapshot's, when the caller has read it (a listing); not read again."""
    path = Path(path)
    report = Report(checked=[str(path)])
    if manifest is None:
        try:
            manifest = read_manifest(path)
        except ManifestError as e:
            report.problems.append(str(e))
            return report
    if manifest.kind != KIND_SNAPSHOT:
        report.problems.append(f"{path / MANIFEST_NAME}: kind {manifest.kind}, expected {KIND_SNAPSHOT}")
        return report
    if path.parent.name == SNAPSHOTS_DIR:
        # The manifest must describe the place it was published to: a manifest copied from
        # another snapshot would make a restore believe the wrong anchor or sequence.
        anchor, name = path.parent.parent.name, path.name
        if manifest.anchor != anchor or snapshot_name(manifest.sequence or 0) != name:
            report.problems.append(f"{path / MANIFEST_NAME}: says anchor {manifest.anchor} snapshot_{manifest.sequence}, "
                                   f"but the directory is {anchor}/{SNAPSHOTS_DIR}/{name}; restore the right manifest")
    file_problems = verify_files(path, manifest)
    report.problems += file_problems
    db = path / SNAPSHOT_DB
    if not db.is_file():
        if not any(str(db) in p for p in file_problems):
            report.problems.append(f"{db}: missing; a rollout snapshot holds its store file")
    elif not any(p.startswith(str(db)) for p in file_problems):
        # A file already known damaged by its checksum is not opened again.
        report.extend(verify_store_file(db, manifest=manifest, beside=False))
        report.extend(_verify_snapshot_segments(path, db, manifest))
    return report


def _verify_snapshot_segments(path: Path, db: Path, manifest: Manifest) -> Report:
    """The payload segments a snapshot lists, each read and hashed (a snapshot verifies on
    its own: its files and its segments), and every segment its store file references
    listed. Segments live in CHECKPOINT_DIR/payload_segments/, two levels above the
    snapshot's anchor directory."""
    report = Report()
    where = str(path / MANIFEST_NAME)
    try:
        references = read_sample_references(db)  # the segment list, read once
    except (NotAStoreError, sqlite3.DatabaseError) as e:
        report.problems.append(f"{db}: could not read its payload segment references: {e}")
        return report
    unlisted = unlisted_segments(references, manifest.segments)
    report.problems += [f"{db}: references payload segment {n}, which its manifest does not list" for n in unlisted]
    if not manifest.segments:
        return report
    if path.parent.name != SNAPSHOTS_DIR:
        report.problems.append(f"{where}: lists {len(manifest.segments)} payload segment(s), found in "
                               "CHECKPOINT_DIR/payload_segments/; verify the snapshot where it was published")
        return report
    checkpoint_dir = path.parents[2]
    report.problems += verify_segments(checkpoint_dir, manifest.segments, manifest.hashing, where)
    if not report.problems:  # every sample's payload in the segment its store file names
        report.problems += missing_payload(checkpoint_dir, references, str(db))
    report.checked += [str(segments_dir_of(checkpoint_dir) / e.path) for e in manifest.segments]
    return report


def verify_trainer_dir(path: str | Path, *, with_snapshots: bool = True, manifest: Manifest | None = None) -> Report:
    """A trainer checkpoint's files against its manifest (its rollout_snapshots/
    excluded), then, with `with_snapshots`, every snapshot anchored to it. `manifest`:
    the checkpoint's, when the caller has read it (a listing); not read again."""
    path = Path(path)
    report = Report(checked=[str(path)])
    try:
        if manifest is None:
            manifest = read_manifest(path)
    except ManifestError as e:
        report.problems.append(f"{e} (a trainer checkpoint without a manifest is not durable)")
    else:
        if manifest.kind != KIND_TRAINER:
            report.problems.append(f"{path / MANIFEST_NAME}: kind {manifest.kind}, expected {KIND_TRAINER}")
        else:
            report.problems += verify_files(path, manifest, skip_dirs=(SNAPSHOTS_DIR,))
    if with_snapshots:
        try:
            snaps = sorted((path / SNAPSHOTS_DIR).glob("snapshot_*"))
            if (path / SNAPSHOTS_DIR).is_dir():
                os.listdir(path / SNAPSHOTS_DIR)  # glob hides an unreadable directory as empty
        except PermissionError as e:
            report.problems.append(f"{path / SNAPSHOTS_DIR}: cannot list it ({e.strerror}); fix its permissions")
            snaps = []
        for snap in snaps:
            if snap.is_dir():
                report.extend(verify_snapshot_dir(snap))
    return report


def verify_checkpoint_dir(path: str | Path) -> Report:
    """Every trainer checkpoint and every snapshot under a checkpoint directory.
    Leftovers of an interrupted publish or delete are notes (the next save removes
    them); a snapshot directory without a valid manifest is a problem."""
    inv = scan(path)
    report = Report(checked=[str(path)])
    if not inv.entries:
        raise NotAStoreError(f"{path}: no bootstrap/ or step_<N>/ here; pass a checkpoint directory, "
                             "a snapshot directory or a store file")
    for a in inv.anchors:
        if a.leftover:
            report.notes.append(f"{a.path}: {a.status}; the next save removes it")
        elif a.status == NO_MANIFEST:
            report.notes.append(f"{a.path}: no manifest: not a durable trainer checkpoint (its snapshots are not restorable)")
        elif a.status == BAD_MANIFEST:
            report.problems.append(a.problem or f"{a.path}: invalid manifest")
        else:
            report.extend(verify_trainer_dir(a.path, with_snapshots=False))
    for s in inv.snapshots:
        if s.leftover:
            report.notes.append(f"{s.path}: {s.status}; the next save removes it")
        elif s.status == COMPLETE:
            report.extend(verify_snapshot_dir(s.path))
        else:
            report.problems.append(s.problem or f"{s.path}: {s.status}")
    return report


def verify_path(path: str | Path) -> Report:
    """Dispatch on what `path` is. Raises NotAStoreError for a missing path or a
    directory that is none of the three kinds."""
    path = Path(path)
    if not path.exists():
        raise NotAStoreError(f"{path}: no such file or directory; pass a store file, a snapshot directory "
                             "or a checkpoint directory")
    if not path.is_dir():
        return verify_store_file(path)
    name = path.name
    if (path / MANIFEST_NAME).exists():
        try:
            kind = read_manifest(path).kind
        except ManifestError:
            kind = KIND_SNAPSHOT if name.startswith("snapshot_") else KIND_TRAINER
        return verify_snapshot_dir(path) if kind == KIND_SNAPSHOT else verify_trainer_dir(path)
    if name.startswith("snapshot_") or (path / SNAPSHOT_DB).exists():
        return verify_snapshot_dir(path)
    if name == BOOTSTRAP or _is_step(name):
        return verify_trainer_dir(path)
    return verify_checkpoint_dir(path)


def _is_step(name: str) -> bool:
    try:
        return anchor_step(name) is not None
    except ValueError:
        return False
