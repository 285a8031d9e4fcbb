"""Restore: real stores built through the Store API, real snapshots published through
store/checkpoints/publish.py, restored into a live path and read back through a second connection.

Every refusal is checked to leave the live store's bytes, the snapshot's bytes and the
live directory's listing exactly as they were.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rolloutdb.store import FinishedGeneration, Publisher, Reservation, SavedEpisode, Store, ledger, pools
from rolloutdb.store.errors import (
    NoRestorableSnapshot,
    PayloadInventoryMismatch,
    RestoreError,
    RunMismatch,
    SchemaTooNewError,
    SnapshotDamaged,
    SnapshotInconsistent,
    SnapshotTooNew,
)
from rolloutdb.store.live.invariants import check_invariants
from rolloutdb.store.checkpoints.manifest import describe_files, read_manifest
from rolloutdb.store.restore.apply import restore_snapshot
from rolloutdb.store.sqlite.revision import head_revision

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CFG, DATA, FOREST = "cfg-fingerprint", "data-fingerprint", {"enabled": False}
RUN = dict(config_fingerprint=CFG, dataset_fingerprint=DATA, forest_training=FOREST)


def gen(reward: float = 1.0) -> FinishedGeneration:
    return FinishedGeneration([1, 2, 3], [-0.1, -0.2, -0.3], reward, [(0, 3)])


def make_store(path: Path, *, ledger_dispatch: bool = True, capacity: int = 8) -> Store:
    return Store.create(path, config_fingerprint=CFG, dataset_fingerprint=DATA, forest_training=FOREST,
                        ledger_dispatch=ledger_dispatch, replay_capacity=capacity)


def reserve(store: Store, seq: int, step: int) -> int:
    return store.reserve([Reservation(seq, 0, 100 + seq)], num_generations=2, target_step=step)[0]


def publish_anchor(pub: Publisher, step: int | None) -> None:
    pub.publish_trainer_checkpoint(step, lambda d: (d / "weights.bin").write_bytes(f"w{step}".encode()))


def snapshot(pub: Publisher, store: Store, anchor: str) -> Path:
    return pub.publish_rollout_snapshot(anchor, lambda p: store.capture(p), config_text="algorithm: {}\n").path


def build_ledger_run(tmp_path: Path) -> SimpleNamespace:
    """groups_per_step 2, 2 generations. Step 1 trained (anchor step_1). At the cut:
    A published (step 2); B dispatched with gen 0 finished, gen 1 abandoned (deadline)
    then running again with a prefix chunk and an episode; C sealed; D reserved; E
    dispatched with both generations finished but not sealed; F discarded; spare 8, 9."""
    live = tmp_path / "run" / "rollout_state.sqlite"
    store = make_store(live)
    pub = Publisher(tmp_path / "ckpt")
    publish_anchor(pub, None)
    ids = {}
    for seq in (0, 1):
        g = ids[f"t{seq}"] = reserve(store, seq, 1)
        for a in store.dispatch([g], policy_version=0):
            store.finish(a, gen(float(a)))
        store.seal([g])
        store.enter_replay([g])
    store.mark_trained([ids["t0"], ids["t1"]], step=1)
    publish_anchor(pub, 1)
    A, B, C, D, E, F = (reserve(store, seq, step) for seq, step in ((2, 2), (3, 2), (4, 3), (5, 3), (6, 3), (7, 2)))
    for g in (A, C, E):
        for a in store.dispatch([g], policy_version=1):
            store.finish(a, gen(float(a)))
    store.seal([A, C])
    store.enter_replay([A])
    b0, b1 = store.dispatch([B], policy_version=1)
    store.finish(b0, gen())
    store.abandon([b1], "deadline")
    with store.atomic() as tx:
        (b1_retry,) = ledger.start_attempts(tx, [(B, 1)], policy_version=1)
        pools.add_chunk(tx, b1_retry, [7, 8], prefix_count=0, max_tokens=8, min_tokens=0, policy_version=1)
        pools.put_episode(tx, b1_retry, turn=1, state={"turn": 1})
    store.dispatch([F], policy_version=1)
    store.discard([F], reason="zero_reward_variance")
    with store.atomic() as tx:
        pools.push_spare(tx, [Reservation(8, 0, 108), Reservation(9, 0, 109)])
        pools.advance_cursor(tx, 10, 0)
    assert store.check_invariants().ok
    snap = snapshot(pub, store, "step_1")
    # The live store moves on after the cut; the restore must bring back the cut.
    store.mark_trained([A], step=2)
    store.discard([D], reason="later")
    store.close()
    return SimpleNamespace(live=live, snap=snap, ckpt=tmp_path / "ckpt", pub=pub, A=A, B=B, C=C, D=D, E=E, F=F,
                           b1_retry=b1_retry, t0=ids["t0"])


def restore(snap: Path, live: Path, **kw):
    args = {**RUN, "groups_per_step": 2, **kw}
    return restore_snapshot(snap, live, **args)


def tree_digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_refused_and_unchanged(run: SimpleNamespace, error: type, match: str, **kw) -> Exception:
    live_before = tree_digest(run.live.parent)
    snap_before = tree_digest(run.snap)
    with pytest.raises(error, match=match) as info:
        restore(run.snap, run.live, **kw)
    assert tree_digest(run.live.parent) == live_before  # no temp copy left, live bytes equal
    assert tree_digest(run.snap) == snap_before
    assert len(str(info.value).splitlines()) == 1
    return info.value


def rewrite_snapshot(snap: Path, sql: str) -> None:
    """Change the snapshot's store file and re-seal its manifest, as a snapshot written
    that way would have been published."""
    db = snap / "rollout_state.sqlite"
    with sqlite3.connect(db) as conn:
        conn.executescript(sql)
    conn.close()
    manifest = read_manifest(snap)
    manifest.files = describe_files(snap)
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        manifest.schema_revision = conn.execute("SELECT version_num FROM alembic_version").fetchone()[0]
    conn.close()
    (snap / "manifest.json").write_bytes(manifest.to_json())


# --------------------------------------------------------------------------- ledger restore


def test_restart_normalization_leaves_running_attempts_publishes_sealed_and_hands_back_the_rest(
    tmp_path, second_connection
):
    run = build_ledger_run(tmp_path)
    plan = restore(run.snap, run.live)

    assert (plan.anchor, plan.sequence, plan.trained_step, plan.ledger_dispatch) == ("step_1", 1, 1, True)
    assert plan.cut_time == read_manifest(run.snap).cut_time
    assert [(g.group_id, g.generations_to_run, g.was_reserved) for g in plan.redispatch] == [
        (run.B, (1,), False), (run.D, (0, 1), True)]
    assert [(g.group_id, g.generations_to_run) for g in plan.to_finalize] == [(run.E, ())]
    d = plan.redispatch[1]
    assert (d.sample_seq, d.epoch, d.prompt_id, d.target_step, d.num_generations) == (5, 0, 105, 3, 2)
    assert d.reservation == Reservation(5, 0, 105)
    assert plan.counts == {"replay_groups": 1, "reserved_to_dispatched": 1, "published_at_restore": 1,
                           "generations_to_run": 3, "payload_rows_cleared": 0, "spare_prompts": 2}
    ((key, chunks),) = plan.saved_prefixes.items()
    assert key == (run.B, 1) and [c.token_ids for c in chunks] == [[7, 8]] and chunks[0].max_tokens == 8
    assert plan.saved_episodes == {(run.B, 1): SavedEpisode(f"{run.B}.1-a1", 1, 1, {"turn": 1}, None, None, None)}
    assert {"checksums", "schema", "integrity", "run_meta", "replay", "ledger", "spare_and_cursor", "replace"} <= set(plan.timings)

    conn = second_connection(run.live)
    states = dict(conn.execute("SELECT group_id, state FROM prompt_groups"))
    assert [states[g] for g in (run.A, run.B, run.C, run.D, run.E)] == [
        "published", "dispatched", "published", "dispatched", "dispatched"]  # the cut, not the live store
    # Settled groups are a record (v1_5_a): t0, t1 (positions 0, 1) trained at 1 make step
    # 1's row; F (7) discarded joins it, the row extending over 2..6 (open: live) to 7.
    # Blob by hand: varints (gap 2, 5 open, code 0), (gap 0, 1 position, code 1).
    assert run.F not in states and run.t0 not in states
    assert conn.execute("SELECT * FROM settled_steps").fetchall() == [(0, 8, 1, 1, bytes([2, 5, 0, 0, 1, 1]))]
    assert conn.execute("SELECT * FROM discard_reasons").fetchall() == [(1, "zero_reward_variance")]
    # The running attempt, its chunk and its episode stay until the pump restarts B
    # (ledger.restart_attempts, tested below).
    assert conn.execute("SELECT attempt_id FROM rollouts WHERE state = 'running'").fetchall() == [(run.b1_retry,)]
    assert conn.execute("SELECT attempt_id FROM token_chunks").fetchall() == [(run.b1_retry,)]
    assert conn.execute("SELECT attempt_id FROM env_episodes").fetchall() == [(run.b1_retry,)]
    assert sorted(conn.execute("SELECT group_id FROM replay_groups").fetchall()) == [(run.A,), (run.C,)]
    assert conn.execute("SELECT count(*) FROM rollouts WHERE group_id = ?", (run.D,)).fetchone()[0] == 0
    assert conn.execute("SELECT policy_version FROM prompt_groups WHERE group_id = ?", (run.D,)).fetchone()[0] == 1
    assert conn.execute("SELECT count(*) FROM spare_prompts").fetchone()[0] == 2
    assert conn.execute("SELECT next_seq FROM sampler_state").fetchone()[0] == 10
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert check_invariants(conn).ok


def test_the_restored_groups_can_be_restarted_through_the_ledger(tmp_path, second_connection):
    run = build_ledger_run(tmp_path)
    plan = restore(run.snap, run.live)
    with Store.open(run.live) as store, store.atomic() as tx:
        wanted = [(g.group_id, i) for g in plan.redispatch for i in g.generations_to_run]
        new, left = ledger.restart_attempts(tx, wanted, policy_version=plan.trained_step)
        attempts = dict(tx.exec_driver_sql(
            f"SELECT attempt_id, attempt FROM rollouts WHERE attempt_id IN ({','.join(map(str, new))})").all())
    assert [attempts[a] for a in new] == [2, 0, 0]  # B gen 1: third attempt; D: first ones
    assert left == [(run.B, 1, 1, 1)]  # (group, generation, attempt, version): B gen 1's second attempt, the one running at the cut
    conn = second_connection(run.live)
    assert conn.execute("SELECT state, abandon_reason FROM rollouts WHERE attempt_id = ?", (run.b1_retry,)).fetchone() == (
        "abandoned", "restart")
    assert conn.execute("SELECT count(*) FROM token_chunks").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM env_episodes").fetchone()[0] == 0
    assert check_invariants(conn).ok


def test_the_snapshot_directory_is_never_modified(tmp_path):
    run = build_ledger_run(tmp_path)
    before = tree_digest(run.snap)
    restore(run.snap, run.live)
    assert tree_digest(run.snap) == before
    assert sorted(p.name for p in run.snap.iterdir()) == ["config.yaml", "manifest.json", "rollout_state.sqlite"]


def test_a_stale_wal_of_the_live_store_is_never_applied_to_the_restored_file(tmp_path, second_connection):
    run = build_ledger_run(tmp_path)
    # A killed process leaves a WAL holding commits made after the cut.
    code = (
        "import os, signal, sys\n"
        "from rolloutdb.store import Store\n"
        "s = Store.open(sys.argv[1])\n"
        f"s.discard([{run.C}], reason='after_cut')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(run.live)], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert Path(f"{run.live}-wal").stat().st_size > 0
    restore(run.snap, run.live)
    assert not Path(f"{run.live}-wal").exists()
    conn = second_connection(run.live)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert conn.execute("SELECT state FROM prompt_groups WHERE group_id = ?", (run.C,)).fetchone()[0] == "published"


# --------------------------------------------------------------------------- refusals


def test_a_snapshot_of_a_newer_revision_is_refused_with_what_to_do(tmp_path):
    run = build_ledger_run(tmp_path)
    rewrite_snapshot(run.snap, "UPDATE alembic_version SET version_num = 'v9_9_z';")
    err = assert_refused_and_unchanged(run, SnapshotTooNew, "upgrade rolloutdb")
    assert isinstance(err, SchemaTooNewError) and "v9_9_z" in str(err)


@pytest.mark.parametrize("name", ["rollout_state.sqlite", "config.yaml"])
def test_a_file_that_fails_its_checksum_is_refused_by_name(tmp_path, name):
    run = build_ledger_run(tmp_path)
    target = run.snap / name
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x40
    target.write_bytes(bytes(data))
    err = assert_refused_and_unchanged(run, SnapshotDamaged, f"{name}: blake3 differs")
    assert err.path == target


def test_a_file_added_to_a_snapshot_after_publication_is_refused(tmp_path):
    run = build_ledger_run(tmp_path)
    (run.snap / "extra.bin").write_bytes(b"x")
    assert_refused_and_unchanged(run, SnapshotDamaged, "extra.bin: not listed in the manifest")


def test_a_different_config_fingerprint_is_refused_naming_what_to_do(tmp_path):
    run = build_ledger_run(tmp_path)
    err = assert_refused_and_unchanged(run, RunMismatch, "resume with the config the run was started with",
                                       config_fingerprint="another-config")
    assert err.fields == ["config_fingerprint"]


def test_different_forest_training_settings_are_refused(tmp_path):
    run = build_ledger_run(tmp_path)
    err = assert_refused_and_unchanged(run, RunMismatch, "forest-training settings",
                                       forest_training={"enabled": True, "branches": 4})
    assert err.fields == ["forest_training"]


def test_every_difference_is_named_at_once(tmp_path):
    run = build_ledger_run(tmp_path)
    err = assert_refused_and_unchanged(run, RunMismatch, "dataset fingerprint", dataset_fingerprint="other-data",
                                       ledger_dispatch=False)
    assert err.fields == ["dataset_fingerprint", "ledger_dispatch"]


def test_a_payload_row_no_ledger_row_references_is_refused_before_normalization(tmp_path):
    run = build_ledger_run(tmp_path)
    rewrite_snapshot(run.snap, "INSERT INTO env_episodes (episode_key, attempt_id, turn, state, updated_at) "
                               "SELECT 'orphan', attempt_id, 1, '{}', 0.0 FROM rollouts WHERE state = 'finished' LIMIT 1;")
    err = assert_refused_and_unchanged(run, PayloadInventoryMismatch, "invariant 3")
    assert err.invariant == 3 and "episode orphan" in str(err)


def test_a_replay_row_of_a_sealed_group_is_refused_before_normalization_puts_that_group_into_replay(tmp_path):
    # Normalization moves sealed groups into replay: a replay row already naming one is
    # refused by the audit before it (invariant 2), not left to fail inside it.
    run = build_ledger_run(tmp_path)
    rewrite_snapshot(run.snap, "INSERT INTO replay_groups (group_id, permit, epoch, prompt_id, target_step, num_tokens, "
                               f"published_at) VALUES ({run.C}, 5, 0, 104, 3, 6, 0.0);")
    err = assert_refused_and_unchanged(run, SnapshotInconsistent, "before restart normalization: invariant 2")
    assert err.invariant == 2 and f"group {run.C} is sealed" in str(err)


def test_a_prompt_both_settled_and_spare_is_refused_by_the_audit_after_normalization(tmp_path):
    # The audit before normalization checks only what normalization could erase or trip
    # over (invariants 2 and 3); the prompts and positions are audited once, after it.
    run = build_ledger_run(tmp_path)
    rewrite_snapshot(run.snap, "UPDATE spare_prompts SET prompt_id = 100 WHERE sample_seq = 8;")  # t0's, trained
    err = assert_refused_and_unchanged(run, SnapshotInconsistent, "after restart normalization: invariant 1")
    assert err.invariant == 1 and "epoch 0 prompt 100" in str(err)


def test_restoring_a_snapshot_over_other_weights_is_refused(tmp_path):
    run = build_ledger_run(tmp_path)
    assert_refused_and_unchanged(run, RestoreError, "anchored to step_1 but the trainer loaded step 2", trainer_step=2)


def test_a_snapshot_that_saw_training_beyond_its_anchor_is_refused(tmp_path):
    run = build_ledger_run(tmp_path)
    with Store.open(run.live) as store:  # the live store trained A at step 2 after the first cut
        run.snap = snapshot(run.pub, store, "step_1")
    err = assert_refused_and_unchanged(run, SnapshotInconsistent, "1 group\\(s\\) trained after step 1")
    assert err.invariant == 1


# --------------------------------------------------------------------------- old revisions


@pytest.mark.parametrize("revision", ["v1_0_a", "v1_6_a"])  # the first and the last with finalizer_results rows
def test_an_old_revision_snapshot_is_restored_by_upgrading_a_copy(tmp_path, second_connection, revision):
    fixture = FIXTURES / f"store_{revision}.sqlite"
    pub = Publisher(tmp_path / "ckpt")
    publish_anchor(pub, 5)
    snap = pub.publish_rollout_snapshot("step_5", lambda p: shutil.copyfile(fixture, p)).path
    assert read_manifest(snap).schema_revision == revision
    with sqlite3.connect(f"file:{fixture}?mode=ro", uri=True) as conn:
        cfg, data, forest = conn.execute("SELECT config_fingerprint, dataset_fingerprint, forest_training FROM run_meta").fetchone()
        groups = {s: n for s, n in conn.execute("SELECT state, count(*) FROM prompt_groups GROUP BY state")}
        running = conn.execute("SELECT count(*) FROM rollouts WHERE state = 'running'").fetchone()[0]
        assert conn.execute("SELECT count(*) FROM finalizer_results").fetchone()[0] > 0  # v1_7_a drops them
    conn.close()
    before = tree_digest(snap)
    live = tmp_path / "run" / "rollout_state.sqlite"
    live.parent.mkdir()

    plan = restore_snapshot(snap, live, config_fingerprint=cfg, dataset_fingerprint=data,
                            forest_training=json.loads(forest), groups_per_step=4)

    assert (plan.schema_revision, plan.upgraded_from, plan.trained_step) == (revision, revision, 5)
    assert plan.counts["generations_to_run"] >= running  # each running attempt's generation starts again
    assert plan.counts["published_at_restore"] == groups["sealed"]
    assert len(plan.redispatch) + len(plan.to_finalize) == groups["dispatched"] + groups["reserved"]
    assert [g.sample_seq for g in plan.redispatch] == sorted(g.sample_seq for g in plan.redispatch)
    assert tree_digest(snap) == before
    conn = second_connection(live)
    assert conn.execute("SELECT version_num FROM alembic_version").fetchone()[0] == head_revision()
    assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'finalizer_results'").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM replay_groups").fetchone()[0] == groups["published"] + groups["sealed"]
    assert conn.execute("SELECT count(*) FROM samples WHERE version_token_counts IS NULL").fetchone()[0] == 0
    assert check_invariants(conn).ok
    Store.open(live).close()


# --------------------------------------------------------------------------- no ledger


def test_without_the_ledger_in_flight_groups_are_dropped_and_each_steps_shortfall_recomputed(tmp_path, second_connection):
    live = tmp_path / "run" / "rollout_state.sqlite"
    store = make_store(live, ledger_dispatch=False, capacity=16)
    pub = Publisher(tmp_path / "ckpt")
    publish_anchor(pub, None)

    def sampled(tx, g, step, n=2, replay=True):
        ledger.write_samples(tx, [(g, i, 100 + g, gen(float(i))) for i in range(n)])
        if replay:
            ledger.insert_replay(tx, [(g, 0, 100 + g, step, 3 * n)])

    with store.atomic() as tx:
        pools.advance_cursor(tx, 12, 0)
        pools.push_spare(tx, [Reservation(10, 0, 110), Reservation(11, 0, 111)])
        for g in (1, 2, 3):
            sampled(tx, g, 1)
        ledger.release_replay(tx, [1, 2, 3])  # step 1 trained
    publish_anchor(pub, 1)
    with store.atomic() as tx:
        sampled(tx, 4, 2)
        sampled(tx, 5, 2)
        sampled(tx, 6, 2, n=1, replay=False)  # in flight: one of two generations done
        sampled(tx, 7, 3)
        sampled(tx, 8, 3, n=1, replay=False)
        pools.set_shortfall(tx, 3, 1)
        pools.set_shortfall(tx, 4, 3)  # stamped, nothing started
    snap = snapshot(pub, store, "step_1")
    store.close()

    plan = restore_snapshot(snap, live, **RUN, groups_per_step=3)

    assert plan.ledger_dispatch is False and plan.redispatch == [] and plan.to_finalize == []
    assert plan.shortfall == {2: 1, 3: 2, 4: 3}
    assert plan.counts["payload_rows_cleared"] == 2 and plan.counts["spare_prompts"] == 2
    conn = second_connection(live)
    assert dict(conn.execute("SELECT step, needed FROM step_shortfall")) == {2: 1, 3: 2, 4: 3}
    assert sorted(r[0] for r in conn.execute("SELECT DISTINCT group_id FROM samples")) == [4, 5, 7]
    assert sorted(r[0] for r in conn.execute("SELECT group_id FROM replay_groups")) == [4, 5, 7]
    assert conn.execute("SELECT next_seq FROM sampler_state").fetchone()[0] == 12


# --------------------------------------------------------------------------- choosing a snapshot


def test_latest_falls_back_to_an_older_snapshot_when_the_newest_is_damaged(tmp_path, second_connection):
    from rolloutdb.store.restore.choice import select_and_restore

    run = build_ledger_run(tmp_path)
    with Store.open(run.live) as store:
        newer = snapshot(run.pub, store, "step_1")  # the live state after the first cut
    (newer / "config.yaml").write_bytes(b"changed\n")
    seen = []
    plan = select_and_restore(run.ckpt, run.live, before_restore=lambda sel: seen.append(sel.snapshot.sequence),
                              **RUN, groups_per_step=2)
    assert (plan.sequence, seen) == (1, [2, 1])
    assert "snapshot_2" in plan.passed_over[0] and "config.yaml" in plan.passed_over[0]
    conn = second_connection(run.live)
    assert conn.execute("SELECT state FROM prompt_groups WHERE group_id = ?", (run.A,)).fetchone()[0] == "published"


def test_a_named_snapshot_is_restored_even_when_newer_ones_exist(tmp_path):
    from rolloutdb.store.restore.choice import select_and_restore

    run = build_ledger_run(tmp_path)
    with Store.open(run.live) as store:
        snapshot(run.pub, store, "step_1")
    plan = select_and_restore(run.ckpt, run.live, resume=run.snap, **RUN, groups_per_step=2)
    assert plan.sequence == 1 and plan.snapshot_dir == run.snap


def test_snapshots_that_all_fail_are_refused_never_a_silent_fresh_start(tmp_path):
    from rolloutdb.store.restore.choice import select_and_restore

    run = build_ledger_run(tmp_path)
    (run.snap / "config.yaml").write_bytes(b"changed\n")
    before = tree_digest(run.live.parent)
    with pytest.raises(NoRestorableSnapshot, match="Refusing to start fresh"):
        select_and_restore(run.ckpt, run.live, **RUN, groups_per_step=2)
    assert tree_digest(run.live.parent) == before


def test_a_durable_trainer_checkpoint_without_snapshots_is_reported_to_the_caller(tmp_path):
    from rolloutdb.store.errors import NothingToRestore, TrainerCheckpointOnly
    from rolloutdb.store.restore.choice import choose_snapshot

    with pytest.raises(NothingToRestore):
        choose_snapshot(tmp_path / "ckpt")
    pub = Publisher(tmp_path / "ckpt")
    publish_anchor(pub, None)
    publish_anchor(pub, 3)
    with pytest.raises(TrainerCheckpointOnly, match="rolls the live store back to step 3") as info:
        choose_snapshot(tmp_path / "ckpt")
    assert info.value.step == 3 and info.value.path == tmp_path / "ckpt" / "step_3"


# --------------------------------------------------------------------------- verify a run


def build_run_dir(tmp_path: Path, *, groups_per_step: int = 2, extra=None) -> Path:
    """Steps 1 and 2 trained with two groups each; position 3 discarded and replaced by
    position 4; position 5 in the spare pool; cursor 6. `extra(store)` runs last."""
    run_dir = tmp_path / "run"
    store = make_store(run_dir / "rollout_state.sqlite")
    plan = {0: 1, 1: 1, 2: 2, 3: 2, 4: 2}
    gids = {seq: reserve(store, seq, step) for seq, step in plan.items()}
    for seq, g in gids.items():
        for a in store.dispatch([g], policy_version=0):
            store.finish(a, gen(float(a)))
    store.discard([gids[3]], reason="zero_reward_variance")
    kept = [gids[s] for s in (0, 1, 2, 4)]
    store.seal(kept)
    store.enter_replay(kept)
    store.mark_trained(kept[:2], step=1)
    store.mark_trained(kept[2:], step=2)
    with store.atomic() as tx:
        pools.push_spare(tx, [Reservation(5, 0, 105)])
        pools.advance_cursor(tx, 6, 0)
    if extra is not None:
        extra(store)
    store.close()
    (run_dir / "config.yaml").write_text(f"algorithm:\n  groups_per_step: {groups_per_step}\n")
    return run_dir


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutdb", *args], capture_output=True, text=True, timeout=120)


def test_verify_run_counts_a_clean_history_and_the_cli_prints_it(tmp_path):
    from rolloutdb.controller.recovery.run_audit import verify_run

    run_dir = build_run_dir(tmp_path)
    before = tree_digest(run_dir)
    verdict = verify_run(run_dir)
    assert verdict.ok, verdict.problems
    assert verdict.line() == "trained=4 discarded=1 duplicated=0 lost=0"
    assert (verdict.pending, verdict.spare, verdict.steps, verdict.cursor) == (0, 1, 2, 6)
    proc = run_cli("verify", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "trained=4 discarded=1 duplicated=0 lost=0"
    assert tree_digest(run_dir) == before  # read-only: no -wal/-shm, same bytes


def test_verify_run_counts_a_prompt_handed_out_twice_as_duplicated(tmp_path):
    from rolloutdb.controller.recovery.run_audit import verify_run

    def hand_out_again(store):
        with store.atomic() as tx:  # position 6 is the prompt of position 0 again
            pools.push_spare(tx, [Reservation(6, 0, 100)])
            pools.advance_cursor(tx, 7, 0)

    run_dir = build_run_dir(tmp_path, extra=hand_out_again)
    verdict = verify_run(run_dir)
    assert not verdict.ok
    assert verdict.line() == "trained=4 discarded=1 duplicated=1 lost=0"
    assert any("epoch 0 prompt 100 x2" in p for p in verdict.problems)
    proc = run_cli("verify", str(run_dir))
    assert proc.returncode == 1
    assert "duplicated=1" in proc.stdout and all(l.startswith("error:") for l in proc.stderr.splitlines())


def test_verify_run_counts_a_prompt_handed_out_twice_while_in_flight_as_duplicated(tmp_path):
    from rolloutdb.controller.recovery.run_audit import verify_run

    def hand_out_again(store):  # position 6 is the prompt of position 5 (in the spare pool)
        store.reserve([Reservation(6, 0, 105)], num_generations=2, target_step=3)
        with store.atomic() as tx:
            pools.advance_cursor(tx, 7, 0)

    run_dir = build_run_dir(tmp_path, extra=hand_out_again)
    verdict = verify_run(run_dir)
    assert not verdict.ok
    assert verdict.line() == "trained=4 discarded=1 duplicated=1 lost=0"
    assert any("epoch 0 prompt 105 x2" in p for p in verdict.problems)


def test_verify_run_counts_positions_nobody_holds_as_lost(tmp_path):
    from rolloutdb.controller.recovery.run_audit import verify_run

    def skip_two(store):
        with store.atomic() as tx:
            pools.advance_cursor(tx, 8, 0)

    verdict = verify_run(build_run_dir(tmp_path, extra=skip_two))
    assert verdict.line() == "trained=4 discarded=1 duplicated=0 lost=2"
    assert any("below the cursor 8" in p and "6, 7" in p for p in verdict.problems)


def test_verify_run_checks_every_step_trained_groups_per_step_groups(tmp_path):
    from rolloutdb.controller.recovery.run_audit import verify_run

    verdict = verify_run(build_run_dir(tmp_path, groups_per_step=3))
    assert (verdict.duplicated, verdict.lost) == (0, 0) and not verdict.ok
    assert any("groups_per_step=3" in p and "step 1: 2" in p and "step 2: 2" in p for p in verdict.problems)


def test_verify_run_after_a_restore_sees_the_whole_history(tmp_path):
    from rolloutdb.controller.recovery.run_audit import verify_run

    run = build_ledger_run(tmp_path)
    restore(run.snap, run.live)
    (run.live.parent / "config.yaml").write_text("algorithm:\n  groups_per_step: 2\n")
    verdict = verify_run(run.live.parent)
    assert verdict.ok, verdict.problems
    assert verdict.line() == "trained=2 discarded=1 duplicated=0 lost=0"
    assert verdict.pending == 5 and any("neither trained nor discarded" in n for n in verdict.notes)


def test_verify_run_without_a_config_is_refused_with_what_is_missing(tmp_path):
    from rolloutdb.store.errors import NotAStoreError
    from rolloutdb.controller.recovery.run_audit import verify_run

    run_dir = build_run_dir(tmp_path)
    (run_dir / "config.yaml").unlink()
    with pytest.raises(NotAStoreError, match="config.yaml: missing"):
        verify_run(run_dir)


def test_a_damaged_store_file_resealed_with_matching_checksums_fails_integrity(tmp_path):
    run = build_ledger_run(tmp_path)
    db = run.snap / "rollout_state.sqlite"
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    for offset in range(2 * page, len(data), page):  # b-tree page headers past the schema page
        data[offset: offset + 8] = b"\xee" * 8
    db.write_bytes(bytes(data))
    manifest = read_manifest(run.snap)
    manifest.files = describe_files(run.snap)
    (run.snap / "manifest.json").write_bytes(manifest.to_json())
    assert_refused_and_unchanged(run, SnapshotDamaged, "integrity_check failed|unreadable|malformed")


@pytest.mark.parametrize("op", ["write", "rename"])
def test_a_failing_disk_is_one_typed_error_and_leaves_no_copy_behind(tmp_path, op):
    from rolloutdb.store import faults

    run = build_ledger_run(tmp_path)
    live_bytes = run.live.read_bytes()
    with faults.inject_io(op, errno.ENOSPC, match="rollout_state.sqlite"):
        with pytest.raises(RestoreError, match=r"ENOSPC.*the live store was not replaced"):
            restore(run.snap, run.live)
    assert run.live.read_bytes() == live_bytes
    assert sorted(p.name for p in run.live.parent.iterdir()) == ["rollout_state.sqlite"]
    restore(run.snap, run.live)  # the next try succeeds
