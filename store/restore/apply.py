"""Restoring the live store from a rollout snapshot: once per process, after the trainer's
weights are loaded from the snapshot's anchor and before the pumps start.

`restore_snapshot` (this module: the order of work and the file I/O) works on a copy
beside the live store and replaces the live file only when every check has passed. The
checks, the plan it returns and what it read of the snapshot (`SnapshotReading`: the
manifest, the store file's revision, the segment list, each read once and handed to
every phase) are in `plan.py`, restart normalization in `normalize.py`, the overlapped
copy and integrity check in `copying.py`. In this order:

1. manifest and checksums: every file the manifest lists, hashed; the store file is
   hashed as it is copied beside the live store (the hash covers the copy's bytes); the
   payload segments the manifest lists (revision v1_6_a) are hashed where they are, on
   a helper thread while phases 2-8 run, and never copied: the restored store
   references them (their verdict is awaited before phase 9, so a damaged segment still
   refuses the restore with nothing replaced);
2. schema: an older revision is upgraded on the copy (Alembic), a newer one refused
   with what to do; the snapshot directory itself is only ever read;
3. ``PRAGMA integrity_check`` of the snapshot's store file, run on its own thread while
   the copy is made (`copying.py` says why that checks the copy's bytes), and again
   on the copy when it was upgraded;
4. run_meta: the run id (when the caller gives it), config fingerprint, dataset
   fingerprint, forest-training settings (and the dispatch mode, when the caller says
   it) equal the run's, or a refusal naming each;
5. replay groups: each published group holds one permit below capacity (invariant 2);
6. the ledger (ledger dispatch only): the payload inventory is checked against the
   ledger *before* anything changes (invariant 3: a mismatch is refused, so nothing is
   discarded by mistake), and replay (invariant 2: sealed groups are about to enter it);
   then restart normalization in one transaction: what the
   `running` attempts saved (prefix chunks, episodes) is read, and the attempts are
   left running: the rollout pump abandons each (reason `restart`) in the transaction
   that starts its replacement (`ledger.restart_attempts`); `reserved` groups move
   to `dispatched` with no attempt (see below); `sealed` groups enter replay with one
   permit each; payload rows no live ledger row references are cleared; the inventory
   is checked again, with the other invariants (the positions, prompts and cursor,
   which normalization leaves as they are, audited this once);
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
``ledger.restart_attempts(tx, [(group_id, i) for i in generations_to_run])`` (what
`LedgerDispatch.restart` does). `RestoredGroup.was_reserved` tells them apart.
Dispatched groups whose generations had all finished but were not yet sealed (a cut
between the pump's finish and publish transactions) are returned apart, in
`RestorePlan.to_finalize`: they need no generation, only the pump's finalizer
(variance filter, then publish or discard).
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from ..checkpoints.layout import ENV_EXPORT, segments_dir_of
from ..checkpoints.manifest import Manifest
from ..errors import RecordDamaged, RestoreError, SnapshotDamaged
from ..fsio import SQLITE_SIDE_SUFFIXES, remove_sqlite_file, replace_file, temp_path_beside
from ..live import pools
from ..live.store import Store
from ..sqlite.database import Database
from ..sqlite.upgrade import refuse_if_open
from .copying import SourceIntegrityCheck
from .normalize import normalize_ledger, normalize_without_ledger
from .plan import (
    RestorePlan,
    bring_to_head,
    check_integrity,
    check_replay,
    check_run_meta,
    check_spare_and_cursor,
    connect,
    read_snapshot,
    refuse_on_invariants,
    stamp_config_fingerprint,
    verify_and_copy,
)

# --------------------------------------------------------------------------- helpers


class _Phases:
    """Wall time per phase, in the order they ran. A phase opened inside another (the
    ledger's `in_flight`) is counted in both; the outer one is current again after it."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.current = ""
        self._open: list[str] = []

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self.current = name
        self._open.append(name)
        try:
            yield
        finally:
            self._open.pop()
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0
        if self._open:  # left without an error: a failure later names the outer phase
            self.current = self._open[-1]


def _replace_live(copy: Path, live: Path) -> None:
    """Phase 9. Side files of the live path go first: SQLite would apply a stale WAL
    (or hot journal) left by a killed process to the new file of the same name."""
    for suffix in SQLITE_SIDE_SUFFIXES:
        Path(f"{live}{suffix}").unlink(missing_ok=True)
    replace_file(copy, live)


def _fold_wal(path: Path) -> None:
    """Make the copy one standalone file: fold and drop any WAL left by our connections."""
    if Path(f"{path}-wal").exists():
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for suffix in SQLITE_SIDE_SUFFIXES:
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
    earlier_config_fingerprint: str | None = None,
    manifest: Manifest | None = None,
) -> RestorePlan:
    """Restore `snapshot_dir` into `live_store_path` (see the module docstring).

    No connection may be open on the live store. `ledger_dispatch`, when given, must
    match the snapshot's mode; `trainer_step`, when given, must equal the anchor's step
    (the weights the caller loaded); `run_id`, when given, must be the snapshot's run id
    (the live store's: a snapshot of another run never replaces it); `earlier_config_fingerprint`,
    when given, is accepted in place of `config_fingerprint` (the same config under the
    fingerprint's earlier formula) and replaced by it in the restored store. `manifest`: the
    snapshot's, when the caller has read it (the listing that chose the snapshot); it
    is not read again, and every file is checked against it. Raises a `RestoreError`
    subclass on any refusal."""
    snapshot_dir, live = Path(snapshot_dir), Path(live_store_path)
    phases = _Phases()
    with phases("manifest"):
        snapshot = read_snapshot(snapshot_dir, manifest)
    source, step, manifest = snapshot.source, snapshot.step, snapshot.manifest
    if trainer_step is not None and trainer_step != step:
        raise RestoreError(f"{snapshot_dir}: anchored to {manifest.anchor} but the trainer loaded step {trainer_step}; "
                           f"load the weights of {manifest.anchor} before restoring its snapshot")
    if not live.parent.is_dir():
        raise RestoreError(f"{live.parent}: no such directory; pass the run directory's store path")
    refuse_if_open(live, doing="resume")  # replaced under another process, its commits would be lost
    copy = temp_path_beside(live, "restore")
    remove_sqlite_file(copy)  # our own pid's leftover of an earlier failed restore
    counts: dict[str, int] = {}
    config_fingerprint_was: str | None = None
    # Starts now, beside the copy; its verdict is read after the checksums and the
    # schema, so refusals come in the same order as if it ran after them.
    source_check = SourceIntegrityCheck(source) if source.is_file() else None
    segment_check = None
    try:
        with phases("checksums"):
            segment_check = verify_and_copy(snapshot, copy)
        with phases("schema"):
            bring_to_head(copy, snapshot, source_check)
        with phases("integrity"):
            if snapshot.upgraded_from is None:
                check_integrity(copy, source, source_check.result())
            else:  # the migrated copy is new bytes
                check_integrity(copy, source)
        with contextlib.closing(connect(copy)) as conn:
            with phases("run_meta"):
                mode = check_run_meta(conn, source, config_fingerprint=config_fingerprint,
                                       dataset_fingerprint=dataset_fingerprint, forest_training=forest_training,
                                       ledger_dispatch=ledger_dispatch, run_id=run_id,
                                       earlier_config_fingerprint=earlier_config_fingerprint)
                config_fingerprint_was = stamp_config_fingerprint(conn, config_fingerprint,
                                                                  earlier_config_fingerprint)
            with phases("replay"):
                counts["replay_groups"] = check_replay(conn, source)
            with phases("ledger"):
                if mode:
                    # Before normalization, what it could erase or trip over: payload of no
                    # live row (invariant 3: refuse, never clear by mistake) and replay
                    # (invariant 2: sealed groups enter it). The positions, prompts, settled
                    # record and cursor (1, 4) it leaves as they are: the audit after it
                    # checks those, once (the prompt audit and the settled record's decode
                    # were ~0.015 s of a 0.16 s restore at 10k groups in flight).
                    refuse_on_invariants(conn, source, "before restart normalization", only=(2, 3))
        redispatch, to_finalize, saved = [], [], {"prefixes": {}, "episodes": {}}
        store = Store(Database(copy, checkpointer=False))
        try:
            with phases("ledger" if mode else "shortfall"), store.atomic() as tx:
                if mode:
                    chunks_dir = segments_dir_of(snapshot.checkpoint_dir) if snapshot.checkpoint_dir else None
                    redispatch, to_finalize = normalize_ledger(tx, source, step, counts, saved, chunks_dir, phases)
                else:
                    counts.update(reserved_to_dispatched=0, published_at_restore=0, generations_to_run=0)
                    normalize_without_ledger(tx, source, step, groups_per_step, counts)
                shortfall = pools.get_shortfall(tx)
        finally:
            store.close()
        _fold_wal(copy)
        with contextlib.closing(connect(copy)) as conn:
            with phases("ledger" if mode else "shortfall"):
                refuse_on_invariants(conn, source, "after restart normalization")
            with phases("spare_and_cursor"):
                counts["spare_prompts"] = check_spare_and_cursor(conn, source)
        with phases("segments"):  # hashed on their own thread since phase 1: wait for the verdict
            segment_check.result()
        with phases("replace"):
            _replace_live(copy, live)
    except RecordDamaged as e:  # a forged settled record, found by its one decoder: another snapshot may be sound
        raise SnapshotDamaged(f"{source}: {e}", source) from None
    except OSError as e:  # a failing disk: one line, like every other refusal
        name = errno_mod.errorcode.get(e.errno or 0, "EIO")
        raise RestoreError(f"{live}: restore failed in phase {phases.current}: {e.strerror or e} [{name}]; the snapshot "
                           "is unchanged and the live store was not replaced; fix the disk and resume again") from e
    finally:
        if source_check is not None:
            source_check.cancel()
        remove_sqlite_file(copy)
    env_export = snapshot_dir / ENV_EXPORT
    return RestorePlan(
        snapshot_dir=snapshot_dir,
        anchor=manifest.anchor,
        sequence=manifest.sequence,
        cut_time=manifest.cut_time,
        decoded_at=manifest.decoded_at,
        trained_step=step,
        schema_revision=snapshot.revision,
        upgraded_from=snapshot.upgraded_from,
        ledger_dispatch=mode,
        redispatch=redispatch,
        to_finalize=to_finalize,
        shortfall=shortfall,
        counts=counts,
        timings=phases.timings,
        env_export=env_export if env_export.is_file() else None,
        saved_prefixes=saved["prefixes"],
        saved_episodes=saved["episodes"],
        config_fingerprint_was=config_fingerprint_was,
    )
