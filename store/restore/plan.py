"""The restore plan and the checks a snapshot must pass before the live store changes
(phases 1-5 and 8 of `apply.restore_snapshot`; the module docstring there gives the
order). Each check raises a `RestoreError` subclass (`store/errors.py`) with one line.

What the restore reads of the snapshot it reads once, into a `SnapshotReading` that every
phase is handed: the manifest (read by the listing that chose the snapshot, or here), the
store file's revision (phase 2, one question to the sqlite floor) and the segment list
(the manifest's `segments`, where they live, and which samples the copy points at each:
phase 1, one read of the copy). No phase reads the manifest again, asks for the revision
again or works out where the segments are.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..checkpoints.hashing import Hashing
from ..checkpoints.layout import SNAPSHOT_DB, SNAPSHOTS_DIR, anchor_step
from ..checkpoints.segments import missing_payload, read_sample_references, unlisted_segments, verify_segments
from ..checkpoints.manifest import (
    KIND_SNAPSHOT,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    describe_files_names,
    member_paths,
    read_manifest,
)
from ..errors import (
    NotAStoreError,
    PayloadInventoryMismatch,
    RestoreError,
    RunMismatch,
    SchemaTooNewError,
    SnapshotDamaged,
    SnapshotInconsistent,
    SnapshotTooNew,
)
from ..live import pools
from ..live.invariants import check_invariants
from ..live.ledger import Reservation
from ..sqlite.identity import read_revision
from ..sqlite.integrity import first_problem, integrity_problems
from ..sqlite.revision import head_revision, run_migrations
from .copying import SourceIntegrityCheck, copy_hashing


class RestoredGroup(NamedTuple):
    """A ledger group handed back to the rollout pump, in `dispatched` state. A
    NamedTuple, immutable like the frozen dataclass it was and a quarter of its cost to
    build (0.29 vs 0.95 us): a restore builds one per group in flight (10k-100k)."""

    group_id: int
    sample_seq: int
    epoch: int
    prompt_id: int
    target_step: int | None
    num_generations: int
    generations_to_run: tuple[int, ...]  # generation indices with no finished attempt
    was_reserved: bool = False  # no attempt had started before the stop

    @property
    def reservation(self) -> Reservation:
        return Reservation(self.sample_seq, self.epoch, self.prompt_id)


@dataclass
class RestorePlan:
    """What a restore did and what the rollout pump must dispatch before the dataloader."""

    snapshot_dir: Path
    anchor: str
    sequence: int
    cut_time: float | None
    decoded_at: float | None  # the cut's decode point (prefix level; Manifest.decoded_at)
    trained_step: int  # optimizer steps in the anchor (bootstrap: 0)
    schema_revision: str  # the snapshot file's revision
    upgraded_from: str | None  # set when the copy was migrated to head
    ledger_dispatch: bool
    redispatch: list[RestoredGroup]  # sampler order; dispatch these first
    to_finalize: list[RestoredGroup]  # every generation finished, not yet sealed
    shortfall: dict[int, int]  # per stamped step, groups still to reserve
    # replay_groups (in the snapshot), reserved_to_dispatched, published_at_restore
    # (sealed groups), generations_to_run (of `redispatch`), payload_rows_cleared,
    # spare_prompts
    counts: dict[str, int]
    # wall seconds per phase (apply.py's list); `in_flight`, inside `ledger`: reading what
    # the running attempts saved (the pump abandons them: `ledger.restart_attempts`)
    timings: dict[str, float] = field(default_factory=dict)
    env_export: Path | None = None  # the environment's export in the snapshot, if any
    # What the running attempts had saved (the pump restarts them, and their saved rows
    # go when it abandons them: invariant 3), for prefix and turn-level recovery, both
    # keyed by (group id, generation index): prefix chunks in order, and the episode
    # after its last committed turn (`token_ids` None: state only, restart the episode).
    saved_prefixes: dict[tuple[int, int], list[pools.Chunk]] = field(default_factory=dict)
    saved_episodes: dict[tuple[int, int], pools.SavedEpisode] = field(default_factory=dict)
    passed_over: list[str] = field(default_factory=list)  # newer snapshots refused, and why
    # The earlier formula's config fingerprint the snapshot carried (check_run_meta),
    # replaced by the current one in the restored store; None when it was current.
    config_fingerprint_was: str | None = None


@dataclass
class SnapshotReading:
    """A snapshot as the restore read it, handed to every phase (the module docstring).
    `revision`, `upgraded_from` and `references` are filled in by phases 1-2."""

    snapshot_dir: Path
    manifest: Manifest
    hashing: Hashing  # the hash the manifest's digests are of
    step: int  # optimizer steps in the anchor (bootstrap: 0)
    # The checkpoint directory the snapshot was published in (its payload_segments/ are
    # there); None for a snapshot directory anywhere else (it may list no segment).
    checkpoint_dir: Path | None
    revision: str | None = None  # the store file's, read on the copy (phase 2)
    upgraded_from: str | None = None  # set when the copy was migrated to head
    # The segment list of the copy: file name -> the ids of the samples pointed at it.
    references: dict[str, list[int]] = field(default_factory=dict)

    @property
    def source(self) -> Path:
        return self.snapshot_dir / SNAPSHOT_DB

    @property
    def where(self) -> str:
        return str(self.snapshot_dir / MANIFEST_NAME)


def read_snapshot(snapshot_dir: Path, manifest: Manifest | None = None) -> SnapshotReading:
    """The reading a restore starts from: `manifest` when the caller read it (the listing
    that chose the snapshot), else the manifest read here; refused unless it is a rollout
    snapshot's with an anchor name."""
    if manifest is None:
        try:
            manifest = read_manifest(snapshot_dir)
        except ManifestError as e:
            raise SnapshotDamaged(f"{e}; restore another snapshot (`rolloutdb snapshots` lists them)",
                                  snapshot_dir / MANIFEST_NAME) from None
    if manifest.kind != KIND_SNAPSHOT:
        raise SnapshotDamaged(f"{snapshot_dir}: manifest kind {manifest.kind}, not a rollout snapshot; "
                              "pass a rollout_snapshots/snapshot_<N> directory", snapshot_dir)
    try:
        step = anchor_step(manifest.anchor) or 0
    except ValueError as e:
        raise SnapshotDamaged(f"{snapshot_dir}: {e}; restore another snapshot", snapshot_dir) from None
    published = snapshot_dir.parent.name == SNAPSHOTS_DIR  # CHECKPOINT_DIR/<anchor>/rollout_snapshots/
    return SnapshotReading(snapshot_dir, manifest, manifest.hashing, step,
                           snapshot_dir.parent.parent.parent if published else None)


def _canonical(settings: object) -> str:
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


# --------------------------------------------------------------------------- phases 1-3


def verify_and_copy(snapshot: SnapshotReading, copy: Path) -> SegmentCheck:
    """Phase 1: every listed file against its size and checksum (the hash the
    manifest's format names; the store file while it is copied to `copy`), and no
    unlisted file. Returns the check of the payload segments, started on its own thread
    (`SegmentCheck`): the caller waits for it before the live store is replaced."""
    snapshot_dir, manifest, hashing = snapshot.snapshot_dir, snapshot.manifest, snapshot.hashing
    listed = set()
    for entry, path in member_paths(snapshot_dir, manifest.files, snapshot.where):
        if isinstance(path, ManifestError):
            raise SnapshotDamaged(str(path), snapshot_dir) from None
        listed.add(entry.path)
        if not path.is_file():
            raise SnapshotDamaged(f"{path}: missing (the manifest lists it); restore another snapshot", path)
        if entry.path == SNAPSHOT_DB:
            size, digest = copy_hashing(path, copy, hashing)
        else:
            size, digest = hashing.file(path)
        if size != entry.size or digest != entry.digest:
            what = f"size {size} bytes, manifest says {entry.size}" if size != entry.size else f"{hashing.name} differs from the manifest"
            raise SnapshotDamaged(f"{path}: {what} (the file was changed or damaged); restore another snapshot", path)
    if SNAPSHOT_DB not in listed:
        raise SnapshotDamaged(f"{snapshot_dir}: its manifest lists no {SNAPSHOT_DB}; not a rollout snapshot",
                              snapshot_dir / SNAPSHOT_DB)
    for name in describe_files_names(snapshot_dir):
        if name not in listed:
            raise SnapshotDamaged(f"{snapshot_dir / name}: not listed in the manifest (added after publication?); "
                                  "restore another snapshot", snapshot_dir / name)
    return verify_listed_segments(snapshot, copy)


class SegmentCheck:
    """The payload segments' checksums, read and hashed on a helper thread while the
    restore goes on (BLAKE3 releases the GIL, so with a free core the hash of 1 GiB of
    segments, ~0.3 s here, hides behind the restart normalization). Measured on 2
    shared cores at load 2-2.5 (bench/bench_restore.py --segments, 100k groups + 1 GiB):
    restore 0.904 s hashing in line, 0.905 s on the thread; the ledger phase grew by
    what the hash took: there was no free core to overlap on.
    `result()` waits and raises SnapshotDamaged naming the first damaged segment. A
    restore refused earlier leaves the thread to finish its reads (it writes nothing)."""

    def __init__(self, snapshot: SnapshotReading):
        self.snapshot_dir = snapshot.snapshot_dir
        self.problems: list[str] | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        manifest, checkpoint_dir = snapshot.manifest, snapshot.checkpoint_dir
        if manifest.segments and checkpoint_dir is not None:
            references = snapshot.references

            def run() -> None:
                try:
                    self.problems = verify_segments(checkpoint_dir, manifest.segments, snapshot.hashing, snapshot.where)
                    if not self.problems:  # `verify`'s check: each sample's payload in the segment named
                        self.problems = missing_payload(checkpoint_dir, references, str(snapshot.source))
                except BaseException as e:  # noqa: BLE001 - re-raised by result()
                    self.error = e

            self._thread = threading.Thread(target=run, name="rolloutdb-restore-segments", daemon=True)
            self._thread.start()

    def result(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        if self.error is not None:
            raise self.error
        if self.problems:
            raise SnapshotDamaged(f"{self.problems[0]}; restore another snapshot", self.snapshot_dir)


def verify_listed_segments(snapshot: SnapshotReading, copy: Path) -> SegmentCheck:
    """The payload stays where it was published. Each segment the manifest lists is
    read and hashed (not copied: `SegmentCheck`, on its own thread); the restored store
    references the same files in CHECKPOINT_DIR/payload_segments/. Every segment the
    copy references must be listed. An older snapshot lists none: its payload is inline
    in the copy. The copy's segment list is read once, into `snapshot.references`
    (here: the copy changes once the thread runs)."""
    snapshot_dir, manifest, where = snapshot.snapshot_dir, snapshot.manifest, snapshot.where
    try:
        snapshot.references = read_sample_references(copy)
    except (NotAStoreError, sqlite3.DatabaseError) as e:
        raise SnapshotDamaged(f"{snapshot_dir / SNAPSHOT_DB}: unreadable payload references ({e}); "
                              "restore another snapshot", snapshot_dir / SNAPSHOT_DB) from None
    unlisted = unlisted_segments(snapshot.references, manifest.segments)
    if unlisted:
        raise SnapshotDamaged(f"{snapshot_dir / SNAPSHOT_DB}: references payload segment {unlisted[0]}, which its "
                              "manifest does not list; restore another snapshot", snapshot_dir / SNAPSHOT_DB)
    if manifest.segments and snapshot.checkpoint_dir is None:
        raise SnapshotDamaged(f"{where}: lists payload segments, which are found only where the snapshot was "
                              "published (CHECKPOINT_DIR/<anchor>/rollout_snapshots/); restore it from there",
                              snapshot_dir)
    return SegmentCheck(snapshot)


def check_integrity(copy: Path, source: Path, rows: list[str] | None = None) -> None:
    """Refuse unless integrity_check passes: on `copy`, or the `rows` a check of the
    snapshot's own file returned (`SourceIntegrityCheck`)."""
    if rows is None:
        try:
            with contextlib.closing(connect(copy)) as conn:
                rows = integrity_problems(conn, 3, errors_as_problems=True)
        except sqlite3.DatabaseError as e:  # the open itself
            rows = [str(e)]
    if rows:
        first = first_problem(rows)
        raise SnapshotDamaged(f"{source}: integrity_check failed ({first}); restore another snapshot", source)


def bring_to_head(copy: Path, snapshot: SnapshotReading, source_check: SourceIntegrityCheck) -> None:
    """Phase 2: sets `snapshot.revision` (the copy's) and `snapshot.upgraded_from` (that
    revision when the copy was migrated, else None). A newer revision is refused; an
    older one is migrated on the copy once the snapshot passed its integrity check."""
    source, manifest = snapshot.source, snapshot.manifest
    try:
        with contextlib.closing(connect(copy)) as conn:
            # Exactly one row (refuses none, two, NULL); a known revision's schema checked.
            found = read_revision(conn, source)
    except sqlite3.DatabaseError as e:
        raise SnapshotDamaged(f"{source}: unreadable SQLite file ({e}); restore another snapshot", source) from None
    except NotAStoreError as e:
        raise SnapshotDamaged(str(e), source) from None
    revision = snapshot.revision = found.revision
    if revision is None:
        raise SnapshotDamaged(f"{source}: not a rolloutdb store (no alembic_version); restore another snapshot", source)
    if manifest.schema_revision not in (None, revision):
        raise SnapshotDamaged(f"{source}: schema revision {revision} but the manifest says {manifest.schema_revision}; "
                              "restore another snapshot", source)
    if isinstance(found.refusal, SchemaTooNewError):
        raise SnapshotTooNew(f"{found.refusal}, then resume again; the snapshot is left as it is") from None
    if found.refusal is not None:
        raise found.refusal
    if found.status == "head":
        return
    check_integrity(copy, source, source_check.result())
    try:
        run_migrations(copy)
    except Exception as e:  # noqa: BLE001 - any failure leaves the snapshot as is
        raise RestoreError(f"{source}: migrating a copy from {revision} to {head_revision()} failed "
                           f"({type(e).__name__}: {e}); the snapshot is left as it is") from e
    snapshot.upgraded_from = revision


# --------------------------------------------------------------------------- phases 4-5


def check_run_meta(conn: sqlite3.Connection, source: Path, *, config_fingerprint: str, dataset_fingerprint: str,
                    forest_training: dict, ledger_dispatch: bool | None, run_id: str | None,
                    earlier_config_fingerprint: str | None = None) -> bool:
    """Phase 4; returns the snapshot's dispatch mode. `earlier_config_fingerprint`: the
    same config under the fingerprint's earlier formula, which older snapshots carry."""
    row = conn.execute(
        "SELECT config_fingerprint, dataset_fingerprint, forest_training, ledger_dispatch, run_id FROM run_meta"
    ).fetchone()
    if row is None:
        raise SnapshotInconsistent(f"{source}: no run_meta row; restore another snapshot")
    cfg, data, forest_text, ledger_mode, their_run = row
    if run_id is not None and their_run != run_id:
        # Same config and data, another run (another directory, or started over): its
        # ledger would replace this run's, so the check comes first and stands alone.
        raise RunMismatch(f"{source}: the snapshot belongs to another run (run id {their_run}; this run is {run_id}); "
                          "restore a snapshot of this run (`rolloutdb snapshots RUN_DIR/checkpoints`)", ["run_id"])
    try:
        saved_forest = json.loads(forest_text)
    except (ValueError, RecursionError):  # also an integer of more digits than Python converts (4300)
        raise SnapshotDamaged(f"{source}: run_meta.forest_training is not JSON rolloutdb wrote; restore another snapshot",
                              source) from None
    differences, fields = [], []
    if cfg not in (config_fingerprint, earlier_config_fingerprint):
        fields.append("config_fingerprint")
        differences.append(f"config fingerprint {cfg} (run: {config_fingerprint}): resume with the config the run "
                           "was started with (RUN_DIR/config.yaml)")
    if data != dataset_fingerprint:
        fields.append("dataset_fingerprint")
        differences.append(f"dataset fingerprint {data} (run: {dataset_fingerprint}): resume with the dataset the "
                           "run was started with")
    if _canonical(saved_forest) != _canonical(forest_training):
        fields.append("forest_training")
        differences.append(f"forest-training settings {_canonical(saved_forest)} (run: {_canonical(forest_training)}): "
                           "resume with the forest-training settings the run was started with")
    if ledger_dispatch is not None and bool(ledger_mode) != bool(ledger_dispatch):
        fields.append("ledger_dispatch")
        saved = "on" if ledger_mode else "off"
        differences.append(f"ledger dispatch {saved} (run: {'on' if ledger_dispatch else 'off'}; a store without the ledger "
                           "does not record which prompts were in flight, so switching between target_level none and a "
                           "ledger level would lose or repeat them): resume with rollout_recovery.target_level "
                           f"{'group, turn or prefix' if ledger_mode else 'none'}")
    if differences:
        raise RunMismatch(f"{source}: the snapshot belongs to a run with other settings: " + "; ".join(differences)
                          + "; or start a new run directory", fields)
    return bool(ledger_mode)


def stamp_config_fingerprint(conn: sqlite3.Connection, config_fingerprint: str,
                             earlier_config_fingerprint: str | None) -> str | None:
    """After `check_run_meta` passed: a snapshot that carries the earlier formula's
    fingerprint is stamped with the current one, so the snapshots the resumed run takes
    carry it. Returns the value replaced, or None when it was the current one already."""
    stamped = conn.execute("UPDATE run_meta SET config_fingerprint = ? WHERE config_fingerprint != ?",
                           (config_fingerprint, config_fingerprint)).rowcount
    return earlier_config_fingerprint if stamped else None


def check_replay(conn: sqlite3.Connection, source: Path) -> int:
    """Phase 5 (invariant 2): every replay group published, one permit below capacity."""
    capacity = conn.execute("SELECT replay_capacity FROM run_meta").fetchone()[0]
    over = conn.execute("SELECT group_id, permit FROM replay_groups WHERE permit < 0 OR permit >= ?", (capacity,)).fetchall()
    if over:
        g, p = over[0]
        raise SnapshotInconsistent(f"{source}: invariant 2: replay group {g} holds permit {p}, outside 0..{capacity - 1} "
                                   f"({len(over)} such); restore another snapshot", 2)
    return conn.execute("SELECT count(*) FROM replay_groups").fetchone()[0]


def refuse_on_invariants(conn: sqlite3.Connection, source: Path, when: str, only: Collection[int] | None = None) -> None:
    """Refuse on the first problem `check_invariants(conn, only)` finds."""
    report = check_invariants(conn, only)
    if report.ok:
        return
    first, number = report.problems[0], report.invariants[0]
    message = f"{source}: {when}: {first}; restore another snapshot (`rolloutdb verify` shows every problem)"
    if number == 3:
        raise PayloadInventoryMismatch(message)
    raise SnapshotInconsistent(message, number)


# --------------------------------------------------------------------------- phase 8


def check_spare_and_cursor(conn: sqlite3.Connection, source: Path) -> int:
    """Phase 8 (invariant 4): every saved group and spare prompt below the cursor."""
    cursor = conn.execute("SELECT next_seq FROM sampler_state").fetchone()[0]
    beyond = conn.execute(
        "SELECT sample_seq FROM prompt_groups WHERE sample_seq >= ?1 UNION ALL "
        "SELECT sample_seq FROM spare_prompts WHERE sample_seq >= ?1", (cursor,)
    ).fetchall()
    if beyond:
        raise SnapshotInconsistent(f"{source}: invariant 4: sampler position {beyond[0][0]} is saved but the cursor "
                                   f"is at {cursor} ({len(beyond)} such); restore another snapshot", 4)
    return conn.execute("SELECT count(*) FROM spare_prompts").fetchone()[0]
