"""Publishing checkpoints: the one commit protocol for every directory rolloutdb writes.

1. Write everything into a temporary directory beside the target
   (``.snapshot_7.publish.<pid>.tmp``).
2. fsync every file (hashing each for the manifest on the way).
3. Write ``manifest.json`` last and fsync it; fsync every directory of the tree.
4. Rename the temporary directory into place (never over an existing one).
5. fsync the parent, so the rename itself is durable.

A crash before 4 leaves a temporary directory, which listing never shows as a checkpoint
and the next save removes; a crash after 4 leaves a complete checkpoint. A failed
attempt raises `PublishError` (with the errno), removes what it can of its temporary
directory, and leaves every earlier checkpoint as it was.

Rollout snapshots are published in two halves so the controller's cut stays short:
`Publisher.begin_snapshot` allocates the sequence number and the temporary directory,
the controller captures the store into `stage.db_path` inside its cut (the capture
writes without fsync), leaves the cut, and only then calls `stage.publish(...)`, which
does the fsync work. `publish_rollout_snapshot` does both halves in one call.

Publication is about files: it returns `Published` or raises a typed error, and records
nothing in the store. Whoever decides a snapshot attempt records its outcome, once: the
snapshot pump (`controller/recovery/snapshot_pump.py`) does; a caller with its own loop calls
`Store.record_snapshot_attempt`.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import faults
from ..errors import NotAStoreError, StoreError
from ..fsio import TEMP_SUFFIX, fsync_dir, fsync_file, rename_dir, temp_path_beside, write_file, write_file_atomic
from ..live.capture import count_rows
from ..sqlite.readonly import open_readonly
from ..sqlite.revision import file_revision
from .layout import (
    BOOTSTRAP,
    CONFIG_FILE,
    ENV_EXPORT,
    HIGH_WATER,
    SNAPSHOT_DB,
    SNAPSHOTS_DIR,
    anchor_dir,
    anchor_name,
    read_high_water,
    scan,
    segments_dir_of,
    snapshot_dir,
)
from .manifest import (
    KIND_SNAPSHOT,
    KIND_TRAINER,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ManifestError,
    config_fingerprint,
    read_manifest,
)
from .retention import Retention, RetentionReport, apply_retention, default_retention, remove_leftovers, remove_tree
from .segments import copy_problems, referenced_entries, remove_unreferenced, segment_path
from ..live.payload import file_references

log = logging.getLogger(__name__)


class PublishError(StoreError):
    """An attempt to publish failed; earlier checkpoints are intact. `errno` is set
    when the cause was an OSError (ENOSPC, EIO, ...)."""

    def __init__(self, message: str, *, errno: int | None = None, step: str | None = None, path: Path | None = None):
        super().__init__(message)
        self.errno = errno
        self.step = step
        self.path = path


class AnchorNotDurable(PublishError):
    """A snapshot was asked for an anchor that has no published trainer checkpoint."""


class BackgroundWorkError(PublishError):
    """A deferred publish failed; raised once, by the next save, then cleared."""


@dataclass
class Published:
    kind: str
    anchor: str
    path: Path
    manifest: Manifest
    sequence: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    cleaned: list[Path] = field(default_factory=list)  # leftovers removed before this save
    retention: RetentionReport | None = None
    # Failures of earlier background retention, reported once (never fatal).
    background_errors: list[str] = field(default_factory=list)


# A Rust library's I/O error (safetensors writing the trainer's tensors) reaches Python
# as the library's own exception with the errno only in its text: "I/O error: No space
# left on device (os error 28)" (safetensors 0.4+), "Os { code: 28, ... }" (older).
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")


def _as_os_error(e: BaseException) -> OSError | None:
    """SQLite's own writes (the backup API filling the snapshot file) fail as sqlite3
    errors, not OSError: SQLITE_FULL is a full disk (ENOSPC); any other SQLITE_IOERR
    (EFBIG past RLIMIT_FSIZE, EIO) reaches us without its errno, so EIO. Other SQLite
    errors are not the disk's: None. A library's error that carries an OS error in its
    text (safetensors' SafetensorError) is that OS error."""
    if isinstance(e, OSError):
        return e
    if isinstance(e, sqlite3.Error):
        code = (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF
        if code == sqlite3.SQLITE_FULL:
            return OSError(errno_mod.ENOSPC, f"{e} (SQLite)")
        if code == sqlite3.SQLITE_IOERR:
            return OSError(errno_mod.EIO, f"{e} (SQLite)")
        return None
    found = _RUST_OS_ERROR.search(str(e)) if isinstance(e, Exception) else None
    if found is None:
        return None
    number = int(found.group(1) or found.group(2))
    return OSError(number, f"{os.strerror(number)} ({type(e).__name__})")


def _fail(what: str, target: Path, e: OSError) -> PublishError:
    name = errno_mod.errorcode.get(e.errno or 0, "EIO")
    hint = "free disk space" if e.errno == errno_mod.ENOSPC else "check the disk"
    return PublishError(
        f"{target}: publishing failed at {what}: {e.strerror or e} [{name}]; "
        f"earlier checkpoints are intact; {hint} and retry",
        errno=e.errno, step=what, path=target,
    )


def commit_directory(tmp: Path, target: Path, manifest: Manifest, *, skip_dirs: tuple[str, ...] = (),
                     before_manifest: Callable[[], object] | None = None) -> dict[str, float]:
    """Steps 2-5 of the protocol for a temporary directory whose payload is written.
    Fills `manifest.files`. Raises OSError; the caller maps it to PublishError."""
    timings = seal_directory(tmp, manifest, skip_dirs=skip_dirs, before_manifest=before_manifest)
    return {**timings, **rename_into_place(tmp, target)}


def seal_directory(tmp: Path, manifest: Manifest, *, skip_dirs: tuple[str, ...] = (),
                   before_manifest: Callable[[], object] | None = None) -> dict[str, float]:
    """Steps 2-3: every file fsynced and hashed, the manifest written last, every
    directory fsynced. The directory is still temporary (a crash leaves a leftover).
    `before_manifest()` runs once the files are durable and before the manifest is
    written: what must hold before the directory can be published (a rollout
    snapshot's copy check, done beside the fsyncs) waits there, and its exception
    stops the publication."""
    t0 = time.perf_counter()
    faults.point("publish.payload_written")
    files: list[FileEntry] = []
    dirs: list[str] = []
    hashing = manifest.hashing
    # Each file is fsynced on a helper thread while this thread hashes it: the fsync
    # waits on the disk, the hash on the CPU (both release the GIL), so a large snapshot
    # costs about max(hash, fsync) instead of their sum (bench/bench_publish.py).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutdb-fsync") as fsyncer:
        pending = []
        for dirpath, dirnames, filenames in os.walk(tmp, topdown=True):
            if Path(dirpath) == tmp:
                dirnames[:] = [d for d in dirnames if d not in skip_dirs]
            dirs.append(dirpath)
            for name in sorted(filenames):
                p = os.path.join(dirpath, name)
                if os.path.islink(p):
                    raise OSError(errno_mod.EINVAL, f"symlinks are not published ({p})")
                pending.append(fsyncer.submit(fsync_file, p))
                size, digest = hashing.file(p)
                files.append(FileEntry(Path(p).relative_to(tmp).as_posix(), size, digest))
        for done in pending:
            done.result()  # re-raises an fsync error here
    manifest.files = sorted(files, key=lambda f: f.path)
    t_files = time.perf_counter()
    faults.point("publish.files_fsynced")
    if before_manifest is not None:
        before_manifest()
    t_ready = time.perf_counter()
    write_file(tmp / MANIFEST_NAME, manifest.to_json())
    fsync_file(tmp / MANIFEST_NAME)
    faults.point("publish.manifest_written")
    for d in reversed(dirs):
        fsync_dir(d)
    faults.point("publish.tmpdir_fsynced")
    return {"hash_fsync_files": t_files - t0, **({"wait_before_manifest": t_ready - t_files} if before_manifest else {}),
            "manifest_dirs": time.perf_counter() - t_ready}


def rename_into_place(tmp: Path, target: Path) -> dict[str, float]:
    """Steps 4-5: rename a sealed temporary directory into place, fsync the parent."""
    t0 = time.perf_counter()
    rename_dir(tmp, target)
    faults.point("publish.renamed")
    fsync_dir(target.parent)
    faults.point("publish.parent_fsynced")
    return {"rename": time.perf_counter() - t0}


def record_high_water(checkpoint_dir: str | Path, sequence: int) -> None:
    """Make `sequence` the recorded highest snapshot number (`layout.HIGH_WATER`) unless
    a higher one is recorded already. Called before a number could vanish from the
    listing: when a snapshot is published (a person may delete it later), before
    leftovers are removed, before a resume removes the checkpoints of a cut-off branch.
    Written through the one atomic file write, outside the cut: one small file, two
    fsyncs and a rename per snapshot, 1.2 ms here against ~30 ms for publishing the
    quickstart's snapshot (measured 2026-11-30, 2 shared cores, virtio disk)."""
    root = Path(checkpoint_dir)
    if read_high_water(root) >= sequence:
        return
    target = root / HIGH_WATER
    for stale in root.glob(f".{HIGH_WATER}.*{TEMP_SUFFIX}"):  # a killed or failed earlier write
        stale.unlink(missing_ok=True)
    write_file_atomic(target, f"{int(sequence)}\n")


def _discard_tmp(tmp: Path) -> None:
    """Best effort: whatever stays is a leftover that the next save removes."""
    try:
        if tmp.exists():
            remove_tree(tmp, "cleanup")
    except OSError as e:
        log.warning("could not remove %s after a failed publish (%s); the next save will", tmp, e)


def _read_revision(db_path: Path, *, count: bool = True) -> tuple[str | None, dict[str, int], dict[str, int]]:
    """Schema revision (from the file's alembic_version) and, with `count`, row counts of
    a snapshot file (a capture that counted at its cut has them already)."""
    conn = open_readonly(db_path)
    try:
        return file_revision(conn), *(count_rows(conn) if count else ({}, {}))
    finally:
        conn.close()


def _listed_segments(root: Path, db_path: Path) -> list[FileEntry]:
    """The payload segments the captured file references, for its manifest: their
    checksums as recorded at sealing (never re-read). Each must be on disk with its
    size, so a snapshot is never published referencing a segment that is gone."""
    entries = referenced_entries(db_path)
    directory = segments_dir_of(root)
    for e in entries:
        try:
            size = os.stat(segment_path(root, e.path, str(db_path))).st_size
        except ManifestError as err:  # a symlink out of the checkpoint directory: as verify refuses it
            raise PublishError(f"{err}; the snapshot is not published", path=directory / e.path) from None
        except FileNotFoundError:
            raise PublishError(f"{directory / e.path}: the captured store references this payload segment and it is "
                               "missing; the snapshot is not published", path=directory / e.path) from None
        if size != e.size:
            raise PublishError(f"{directory / e.path}: payload segment of {size} bytes, sealed as {e.size}; the snapshot "
                               "is not published", path=directory / e.path)
    return entries


class CopyRefused(PublishError):
    """The captured copy fails `segments.copy_problems`: not published, earlier ones stand."""


class SnapshotStage:
    """A rollout snapshot being made: capture into `db_path`, then `publish()`."""

    def __init__(self, publisher: Publisher, anchor: str, sequence: int, tmp: Path, target: Path, cleaned: list[Path]):
        self.publisher = publisher
        self.anchor = anchor
        self.sequence = sequence
        self.tmp = tmp
        self.target = target
        self.db_path = tmp / SNAPSHOT_DB
        self.cleaned = cleaned
        self.done = False
        self.pending: Any = None  # staged.TrainerStage: an unpublished anchor this stage waits inside
        # The newest published snapshot's file when this stage began: the capture clones
        # it and writes only what changed, where the file system clones (`Store.capture`).
        self.base: Path | None = None

    def move_under(self, anchor_path: Path) -> None:
        """Its anchor's temporary directory was renamed to `anchor_path`."""
        self.tmp = anchor_path / SNAPSHOTS_DIR / self.tmp.name
        self.target = anchor_path / SNAPSHOTS_DIR / self.target.name
        self.db_path = self.tmp / SNAPSHOT_DB

    def publish(self, capture: Any = None, config_text: str | bytes | None = None, env_export: bytes | str | None = None) -> Published:
        return self.publisher._finish_snapshot(self, capture, config_text, env_export)

    def abort(self) -> None:
        self.publisher._abort(self)


class Publisher:
    """Publishes into one checkpoint directory; thread-safe. Keep one per directory and
    process (the controller builds it once, `controller/job/build.py`): two would race for
    sequence numbers and remove each other's temporary directories as leftovers.
    It records no snapshot outcome: the caller does (`Store.record_snapshot_attempt`)."""

    def __init__(self, checkpoint_dir: str | Path, *, retention: Retention | None = None,
                 background_retention: bool = False, live_references: Callable[[], set[str]] | None = None):
        self.root = Path(checkpoint_dir)
        # What the live store's samples reference (`Store.segment_references`): retention
        # removes a payload segment only when it knows this (None: no segment is removed).
        self.live_references = live_references
        self.retention = retention or default_retention()
        self.background_retention = background_retention
        self._lock = threading.RLock()
        self._busy: set[Path] = set()
        self._last_sequence = 0
        self._pending_error: BaseException | None = None
        self._pending_warnings: list[str] = []
        self._executor: ThreadPoolExecutor | None = None
        self._newest_snapshot: Path | None = None  # its SQLite file; set by every scan and publish

    @property
    def lock(self) -> threading.RLock:
        """The save lock: every save on this directory holds it (re-entrant). A caller
        whose save spans several calls (`begin_snapshot`, the capture, `stage.publish`)
        holds it across them, so no other save or retention runs in between."""
        return self._lock

    # ------------------------------------------------------------ shared steps

    def _start_save(self) -> tuple[Any, list[Path]]:
        """Surface a deferred failure once, scan, and remove leftovers of earlier crashes."""
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            raise BackgroundWorkError(f"{self.root}: an earlier deferred publish failed: {err}",
                                      errno=getattr(err, "errno", None)) from err
        self.root.mkdir(parents=True, exist_ok=True)
        inv = scan(self.root)
        snapshots = inv.complete_snapshots()
        self._newest_snapshot = snapshots[-1].path / SNAPSHOT_DB if snapshots else None
        half_used = [e.sequence for e in inv.leftovers() if e.sequence is not None and e.path not in self._busy]
        try:
            if half_used:  # a crashed attempt's number must outlive its directory
                record_high_water(self.root, max(half_used))
        except OSError as e:  # keep the leftovers (and their numbers visible); retry next save
            self._pending_warnings.append(f"{self.root}: could not record sequence {max(half_used)} ({e}); "
                                          "leftovers kept until the next save")
            return inv, []
        cleaned = remove_leftovers(inv, busy=self._busy)
        self._pending_warnings += cleaned.errors
        return inv, cleaned.deleted

    def snapshot_base(self) -> Path | None:
        """The newest published snapshot's SQLite file as of the last save's scan or
        publication, None before the first: what a capture clones (`Store.capture(base=)`)."""
        with self._lock:
            return self._newest_snapshot

    def _take_warnings(self) -> list[str]:
        out, self._pending_warnings = self._pending_warnings, []
        return out

    def _make_tmp(self, target: Path) -> Path:
        tmp = temp_path_beside(target, "publish")
        if tmp.exists():  # our own pid's leftover from an attempt that failed to clean up
            remove_tree(tmp, "cleanup")
        faults.io("mkdir", tmp)
        tmp.mkdir(parents=True)
        self._busy.add(tmp)
        faults.point("publish.tmpdir_created")
        return tmp

    def _retain(self) -> RetentionReport | None:
        if self.background_retention:
            self._pool().submit(self._retain_in_background)
            return None
        return self._apply_retention()

    def _retain_in_background(self) -> None:
        with self._lock:
            report = self._apply_retention()
            self._pending_warnings += report.errors

    def _apply_retention(self) -> RetentionReport:
        """Checkpoints first, then the payload segments nothing kept references."""
        report = apply_retention(self.root, self.retention)
        segments = self.retain_segments()
        report.deleted += segments.deleted
        report.errors += segments.errors
        return report

    def retain_segments(self) -> RetentionReport:
        """Remove every payload segment that no kept snapshot lists, no snapshot being
        published references and the live store does not reference (segments.py).
        Without `live_references` nothing is removed: a segment the live store still
        reads must never go. Under the save lock: no sealing runs meanwhile."""
        report = RetentionReport()
        if self.live_references is None or not segments_dir_of(self.root).is_dir():
            return report
        with self._lock:
            try:
                keep = set(self.live_references())
                for snap in scan(self.root).complete_snapshots():
                    keep |= {e.path for e in snap.manifest.segments} if snap.manifest else set()
                for busy in self._busy:  # in progress or held: captured, not yet listed
                    if (busy / SNAPSHOT_DB).is_file():
                        keep |= file_references(busy / SNAPSHOT_DB)
            except (OSError, StoreError, sqlite3.DatabaseError) as e:
                report.errors.append(f"retention: payload segments kept this time: cannot tell what references "
                                     f"them ({e})")
                return report
            removed = remove_unreferenced(self.root, keep)
        report.deleted += removed.removed
        report.errors += removed.errors
        return report

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutdb-publish")
        return self._executor

    # ------------------------------------------------------------ trainer checkpoints

    def publish_trainer_checkpoint(self, step: int | None, write_fn: Callable[[Path], Any] | None = None) -> Published:
        """Publish `step_<step>/` (or `bootstrap/` for None): `write_fn(tmpdir)` writes
        the trainer's files into the temporary directory."""
        anchor = anchor_name(step)
        target = anchor_dir(self.root, anchor)
        with self._lock:
            inv, cleaned = self._start_save()
            if target.exists():
                raise PublishError(f"{target}: already exists; a trainer checkpoint is published once "
                                   "(use seal_trainer_checkpoint for one the trainer wrote in place)", path=target)
            tmp = None
            t0 = time.perf_counter()
            try:
                tmp = self._make_tmp(target)
                if write_fn is not None:
                    write_fn(tmp)
                manifest = Manifest(kind=KIND_TRAINER, anchor=anchor, files=[], step=step)
                timings = commit_directory(tmp, target, manifest, skip_dirs=(SNAPSHOTS_DIR,))
            except BaseException as e:
                _discard_tmp(tmp) if tmp else None
                cause = _as_os_error(e)  # the trainer's own writes too (safetensors)
                if cause is None:
                    raise
                raise _fail("trainer checkpoint", target, cause) from e
            finally:
                self._busy.discard(tmp)
            timings["total"] = time.perf_counter() - t0
            retention = self._retain()
            return Published(KIND_TRAINER, anchor, target, manifest, None, timings, cleaned, retention,
                             self._take_warnings())

    def publish_bootstrap(self, write_fn: Callable[[Path], Any] | None = None) -> Published:
        """Publish `bootstrap/`, the anchor of snapshots taken before the first train step."""
        return self.publish_trainer_checkpoint(None, write_fn)

    def seal_trainer_checkpoint(self, step: int | None) -> Published:
        """Make durable a trainer checkpoint that the trainer wrote in place (not through
        `publish_trainer_checkpoint`): fsync its files, then write its manifest atomically."""
        anchor = anchor_name(step)
        target = anchor_dir(self.root, anchor)
        with self._lock:
            _inv, cleaned = self._start_save()
            if not target.is_dir():
                raise PublishError(f"{target}: no such trainer checkpoint directory", path=target)
            if (target / MANIFEST_NAME).exists():
                raise PublishError(f"{target}: already sealed (it has a manifest)", path=target)
            manifest = Manifest(kind=KIND_TRAINER, anchor=anchor, files=[], step=step)
            try:
                files = []
                for dirpath, dirnames, filenames in os.walk(target):
                    if Path(dirpath) == target:
                        dirnames[:] = [d for d in dirnames if d != SNAPSHOTS_DIR]
                    for name in sorted(filenames):
                        p = os.path.join(dirpath, name)
                        size, digest = manifest.hashing.file(p)
                        fsync_file(p)
                        files.append(FileEntry(Path(p).relative_to(target).as_posix(), size, digest))
                    fsync_dir(dirpath)
                manifest.files = sorted(files, key=lambda f: f.path)
                faults.point("publish.files_fsynced")
                write_file_atomic(target / MANIFEST_NAME, manifest.to_json(), tag="seal")
                faults.point("publish.parent_fsynced")
            except OSError as e:
                raise _fail("sealing trainer checkpoint", target, e) from e
            return Published(KIND_TRAINER, anchor, target, manifest, None, {}, cleaned, self._retain(),
                             self._take_warnings())

    # ------------------------------------------------------------ rollout snapshots

    def begin_snapshot(self, anchor: str, *, pending: Any = None) -> SnapshotStage:
        """First half: sequence number and temporary directory. Capture into
        `stage.db_path`, then call `stage.publish(...)`. With `pending` (an unpublished
        trainer checkpoint of this anchor, a `staged.TrainerStage`), the stage is made
        inside its temporary directory and can be published only once `pending` is."""
        with self._lock:
            inv, cleaned = self._start_save()
            anchor_path = anchor_dir(self.root, anchor)
            if pending is not None:
                if pending.anchor != anchor or pending.done:
                    raise AnchorNotDurable(f"{anchor_path}: {pending.anchor} is not a pending checkpoint of this anchor",
                                           path=anchor_path)
                anchor_path = pending.tmp
            else:
                try:
                    read_manifest(anchor_path)
                except ManifestError as e:
                    raise AnchorNotDurable(f"{anchor_path}: anchor is not a durable trainer checkpoint ({e}); "
                                           "publish or seal it before taking a snapshot anchored to it",
                                           path=anchor_path) from None
            # Never reuse a number, even one a crashed attempt or retention has removed.
            sequence = max(inv.max_sequence(), self._last_sequence) + 1
            self._last_sequence = sequence
            target = snapshot_dir(self.root, anchor, sequence)
            if pending is not None:
                target = anchor_path / target.relative_to(target.parents[1])
            try:
                parent = target.parent
                if not parent.is_dir():
                    parent.mkdir()
                    fsync_dir(anchor_path)
                tmp = self._make_tmp(target)
            except OSError as e:
                raise _fail("creating the temporary directory", target, e) from e
            stage = SnapshotStage(self, anchor, sequence, tmp, target, cleaned)
            stage.base = self._newest_snapshot
            if pending is not None:
                stage.pending = pending
                pending.snapshots.append(stage)
            return stage

    def _check_copy(self, stage: SnapshotStage, revision: str | None, timings: dict[str, float]) -> None:
        """What verify would refuse in the captured copy (a file that is no store has
        nothing to check: a restore refuses it), then the sequence number recorded as
        the high water before the snapshot can be listed, so before anyone can delete it.
        Raises CopyRefused, or OSError from the record."""
        t_check = time.perf_counter()
        for problem in (copy_problems(self.root, stage.db_path) if revision else [])[:1]:
            raise CopyRefused(f"{stage.target}: the captured copy fails its checks: {problem}; the snapshot "
                              "is not published (earlier snapshots are intact)", path=stage.target)
        timings["check_copy"] = time.perf_counter() - t_check
        record_high_water(self.root, stage.sequence)

    def _abort(self, stage: SnapshotStage) -> None:
        with self._lock:
            _discard_tmp(stage.tmp)
            self._busy.discard(stage.tmp)
            stage.done = True

    def _finish_snapshot(self, stage: SnapshotStage, capture: Any, config_text, env_export) -> Published:
        if stage.done:
            raise PublishError(f"{stage.target}: this stage was already published or aborted")
        with self._lock:
            t0 = time.perf_counter()
            if stage.pending is not None and stage.pending.published is None:
                raise AnchorNotDurable(f"{stage.target}: its anchor {stage.anchor} is not published yet; publish it "
                                       "first (a snapshot never anchors to an unpublished checkpoint)", path=stage.target)
            try:
                try:
                    if not stage.db_path.is_file():
                        raise PublishError(f"{stage.db_path}: nothing was captured into the stage", path=stage.target)
                    counted = getattr(capture, "row_counts", None), getattr(capture, "group_states", None)
                    revision, counts, states = _read_revision(stage.db_path, count=not all(counted))
                    segments = _listed_segments(self.root, stage.db_path)
                    timings: dict[str, float] = {}
                    # The copy's check (CPU, in SQLite) runs on a helper thread while this
                    # one fsyncs and hashes the files (the disk, BLAKE3): a snapshot pays
                    # about the longer of the two, not their sum; the manifest waits for it.
                    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutdb-copy-check") as helper:
                        checked = helper.submit(self._check_copy, stage, revision, timings)
                        if config_text is not None:
                            write_file(stage.tmp / CONFIG_FILE, config_text.encode() if isinstance(config_text, str) else config_text)
                        if env_export is not None:
                            write_file(stage.tmp / ENV_EXPORT, env_export.encode() if isinstance(env_export, str) else env_export)
                        manifest = Manifest(
                            kind=KIND_SNAPSHOT, anchor=stage.anchor, files=[], sequence=stage.sequence,
                            schema_revision=revision,
                            cut_time=getattr(capture, "cut_time", None),
                            decoded_at=getattr(capture, "decoded_at", None),
                            mutation_counter=getattr(capture, "mutation_counter", None),
                            row_counts=counted[0] or counts,
                            group_states=counted[1] or states,
                            config_fingerprint=config_fingerprint(config_text),
                            timings=dict(getattr(capture, "timings", None) or {}),
                            segments=segments,
                        )
                        timings.update(commit_directory(stage.tmp, stage.target, manifest, before_manifest=checked.result))
                except OSError as e:
                    raise _fail("rollout snapshot", stage.target, e) from e
                except NotAStoreError as e:
                    raise PublishError(f"{stage.target}: the captured file is not a store: {e}", path=stage.target) from e
            except BaseException:
                _discard_tmp(stage.tmp)
                raise
            finally:
                self._busy.discard(stage.tmp)
                stage.done = True
            timings["publish"] = time.perf_counter() - t0
            self._newest_snapshot = stage.target / SNAPSHOT_DB  # its anchor is published (checked above)
            retention = self._retain()
            return Published(KIND_SNAPSHOT, stage.anchor, stage.target, manifest, stage.sequence, timings,
                             stage.cleaned, retention, self._take_warnings())

    def publish_rollout_snapshot(self, anchor: str, capture_fn: Callable[[Path], Any], config_text=None,
                                 env_export=None) -> Published:
        """Both halves in one call: `capture_fn(path)` writes the SQLite file (for
        example ``lambda p: store.capture(p, at_cut=check, base=publisher.snapshot_base())``)
        and returns its Capture.
        Records no outcome: a caller with its own loop records each attempt with
        `Store.record_snapshot_attempt` (the snapshot pump does, for the controller)."""
        stage = self.begin_snapshot(anchor)
        try:
            capture = capture_fn(stage.db_path)
        except (OSError, sqlite3.OperationalError) as e:
            cause = _as_os_error(e)
            stage.abort()
            if cause is None:
                raise
            raise _fail("capture", stage.target, cause) from e
        except BaseException:
            stage.abort()
            raise
        return stage.publish(capture, config_text, env_export)

    def publish_deferred(self, stage: SnapshotStage, capture: Any = None, config_text=None, env_export=None) -> Future:
        """Run `stage.publish` on the background thread. Its result is the Published, or
        None on failure; a failure is raised once by the next save on this Publisher."""

        def job():
            try:
                return stage.publish(capture, config_text, env_export)
            except BaseException as e:  # noqa: BLE001 - surfaced at the next save
                log.warning("deferred publish of %s failed: %s", stage.target, e)
                with self._lock:
                    self._pending_error = e
                return None

        return self._pool().submit(job)

    def apply_retention(self) -> RetentionReport:
        with self._lock:
            return self._apply_retention()

    def close(self) -> None:
        """Wait for background work. Its failures still surface at the next save."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


__all__ = [
    "BOOTSTRAP", "AnchorNotDurable", "BackgroundWorkError", "CopyRefused", "PublishError", "Published", "Publisher",
    "SnapshotStage", "commit_directory", "record_high_water", "rename_into_place", "seal_directory",
]
