"""Restoring the live store from a rollout snapshot: once per process, after the trainer's
weights are loaded from the snapshot's anchor and before the pumps start.

`restore_snapshot` works on a copy beside the live store and replaces the live file only
when every check has passed, in this order:

1. manifest and checksums: every file the manifest lists, hashed; the store file is
   hashed as it is copied beside the live store (the hash covers the copy's bytes);
2. schema: an older revision is upgraded on the copy (Alembic), a newer one refused
   with what to do; the snapshot directory itself is only ever read;
3. ``PRAGMA integrity_check`` of the snapshot's store file, run on its own thread while
   the copy is made (`restore_io.py` says why that checks the copy's bytes), and again
   on the copy when it was upgraded;
4. run_meta: the run id (when the caller gives it), config fingerprint, dataset
   fingerprint, forest-training settings (and the dispatch mode, when the caller says
   it) equal the run's, or a refusal naming each;
5. replay groups: each published group holds one permit below capacity (invariant 2);
6. the ledger (ledger dispatch only): the payload inventory is checked against the
   ledger *before* anything changes (invariant 3: a mismatch is refused, so nothing is
   discarded by mistake); then restart normalization in one transaction: every
   `running` attempt becomes `abandoned` with reason `restart`; `reserved` groups move
   to `dispatched` with no attempt (see below); `sealed` groups enter replay with one
   permit each; payload rows no live ledger row references are cleared; the inventory
   is checked again;
7. without ledger dispatch the ledger is empty by design, so nothing can be redispatched:
   the partial payloads of in-flight groups are cleared and each stamped step's
   shortfall is recomputed as groups_per_step minus the replay groups stamped for it.
   **This is what no-ledger recovery loses**: the groups in flight at the cut are gone,
   and their prompts are *not* run again (the sampler cursor is past them and they are
   not in the spare pool); new prompts fill their steps instead;
8. the spare pool as saved, and the sampler-cursor check (invariant 4);
9. the live store file is replaced by the copy: its stale ``-wal``/``-shm``/``-journal``
   are deleted first (a stale WAL must never be applied to the new file), then
   `fsio.replace_file` (fsync, rename, fsync the directory).

Any refusal (a failing disk included) raises a `RestoreError` subclass with a one-line
message, removes the copy, and leaves the live store file and the snapshot as they were
(a disk failing at the final rename finds the live store's stale side files gone).

Reserved groups: a `reserved` group had prompts stamped but no attempt started. Restore
moves it to `dispatched` with *no* attempt (its policy version set to the anchor's step),
so every group handed back is in one state and the rollout pump treats them alike:
``ledger.start_attempts(tx, [(group_id, i) for i in generations_to_run])`` (what
`LedgerDispatch.redispatch` does). `RestoredGroup.was_reserved` tells them apart.
Dispatched groups whose generations had all finished but were not yet sealed (a cut
between the pump's finish and publish transactions) are returned apart, in
`RestorePlan.to_finalize`: they need no generation, only the pump's finalizer
(variance filter, then publish or discard).
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import json
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import Connection, delete, func, literal_column, select, update

from ..live import ledger, pools
from ..sqlite.database import Database
from ..errors import NotAStoreError, ReplayFullError, SchemaTooNewError, StoreError
from ..fsio import replace_file, temp_path_beside
from ..live.invariants import check_invariants
from ..checkpoints.layout import ENV_EXPORT, SNAPSHOT_DB, anchor_step
from ..live.ledger import Reservation
from ..checkpoints.manifest import (
    KIND_SNAPSHOT,
    Manifest,
    ManifestError,
    describe_files_names,
    hash_file,
    member_path,
    read_manifest,
)
from .copying import SourceIntegrityCheck, copy_hashing
from ..sqlite.identity import check_schema
from ..sqlite.revision import (
    classify_revision,
    file_revision,
    head_revision,
    known_revisions,
    refuse_if_open,
    run_migrations,
)
from ..live.schema import T
from ..live.store import Store

SIDE_SUFFIXES = ("-wal", "-shm", "-journal")


class RestoreError(StoreError):
    """A snapshot cannot be restored. The live store and the snapshot are unchanged."""


class SnapshotDamaged(RestoreError):
    """A file of the snapshot is missing, changed, or fails integrity_check; `path` names it."""

    def __init__(self, message: str, path: Path | None = None):
        super().__init__(message)
        self.path = path


class SnapshotTooNew(RestoreError, SchemaTooNewError):
    """The snapshot was written by a newer rolloutdb than this one."""


class RunMismatch(RestoreError):
    """The snapshot belongs to a run with other settings; `fields` names what differs."""

    def __init__(self, message: str, fields: list[str]):
        super().__init__(message)
        self.fields = fields


class SnapshotInconsistent(RestoreError):
    """The snapshot's rows break an invariant; `invariant` is its number (0: other)."""

    def __init__(self, message: str, invariant: int = 0):
        super().__init__(message)
        self.invariant = invariant


class PayloadInventoryMismatch(SnapshotInconsistent):
    """Payload rows (samples, chunks, episodes, finalizer results) no live ledger row
    references, found *before* normalization: refused rather than silently cleared."""

    def __init__(self, message: str):
        super().__init__(message, 3)


@dataclass(frozen=True)
class RestoredGroup:
    """A ledger group handed back to the rollout pump, in `dispatched` state."""

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
    trained_step: int  # optimizer steps in the anchor (bootstrap: 0)
    schema_revision: str  # the snapshot file's revision
    upgraded_from: str | None  # set when the copy was migrated to head
    ledger_dispatch: bool
    redispatch: list[RestoredGroup]  # sampler order; dispatch these first
    to_finalize: list[RestoredGroup]  # every generation finished, not yet sealed
    shortfall: dict[int, int]  # per stamped step, groups still to reserve
    # replay_groups (in the snapshot), abandoned_attempts, reserved_to_dispatched,
    # published_at_restore (sealed groups), payload_rows_cleared, spare_prompts
    counts: dict[str, int]
    timings: dict[str, float] = field(default_factory=dict)
    env_export: Path | None = None  # the environment's export in the snapshot, if any
    # What the attempts abandoned at restore had saved, read before normalization drops
    # it (invariant 3), for turn-level and prefix recovery: (group id, generation index)
    # -> prefix chunks in order, and environment episode key -> {"turn", "state"}.
    saved_prefixes: dict[tuple[int, int], list[pools.Chunk]] = field(default_factory=dict)
    saved_episodes: dict[str, dict] = field(default_factory=dict)
    passed_over: list[str] = field(default_factory=list)  # newer snapshots refused, and why


# --------------------------------------------------------------------------- helpers


class _Phases:
    """Wall time per phase, in the order they ran."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.current = ""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self.current = name
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0


def _remove_with_side_files(path: Path) -> None:
    for p in (path, *(Path(f"{path}{s}") for s in SIDE_SUFFIXES)):
        p.unlink(missing_ok=True)


def _canonical(settings: object) -> str:
    return json.dumps(settings, sort_keys=True, separators=(",", ":"))


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


# --------------------------------------------------------------------------- phases 1-3


def read_snapshot_manifest(snapshot_dir: Path) -> Manifest:
    try:
        manifest = read_manifest(snapshot_dir)
    except ManifestError as e:
        raise SnapshotDamaged(f"{e}; restore another snapshot (`rolloutdb snapshots` lists them)",
                              snapshot_dir / "manifest.json") from None
    if manifest.kind != KIND_SNAPSHOT:
        raise SnapshotDamaged(f"{snapshot_dir}: manifest kind {manifest.kind}, not a rollout snapshot; "
                              "pass a rollout_snapshots/snapshot_<N> directory", snapshot_dir)
    return manifest


def _verify_and_copy(snapshot_dir: Path, manifest: Manifest, copy: Path) -> None:
    """Phase 1: every listed file against its size and sha256 (the store file while it
    is copied to `copy`), and no unlisted file."""
    where = str(snapshot_dir / "manifest.json")
    listed = set()
    for entry in manifest.files:
        try:
            path = member_path(snapshot_dir, entry.path, where)
        except ManifestError as e:
            raise SnapshotDamaged(str(e), snapshot_dir) from None
        listed.add(entry.path)
        if not path.is_file():
            raise SnapshotDamaged(f"{path}: missing (the manifest lists it); restore another snapshot", path)
        if entry.path == SNAPSHOT_DB:
            size, digest = copy_hashing(path, copy)
        else:
            size, digest = hash_file(path)
        if size != entry.size or digest != entry.sha256:
            what = f"size {size} bytes, manifest says {entry.size}" if size != entry.size else "sha256 differs from the manifest"
            raise SnapshotDamaged(f"{path}: {what} (the file was changed or damaged); restore another snapshot", path)
    if SNAPSHOT_DB not in listed:
        raise SnapshotDamaged(f"{snapshot_dir}: its manifest lists no {SNAPSHOT_DB}; not a rollout snapshot",
                              snapshot_dir / SNAPSHOT_DB)
    for name in describe_files_names(snapshot_dir):
        if name not in listed:
            raise SnapshotDamaged(f"{snapshot_dir / name}: not listed in the manifest (added after publication?); "
                                  "restore another snapshot", snapshot_dir / name)


def _integrity(copy: Path, source: Path, rows: list[str] | None = None) -> None:
    """Refuse unless integrity_check passes: on `copy`, or the `rows` a check of the
    snapshot's own file returned (`SourceIntegrityCheck`)."""
    if rows is None:
        try:
            with contextlib.closing(_connect(copy)) as conn:
                rows = [r[0] for r in conn.execute("PRAGMA integrity_check(3)").fetchall()]
        except sqlite3.DatabaseError as e:
            rows = [str(e)]
    if rows != ["ok"]:
        first = " ".join(rows[0].split())
        raise SnapshotDamaged(f"{source}: integrity_check failed ({first}); restore another snapshot", source)


def _bring_to_head(copy: Path, source: Path, manifest: Manifest,
                   source_check: SourceIntegrityCheck) -> tuple[str, str | None]:
    """Phase 2: (snapshot revision, revision upgraded from or None). A newer revision is
    refused; an older one is migrated on the copy once the snapshot passed its integrity
    check."""
    try:
        with contextlib.closing(_connect(copy)) as conn:
            revision = file_revision(conn, source)  # exactly one row: refuses none, two, NULL
            if revision in known_revisions():
                check_schema(conn, source, revision)  # the schema is that revision's
    except sqlite3.DatabaseError as e:
        raise SnapshotDamaged(f"{source}: unreadable SQLite file ({e}); restore another snapshot", source) from None
    except NotAStoreError as e:
        raise SnapshotDamaged(str(e), source) from None
    if revision is None:
        raise SnapshotDamaged(f"{source}: not a rolloutdb store (no alembic_version); restore another snapshot", source)
    if manifest.schema_revision not in (None, revision):
        raise SnapshotDamaged(f"{source}: schema revision {revision} but the manifest says {manifest.schema_revision}; "
                              "restore another snapshot", source)
    try:
        kind = classify_revision(source, revision)
    except SchemaTooNewError as e:
        raise SnapshotTooNew(f"{e}, then resume again; the snapshot is left as it is") from None
    if kind == "head":
        return revision, None
    _integrity(copy, source, source_check.result())
    try:
        run_migrations(copy)
    except Exception as e:  # noqa: BLE001 - any failure leaves the snapshot as is
        raise RestoreError(f"{source}: migrating a copy from {revision} to {head_revision()} failed "
                           f"({type(e).__name__}: {e}); the snapshot is left as it is") from e
    return revision, revision


# --------------------------------------------------------------------------- phases 4-5


def _check_run_meta(conn: sqlite3.Connection, source: Path, *, config_fingerprint: str, dataset_fingerprint: str,
                    forest_training: dict, ledger_dispatch: bool | None, run_id: str | None) -> bool:
    """Phase 4; returns the snapshot's dispatch mode."""
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
    except json.JSONDecodeError:
        raise SnapshotDamaged(f"{source}: run_meta.forest_training is not JSON; restore another snapshot", source) from None
    differences, fields = [], []
    if cfg != config_fingerprint:
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
        differences.append(f"ledger dispatch {saved} (run: {'on' if ledger_dispatch else 'off'}): resume with the "
                           "rollout_recovery.target_level the run was started with")
    if differences:
        raise RunMismatch(f"{source}: the snapshot belongs to a run with other settings: " + "; ".join(differences)
                          + "; or start a new run directory", fields)
    return bool(ledger_mode)


def _check_replay(conn: sqlite3.Connection, source: Path) -> int:
    """Phase 5 (invariant 2): every replay group published, one permit below capacity."""
    capacity = conn.execute("SELECT replay_capacity FROM run_meta").fetchone()[0]
    over = conn.execute("SELECT group_id, permit FROM replay_groups WHERE permit < 0 OR permit >= ?", (capacity,)).fetchall()
    if over:
        g, p = over[0]
        raise SnapshotInconsistent(f"{source}: invariant 2: replay group {g} holds permit {p}, outside 0..{capacity - 1} "
                                   f"({len(over)} such); restore another snapshot", 2)
    return conn.execute("SELECT count(*) FROM replay_groups").fetchone()[0]


def _refuse_on_invariants(conn: sqlite3.Connection, source: Path, when: str) -> None:
    report = check_invariants(conn)
    if report.ok:
        return
    first = report.problems[0]
    message = f"{source}: {when}: {first}; restore another snapshot (`rolloutdb verify` shows every problem)"
    if first.startswith("invariant 3"):
        raise PayloadInventoryMismatch(message)
    number = int(first.split()[1].rstrip(":")) if first.startswith("invariant ") else 0
    raise SnapshotInconsistent(message, number)


# --------------------------------------------------------------------------- phase 6


groups_t, rollouts_t, samples_t = T["prompt_groups"], T["rollouts"], T["samples"]
finalizers_t, chunks_t, episodes_t = T["finalizer_results"], T["token_chunks"], T["env_episodes"]
replay_t = T["replay_groups"]


def _clear_unreferenced(tx: Connection) -> int:
    """Payload rows of no live ledger row (invariant 3). Returns how many were removed."""
    dead = select(groups_t.c.group_id).where(groups_t.c.state.in_(("reserved", "trained", "discarded")))
    live_groups = select(groups_t.c.group_id)
    running = select(rollouts_t.c.attempt_id).where(rollouts_t.c.state == "running")
    statements = (
        delete(samples_t).where(samples_t.c.group_id.in_(dead) | samples_t.c.group_id.not_in(live_groups)),
        delete(finalizers_t).where(
            finalizers_t.c.group_id.in_(dead.where(groups_t.c.state != "reserved"))
            | finalizers_t.c.group_id.not_in(live_groups)
        ),
        delete(chunks_t).where(chunks_t.c.attempt_id.not_in(running)),
        delete(episodes_t).where(episodes_t.c.attempt_id.not_in(running)),
    )
    return sum(tx.execute(s).rowcount for s in statements)


def _read_saved_progress(tx: Connection, running: list[int]) -> tuple[dict, dict]:
    """Prefix chunks and environment episodes of the attempts about to be abandoned."""
    where = {a: (g, i) for a, g, i in tx.execute(
        select(rollouts_t.c.attempt_id, rollouts_t.c.group_id, rollouts_t.c.generation_index)
        .where(rollouts_t.c.attempt_id.in_(select(chunks_t.c.attempt_id)), rollouts_t.c.state == "running")
    ).all()}
    prefixes = {where[a]: pools.read_chunks(tx, a) for a in sorted(where)}
    abandoned = set(running)
    episodes = {k: {"turn": t, "state": st} for k, (a, t, st) in pools.read_episodes(tx).items() if a in abandoned}
    return prefixes, episodes


def _abandon_every_running_attempt(tx: Connection) -> int:
    """What `ledger.abandon_attempts(tx, running, "restart")` does, as three statements
    over the whole table: restart normalization abandons *every* running attempt, and
    passing 72k attempt ids through IN lists took 0.7 s of a 100k-group restore
    (bench/bench_restore.py) where these take a fraction of it."""
    running = select(rollouts_t.c.attempt_id).where(rollouts_t.c.state == "running")
    tx.execute(delete(chunks_t).where(chunks_t.c.attempt_id.in_(running)))
    tx.execute(delete(episodes_t).where(episodes_t.c.attempt_id.in_(running)))
    return tx.execute(
        update(rollouts_t).where(rollouts_t.c.state == "running")
        .values(state="abandoned", abandon_reason="restart", ended_at=time.time())
    ).rowcount


def _normalize_ledger(tx: Connection, source: Path, step: int, counts: dict[str, int],
                      saved: dict) -> tuple[list, list]:
    """Phase 6, inside one transaction on the copy."""
    beyond = tx.execute(
        select(func.count()).where(groups_t.c.state == "trained", groups_t.c.trained_step > step)
    ).scalar_one()
    if beyond:
        raise SnapshotInconsistent(f"{source}: {beyond} group(s) trained after step {step}, the snapshot's anchor; "
                                   "the snapshot does not match its trainer checkpoint; restore another snapshot", 1)
    running = list(tx.execute(
        select(rollouts_t.c.attempt_id).where(rollouts_t.c.state == "running").order_by(rollouts_t.c.attempt_id)
    ).scalars())
    saved["prefixes"], saved["episodes"] = _read_saved_progress(tx, running)
    counts["abandoned_attempts"] = _abandon_every_running_attempt(tx)

    reserved = list(tx.execute(
        select(groups_t.c.group_id).where(groups_t.c.state == "reserved").order_by(groups_t.c.sample_seq)
    ).scalars())
    # reserved -> dispatched without starting attempts (dispatch_groups would start
    # them): the pump starts them with start_attempts, as for every restored group.
    ledger._move_groups(tx, reserved, "dispatched", policy_version=step)
    counts["reserved_to_dispatched"] = len(reserved)

    sealed = list(tx.execute(
        select(groups_t.c.group_id).where(groups_t.c.state == "sealed").order_by(groups_t.c.sample_seq)
    ).scalars())
    try:
        ledger.enter_replay(tx, sealed)
    except ReplayFullError as e:
        raise SnapshotInconsistent(f"{source}: cannot put its {len(sealed)} sealed group(s) into replay: {e}", 2) from None
    counts["published_at_restore"] = len(sealed)

    finished: dict[int, set[int]] = {}
    # `+state`: no index on the rollouts' state, so SQLite starts from the dispatched
    # groups and reads their rows, not every finished rollout of the run (0.55 s -> 0.02 s
    # at 100k groups, bench/bench_restore.py).
    for g, i in tx.execute(
        select(rollouts_t.c.group_id, rollouts_t.c.generation_index)
        .join(groups_t, groups_t.c.group_id == rollouts_t.c.group_id)
        .where(groups_t.c.state == "dispatched", literal_column("+rollouts.state") == "finished")
    ).all():
        finished.setdefault(g, set()).add(i)
    was_reserved = set(reserved)
    redispatch, to_finalize = [], []
    for g, seq, epoch, pid, target, n in tx.execute(
        select(groups_t.c.group_id, groups_t.c.sample_seq, groups_t.c.epoch, groups_t.c.prompt_id,
               groups_t.c.target_step, groups_t.c.num_generations)
        .where(groups_t.c.state == "dispatched")
        .order_by(groups_t.c.sample_seq)
    ).all():
        todo = tuple(i for i in range(n) if i not in finished.get(g, ()))
        group = RestoredGroup(g, seq, epoch, pid, target, n, todo, g in was_reserved)
        (redispatch if todo else to_finalize).append(group)
    counts["payload_rows_cleared"] = _clear_unreferenced(tx)
    return redispatch, to_finalize


# --------------------------------------------------------------------------- phase 7


def _normalize_without_ledger(tx: Connection, source: Path, step: int, groups_per_step: int,
                              counts: dict[str, int]) -> None:
    """Phase 7: no ledger, so in-flight groups cannot come back. Clear their partial
    payloads and recompute the shortfall of every stamped step above the anchor."""
    ledger_rows = tx.execute(select(func.count()).select_from(groups_t)).scalar_one()
    if ledger_rows:
        raise SnapshotInconsistent(f"{source}: run_meta says no ledger dispatch but the ledger holds {ledger_rows} "
                                   "group(s); restore another snapshot", 1)
    in_replay = select(replay_t.c.group_id)
    cleared = tx.execute(delete(samples_t).where(samples_t.c.group_id.not_in(in_replay))).rowcount
    cleared += tx.execute(delete(finalizers_t).where(finalizers_t.c.group_id.not_in(in_replay))).rowcount
    cleared += tx.execute(delete(chunks_t)).rowcount + tx.execute(delete(episodes_t)).rowcount
    counts["payload_rows_cleared"] = cleared
    saved = pools.get_shortfall(tx)
    stamped = dict(tx.execute(
        select(replay_t.c.target_step, func.count()).where(replay_t.c.target_step.is_not(None)).group_by(replay_t.c.target_step)
    ).all())
    top = max([*saved, *stamped], default=step)
    for s in saved:
        if s <= step:
            pools.set_shortfall(tx, s, 0)  # a trained step needs nothing
    for s in range(step + 1, top + 1):
        pools.set_shortfall(tx, s, max(0, groups_per_step - stamped.get(s, 0)))


# --------------------------------------------------------------------------- phase 8-9


def _check_spare_and_cursor(conn: sqlite3.Connection, source: Path) -> int:
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


def _replace_live(copy: Path, live: Path) -> None:
    """Phase 9. Side files of the live path go first: SQLite would apply a stale WAL
    (or hot journal) left by a killed process to the new file of the same name."""
    for suffix in SIDE_SUFFIXES:
        Path(f"{live}{suffix}").unlink(missing_ok=True)
    replace_file(copy, live)


def _fold_wal(path: Path) -> None:
    """Make the copy one standalone file: fold and drop any WAL left by our connections."""
    if Path(f"{path}-wal").exists():
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for suffix in SIDE_SUFFIXES:
        Path(f"{path}{suffix}").unlink(missing_ok=True)


# --------------------------------------------------------------------------- entry point


def restore_snapshot(
    snapshot_dir: str | Path,
    live_store_path: str | Path,
    *,
    config_fingerprint: str,
    dataset_fingerprint: str,
    forest_training: dict,
    groups_per_step: int,
    ledger_dispatch: bool | None = None,
    trainer_step: int | None = None,
    run_id: str | None = None,
) -> RestorePlan:
    """Restore `snapshot_dir` into `live_store_path` (see the module docstring).

    No connection may be open on the live store. `ledger_dispatch`, when given, must
    match the snapshot's mode; `trainer_step`, when given, must equal the anchor's step
    (the weights the caller loaded); `run_id`, when given, must be the snapshot's run id
    (the live store's: a snapshot of another run never replaces it). Raises a `RestoreError` subclass on any refusal."""
    snapshot_dir, live = Path(snapshot_dir), Path(live_store_path)
    phases = _Phases()
    source = snapshot_dir / SNAPSHOT_DB
    with phases("manifest"):
        manifest = read_snapshot_manifest(snapshot_dir)
        try:
            step = anchor_step(manifest.anchor) or 0
        except ValueError as e:
            raise SnapshotDamaged(f"{snapshot_dir}: {e}; restore another snapshot", snapshot_dir) from None
    if trainer_step is not None and trainer_step != step:
        raise RestoreError(f"{snapshot_dir}: anchored to {manifest.anchor} but the trainer loaded step {trainer_step}; "
                           f"load the weights of {manifest.anchor} before restoring its snapshot")
    if not live.parent.is_dir():
        raise RestoreError(f"{live.parent}: no such directory; pass the run directory's store path")
    refuse_if_open(live, doing="resume")  # replaced under another process, its commits would be lost
    copy = temp_path_beside(live, "restore")
    _remove_with_side_files(copy)  # our own pid's leftover of an earlier failed restore
    counts: dict[str, int] = {}
    # Starts now, beside the copy; its verdict is read after the checksums and the
    # schema, so refusals come in the same order as if it ran after them.
    source_check = SourceIntegrityCheck(source) if source.is_file() else None
    try:
        with phases("checksums"):
            _verify_and_copy(snapshot_dir, manifest, copy)
        with phases("schema"):
            revision, upgraded_from = _bring_to_head(copy, source, manifest, source_check)
        with phases("integrity"):
            if upgraded_from is None:
                _integrity(copy, source, source_check.result())
            else:  # the migrated copy is new bytes
                _integrity(copy, source)
        with contextlib.closing(_connect(copy)) as conn:
            with phases("run_meta"):
                mode = _check_run_meta(conn, source, config_fingerprint=config_fingerprint,
                                       dataset_fingerprint=dataset_fingerprint, forest_training=forest_training,
                                       ledger_dispatch=ledger_dispatch, run_id=run_id)
            with phases("replay"):
                counts["replay_groups"] = _check_replay(conn, source)
            with phases("ledger"):
                if mode:  # invariant 3 before normalization: refuse, never clear by mistake
                    _refuse_on_invariants(conn, source, "before restart normalization")
        redispatch, to_finalize, saved = [], [], {"prefixes": {}, "episodes": {}}
        store = Store(Database(copy, checkpointer=False))
        try:
            with phases("ledger" if mode else "shortfall"), store.atomic() as tx:
                if mode:
                    redispatch, to_finalize = _normalize_ledger(tx, source, step, counts, saved)
                else:
                    counts.update(abandoned_attempts=0, reserved_to_dispatched=0, published_at_restore=0)
                    _normalize_without_ledger(tx, source, step, groups_per_step, counts)
                shortfall = pools.get_shortfall(tx)
        finally:
            store.close()
        _fold_wal(copy)
        with contextlib.closing(_connect(copy)) as conn:
            with phases("ledger" if mode else "shortfall"):
                _refuse_on_invariants(conn, source, "after restart normalization")
            with phases("spare_and_cursor"):
                counts["spare_prompts"] = _check_spare_and_cursor(conn, source)
        with phases("replace"):
            _replace_live(copy, live)
    except OSError as e:  # a failing disk: one line, like every other refusal
        name = errno_mod.errorcode.get(e.errno or 0, "EIO")
        raise RestoreError(f"{live}: restore failed in phase {phases.current}: {e.strerror or e} [{name}]; the snapshot "
                           "is unchanged and the live store was not replaced; fix the disk and resume again") from e
    finally:
        if source_check is not None:
            source_check.cancel()
        _remove_with_side_files(copy)
    env_export = snapshot_dir / ENV_EXPORT
    return RestorePlan(
        snapshot_dir=snapshot_dir,
        anchor=manifest.anchor,
        sequence=manifest.sequence,
        cut_time=manifest.cut_time,
        trained_step=step,
        schema_revision=revision,
        upgraded_from=upgraded_from,
        ledger_dispatch=mode,
        redispatch=redispatch,
        to_finalize=to_finalize,
        shortfall=shortfall,
        counts=counts,
        timings=phases.timings,
        env_export=env_export if env_export.is_file() else None,
        saved_prefixes=saved["prefixes"],
        saved_episodes=saved["episodes"],
    )
