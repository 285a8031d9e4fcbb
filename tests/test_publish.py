"""Publication: layout, manifests, the commit protocol, sequence numbers, retention and
restore selection, on real stores and real directories."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path

import blake3
import pytest

from rolloutdb.store import (
    AnchorNotDurable,
    FinishedGeneration,
    KeepNewestSnapshotPerAnchor,
    KeepNewestSnapshots,
    KeepNewestTrainerCheckpoints,
    NoRestorableSnapshot,
    PruneBootstrap,
    PublishError,
    Publisher,
    Reservation,
    Retention,
    Store,
    read_manifest,
    scan,
    select_for_restore,
)
from rolloutdb.store.checkpoints.layout import CONFIG_FILE, ENV_EXPORT, NO_MANIFEST, SNAPSHOT_DB, TEMPORARY
from rolloutdb.store.checkpoints.manifest import ManifestError, member_path, verify_files

CONFIG = "model: tiny\nsnapshot_every_s: 5\n"


def _weights(d: Path) -> None:
    (d / "model.safetensors").write_bytes(os.urandom(2048))
    (d / "optimizer").mkdir()
    (d / "optimizer" / "state.bin").write_bytes(b"adam" * 100)


def _work(store: Store, seq: int) -> int:
    (gid,) = store.reserve([Reservation(seq, 0, seq)], num_generations=1, target_step=1)
    (a,) = store.dispatch([gid], policy_version=0)
    store.finish(a, FinishedGeneration(list(range(50)), [-0.5] * 50, 1.0, [(0, 50)]))
    return gid


@pytest.fixture
def pub(tmp_path):
    p = Publisher(tmp_path / "ckpt", retention=Retention(KeepNewestSnapshots(100)))
    yield p
    p.close()


def snap(pub: Publisher, store: Store, anchor: str = "bootstrap", **kw):
    return pub.publish_rollout_snapshot(anchor, lambda p: store.capture(p), CONFIG, **kw)


def test_a_snapshot_lands_in_the_documented_layout_with_every_file_in_its_manifest(pub, store):
    _work(store, 0)
    pub.publish_bootstrap(_weights)
    published = snap(pub, store, env_export=b'{"episodes": []}')
    root = pub.root
    assert published.path == root / "bootstrap" / "rollout_snapshots" / "snapshot_1"
    assert sorted(p.name for p in published.path.iterdir()) == sorted([SNAPSHOT_DB, CONFIG_FILE, ENV_EXPORT, "manifest.json"])
    m = json.loads((published.path / "manifest.json").read_text())
    assert m["format_version"] == 2 and m["hash"] == "blake3" and m["kind"] == "rollout_snapshot"
    assert (m["anchor"], m["sequence"]) == ("bootstrap", 1)
    assert m["config_fingerprint"] == hashlib.sha256(CONFIG.encode()).hexdigest()
    assert m["row_counts"]["prompt_groups"] == 1 and m["row_counts"]["samples"] == 1
    assert m["cut_time"] <= m["created_at"]
    for f in m["files"]:
        data = (published.path / f["path"]).read_bytes()
        assert (len(data), blake3.blake3(data).hexdigest()) == (f["size"], f["blake3"])
        assert set(f) == {"path", "size", "blake3"}
    assert {f["path"] for f in m["files"]} == {SNAPSHOT_DB, CONFIG_FILE, ENV_EXPORT}
    # The schema revision and mutation counter come from the file itself.
    with sqlite3.connect(published.path / SNAPSHOT_DB) as conn:
        assert m["schema_revision"] == conn.execute("SELECT version_num FROM alembic_version").fetchone()[0]
        assert m["mutation_counter"] == conn.execute("SELECT mutation_counter FROM run_meta").fetchone()[0]
    assert (published.path / CONFIG_FILE).read_text() == CONFIG


def test_a_trainer_checkpoint_manifest_covers_its_files_but_not_its_snapshots(pub, store):
    pub.publish_bootstrap()
    step = pub.publish_trainer_checkpoint(3, _weights)
    assert step.path == pub.root / "step_3"
    snap(pub, store, "step_3")
    m = read_manifest(step.path)
    assert (m.kind, m.anchor, m.step) == ("trainer_checkpoint", "step_3", 3)
    assert [f.path for f in m.files] == ["model.safetensors", "optimizer/state.bin"]
    assert verify_files(step.path, m, skip_dirs=("rollout_snapshots",)) == []


def test_no_temporary_directory_remains_after_a_publish_and_nothing_is_overwritten(pub, store):
    pub.publish_bootstrap()
    pub.publish_trainer_checkpoint(1, _weights)
    with pytest.raises(PublishError, match="already exists"):
        pub.publish_trainer_checkpoint(1, _weights)
    snap(pub, store, "step_1")
    names = [p.name for p in pub.root.rglob("*")]
    assert not [n for n in names if n.endswith((".tmp", ".trash"))]


def test_a_capture_made_first_is_published_later_while_the_store_keeps_changing(pub, store):
    pub.publish_bootstrap()
    _work(store, 0)
    stage = pub.begin_snapshot("bootstrap")
    capture = store.capture(stage.db_path)
    # The cut is over: the pumps write before any fsync of the snapshot happened.
    _work(store, 1)
    assert not stage.target.exists()
    published = stage.publish(capture, CONFIG)
    m = published.manifest
    assert m.mutation_counter == capture.mutation_counter < store.mutation_counter
    assert m.row_counts["prompt_groups"] == 1
    with sqlite3.connect(store.path) as conn:  # the live store has moved on
        assert conn.execute("SELECT count(*) FROM prompt_groups").fetchone()[0] == 2


def test_a_snapshot_needs_a_durable_anchor(pub, store):
    with pytest.raises(AnchorNotDurable, match="not a durable trainer checkpoint"):
        snap(pub, store, "step_4")
    (pub.root / "step_4").mkdir(parents=True)  # the trainer wrote it in place, no manifest yet
    (pub.root / "step_4" / "w.bin").write_bytes(b"123")
    with pytest.raises(AnchorNotDurable):
        snap(pub, store, "step_4")
    sealed = pub.seal_trainer_checkpoint(4)
    assert [f.path for f in sealed.manifest.files] == ["w.bin"]
    assert snap(pub, store, "step_4").anchor == "step_4"


def test_sequence_numbers_grow_across_anchors_and_are_never_reused_after_deletes_or_crashes(tmp_path, store):
    root = tmp_path / "ckpt"
    pub = Publisher(root, retention=Retention(KeepNewestSnapshots(1)))
    pub.publish_bootstrap()
    seqs = [snap(pub, store).sequence for _ in range(3)]
    pub.publish_trainer_checkpoint(1, _weights)
    seqs.append(snap(pub, store, "step_1").sequence)
    assert seqs == [1, 2, 3, 4]
    assert [s.sequence for s in scan(root).complete_snapshots()] == [4]
    # A crashed attempt (its temporary directory) and a fresh process.
    stage = pub.begin_snapshot("step_1")
    assert stage.sequence == 5
    fresh = Publisher(root, retention=Retention(KeepNewestSnapshots(1)))
    assert snap(fresh, store, "step_1").sequence == 6
    assert not stage.tmp.exists()  # the fresh process removed the leftover first


def test_listing_shows_only_manifested_directories_as_complete(pub, store):
    pub.publish_bootstrap()
    good = snap(pub, store)
    bare = good.path.with_name("snapshot_9")
    bare.mkdir()
    (bare / SNAPSHOT_DB).write_bytes((good.path / SNAPSHOT_DB).read_bytes())
    tmp = good.path.with_name(".snapshot_10.publish.1.tmp")
    tmp.mkdir()
    inv = scan(pub.root)
    assert [s.sequence for s in inv.complete_snapshots()] == [1]
    status = {s.sequence: s.status for s in inv.snapshots}
    assert status[9] == NO_MANIFEST and status[10] == TEMPORARY
    # The next save removes the temporary directory but never a damaged snapshot.
    snap(pub, store)
    assert not tmp.exists() and bare.exists()


# ---------------------------------------------------------------- retention


def _seqs(root: Path) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for s in scan(root).complete_snapshots():
        out.setdefault(s.anchor, []).append(s.sequence)
    return out


def test_retention_keeps_the_newest_k_snapshots(tmp_path, store):
    pub = Publisher(tmp_path / "ckpt", retention=Retention(KeepNewestSnapshots(2)))
    pub.publish_bootstrap()
    for _ in range(5):
        snap(pub, store)
    assert _seqs(pub.root) == {"bootstrap": [4, 5]}


def test_retention_keeps_the_newest_snapshot_of_every_kept_trainer_checkpoint(tmp_path, store):
    pub = Publisher(tmp_path / "ckpt", retention=Retention(KeepNewestSnapshots(1), KeepNewestSnapshotPerAnchor(1)))
    pub.publish_bootstrap()
    snap(pub, store)
    for step in (1, 2):
        pub.publish_trainer_checkpoint(step, _weights)
        snap(pub, store, f"step_{step}")
        snap(pub, store, f"step_{step}")
    assert _seqs(pub.root) == {"bootstrap": [1], "step_1": [3], "step_2": [5]}


def test_bootstrap_is_pruned_only_once_a_step_is_durable_and_has_a_snapshot(tmp_path, store):
    pub = Publisher(tmp_path / "ckpt", retention=Retention(KeepNewestSnapshots(3), PruneBootstrap()))
    pub.publish_bootstrap()
    snap(pub, store)
    pub.publish_trainer_checkpoint(1, _weights)
    # step_1 is durable, but the newest snapshot (the restore target) still needs bootstrap.
    assert (pub.root / "bootstrap").exists()
    result = snap(pub, store, "step_1")
    assert pub.root / "bootstrap" in result.retention.deleted
    assert not (pub.root / "bootstrap").exists()
    assert _seqs(pub.root) == {"step_1": [2]}


def test_retention_never_deletes_the_newest_complete_checkpoint(tmp_path, store):
    pub = Publisher(tmp_path / "ckpt", retention=Retention(KeepNewestSnapshots(0), KeepNewestTrainerCheckpoints(0), PruneBootstrap()))
    pub.publish_bootstrap()
    pub.publish_trainer_checkpoint(1, _weights)
    snap(pub, store, "step_1")
    snap(pub, store, "step_1")
    pub.publish_trainer_checkpoint(2, _weights)
    # Newest snapshot (seq 2) and its anchor step_1 stay; so does the newest step, step_2.
    assert _seqs(pub.root) == {"step_1": [2]}
    assert [a.anchor for a in scan(pub.root).complete_anchors()] == ["step_1", "step_2"]


def test_a_deleted_directory_goes_through_a_trash_name_that_is_never_listed(tmp_path, store):
    pub = Publisher(tmp_path / "ckpt", retention=Retention(KeepNewestSnapshots(5)))
    pub.publish_bootstrap()
    first = snap(pub, store)
    trash = first.path.with_name(f".{first.path.name}.123.trash")
    os.rename(first.path, trash)  # as a kill right after the rename leaves it
    assert scan(pub.root).complete_snapshots() == []
    assert select_for_restore(pub.root) is None  # trash is not a snapshot
    snap(pub, store)
    assert not trash.exists()


# ---------------------------------------------------------------- selection


def test_restore_selects_the_newest_complete_snapshot_whose_anchor_is_durable(pub, store):
    assert select_for_restore(pub.root) is None  # nothing yet: a fresh start is right
    pub.publish_bootstrap()
    snap(pub, store)
    pub.publish_trainer_checkpoint(1, _weights)
    newest = snap(pub, store, "step_1")
    chosen = select_for_restore(pub.root)
    assert chosen.snapshot.path == newest.path and chosen.step == 1
    # The anchor loses its manifest (the trainer is rewriting it): fall back to bootstrap's.
    (pub.root / "step_1" / "manifest.json").unlink()
    chosen = select_for_restore(pub.root)
    assert chosen.snapshot.anchor == "bootstrap"
    assert "step_1 is not a durable trainer checkpoint" in chosen.passed_over[0]


def test_restore_refuses_to_start_fresh_when_snapshots_exist_but_none_is_usable(pub, store):
    pub.publish_bootstrap()
    only = snap(pub, store)
    (only.path / SNAPSHOT_DB).write_bytes(b"SQLite format 3\x00" + b"\x00" * 4000)
    with pytest.raises(NoRestorableSnapshot, match="none can be restored.*snapshot_1.*fails verification.*Refusing to start fresh"):
        select_for_restore(pub.root)
    (pub.root / "bootstrap" / "manifest.json").unlink()
    with pytest.raises(NoRestorableSnapshot, match="bootstrap is not a durable trainer checkpoint"):
        select_for_restore(pub.root, verify=False)


# ---------------------------------------------------------------- manifest paths


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a/../../x", "a/./b", ""])
def test_a_manifest_path_that_could_leave_its_directory_is_refused(tmp_path, bad):
    with pytest.raises(ManifestError, match="refuses"):
        member_path(tmp_path, bad)


def test_a_manifest_path_through_a_symlink_outside_is_refused(tmp_path):
    (tmp_path / "inside").mkdir()
    (tmp_path / "outside.bin").write_bytes(b"x")
    (tmp_path / "inside" / "link").symlink_to(tmp_path / "outside.bin")
    with pytest.raises(ManifestError, match="resolves outside"):
        member_path(tmp_path / "inside", "link")


def _record_durability(monkeypatch) -> list[tuple]:
    """Every real fsync (by the path its descriptor names, and whether a manifest.json
    stood beside it then) and rename the process makes, in order: what reaches the
    disk, whichever helper or thread calls it."""
    events: list[tuple] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("fsync", path, os.path.exists(os.path.join(os.path.dirname(path), "manifest.json"))))
        return real_fsync(fd)

    def rename(src, dst, *a, **kw):
        events.append(("rename", str(src), str(dst)))
        return real_rename(src, dst, *a, **kw)

    def replace(src, dst, *a, **kw):
        events.append(("rename", str(src), str(dst)))
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_a_publish_makes_files_durable_before_the_manifest_and_the_rename_durable_last(pub, store, monkeypatch):
    """The commit protocol's order as the disk sees it: every payload file fsynced before
    the manifest exists, the manifest fsynced, the temporary directory fsynced, the
    rename, and the parent fsynced after the rename (without that fsync a power cut can
    undo the rename: the snapshot would vanish although publish returned)."""
    _work(store, 0)
    pub.publish_bootstrap(_weights)
    events = _record_durability(monkeypatch)
    published = snap(pub, store, env_export=b'{"episodes": []}')
    monkeypatch.undo()
    target = str(published.path)
    (rename_at,) = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == target]
    tmp = events[rename_at][1]
    fsynced = {e[1]: i for i, e in enumerate(events) if e[0] == "fsync"}  # the last fsync of each path
    for name in (SNAPSHOT_DB, CONFIG_FILE, ENV_EXPORT):
        payload = [e for e in events if e[0] == "fsync" and e[1] == f"{tmp}/{name}"]
        assert payload, f"{name} was never fsynced"
        assert not any(e[2] for e in payload), f"{name} was fsynced only after the manifest was written"
    manifest = f"{tmp}/manifest.json"
    assert fsynced[manifest] < fsynced[tmp] < rename_at, "the manifest and directory must be durable before the rename"
    parent = str(published.path.parent)
    assert fsynced.get(parent, -1) > rename_at, "the parent directory was not fsynced after the rename"


def test_a_snapshot_copy_is_checked_while_its_files_are_fsynced_and_the_manifest_waits_for_the_check(
        pub, store, monkeypatch):
    """The copy's check (CPU) runs beside the files' fsync and hash (disk): the check
    sees the store file fsynced before it returns, and nothing of the manifest exists
    until it has returned. Checked in sequence, the check would wait for an fsync that
    comes only after it (and fail here)."""
    import time

    from rolloutdb.store.checkpoints import publish as publish_module

    _work(store, 0)
    pub.publish_bootstrap(_weights)
    events = _record_durability(monkeypatch)
    real_check = publish_module.copy_problems
    seen = {}

    def slow_check(root, db_path):
        fsynced = False
        for _ in range(3000):  # up to 30 s: the fsync runs on the other thread meanwhile
            fsynced = any(e[0] == "fsync" and e[1] == str(db_path) for e in list(events))
            if fsynced:
                break
            time.sleep(0.01)
        seen["fsynced_during_check"] = fsynced
        seen["manifest_during_check"] = (Path(db_path).parent / "manifest.json").exists()
        problems = real_check(root, db_path)
        events.append(("check_done", str(db_path), False))
        return problems

    monkeypatch.setattr(publish_module, "copy_problems", slow_check)
    published = snap(pub, store)
    monkeypatch.undo()
    assert seen == {"fsynced_during_check": True, "manifest_during_check": False}
    (check_at,) = [i for i, e in enumerate(events) if e[0] == "check_done"]
    tmp = Path(events[check_at][1]).parent
    manifest_fsyncs = [i for i, e in enumerate(events) if e[0] == "fsync" and e[1] == f"{tmp}/manifest.json"]
    assert manifest_fsyncs and min(manifest_fsyncs) > check_at, "the manifest was written before the check ended"
    assert "check_copy" in published.timings and verify_files(published.path, read_manifest(published.path)) == []
