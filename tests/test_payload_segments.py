"""Payload written once (W2-G items 2 and 4): immutable payload segments shared by the
snapshots that reference them, verified with each snapshot, kept while anything
references them, and referenced (not copied) by a restore.

Real store files, real segment files, real publication; persisted state is read back
through second connections and compared with payload computed here by hand.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rolloutdb.store import (
    FinishedGeneration,
    Publisher,
    Reservation,
    Retention,
    Store,
    faults,
    open_readonly,
    queries,
    seal_inline_payload,
    segments_dir_of,
    verify_path,
)
from rolloutdb.store.checkpoints.retention import KeepNewestSnapshots, PruneBootstrap
from rolloutdb.store.errors import ReadOnlyViolation, SnapshotDamaged
from rolloutdb.store.live.payload import SegmentMissing
from rolloutdb.store.restore.apply import restore_snapshot

HERE = Path(__file__).resolve().parent
CHILD = HERE / "segment_child.py"
CFG, DATA, FOREST = "cfg", "data", {}
RUN = dict(config_fingerprint=CFG, dataset_fingerprint=DATA, forest_training=FOREST)


def tokens_of(group: int, i: int, n: int) -> list[int]:
    return [(group * 7919 + i * 104729 + k) % 50000 for k in range(n)]


def logprobs_of(group: int, i: int, n: int) -> list[float]:
    return [-((group + i + k) % 97) / 64.0 for k in range(n)]  # exact in float32


class Run:
    """A live store and its checkpoint directory, wired as the snapshot pump wires them."""

    def __init__(self, root: Path, *, keep: int = 3, live_refs: bool = True):
        self.root = root
        self.live = root / "run" / "rollout_state.sqlite"
        self.live.parent.mkdir(parents=True)
        self.ckpt = root / "run" / "checkpoints"
        self.store = Store.create(self.live, replay_capacity=4096, **RUN)
        self.store.segments_dir = segments_dir_of(self.ckpt)
        self.pub = Publisher(self.ckpt, retention=Retention(KeepNewestSnapshots(keep), PruneBootstrap()),
                             live_references=self.store.segment_references if live_refs else None)
        self.pub.publish_bootstrap(lambda d: (d / "weights.bin").write_bytes(b"w" * 64))
        self.seq = 0
        self.groups: list[int] = []

    def finish_groups(self, count: int, tokens: int, gens: int = 2) -> list[int]:
        """`count` groups finished, sealed and in replay, each sample `tokens` long."""
        made = []
        for _ in range(count):
            (g,) = self.store.reserve([Reservation(self.seq, 0, self.seq)], num_generations=gens, target_step=1)
            self.seq += 1
            for i, a in enumerate(self.store.dispatch([g], policy_version=0)):
                self.store.finish(a, FinishedGeneration(tokens_of(g, i, tokens), logprobs_of(g, i, tokens), 1.0,
                                                        [(0, tokens)]))
            self.store.seal([g])
            self.store.enter_replay([g])
            made.append(g)
        self.groups += made
        return made

    def snapshot(self, *, seal: bool = True):
        with self.pub.lock:
            sealed = seal_inline_payload(self.store, self.ckpt) if seal else None
            published = self.pub.publish_rollout_snapshot("bootstrap", lambda p: self.store.capture(p), "a: 1\n")
        return sealed, published

    def close(self) -> None:
        self.pub.close()
        self.store.close()


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.close()


def expected_rows(groups: list[int], tokens: int, gens: int = 2) -> list[tuple]:
    """The payload each group's samples must read back as, computed here."""
    return [(g, i, np.asarray(tokens_of(g, i, tokens), "<i4").tobytes(),
             np.asarray(logprobs_of(g, i, tokens), "<f4").tobytes()) for g in groups for i in range(gens)]


def read_payload(store: Store, groups: list[int]) -> list[tuple]:
    return [(g, i, tok, lp) for g, i, _pid, tok, lp, _r, _v in store.samples_of(groups)]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- sealing


def test_a_sealed_sample_reads_back_its_exact_payload_from_the_segment_and_holds_none_inline(run, second_connection):
    groups = run.finish_groups(3, tokens=50)
    sealed, published = run.snapshot()
    assert sealed.rows == sealed.pointed == 6
    conn = second_connection(run.live)
    inline = conn.execute("SELECT count(*) FROM samples WHERE token_ids IS NOT NULL OR logprobs IS NOT NULL").fetchone()
    refs = conn.execute("SELECT DISTINCT p.file_name FROM samples s JOIN payload_segments p USING (segment_id)").fetchall()
    assert inline == (0,) and refs == [(sealed.file_name,)]
    seg = sqlite3.connect(f"file:{sealed.path}?mode=ro", uri=True)
    assert seg.execute("SELECT count(*), sum(length(token_ids)) FROM payload").fetchone() == (6, 6 * 50 * 4)
    seg.close()
    assert read_payload(run.store, groups) == expected_rows(groups, 50)
    # The snapshot's own file holds the references and no payload.
    snap_db = sqlite3.connect(f"file:{published.path / 'rollout_state.sqlite'}?mode=ro", uri=True)
    assert snap_db.execute("SELECT count(*), count(token_ids), count(segment_id) FROM samples").fetchone() == (6, 0, 6)
    snap_db.close()


def _bytes_written_by_this_process() -> int:
    """write()/pwrite() bytes so far (`wchar`): the WAL's frames, the segment, the vacuum."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io (Linux)")
def test_sealing_writes_the_payload_once_and_does_not_write_it_again_as_zeros(run):
    """Debian's SQLite zeroes every freed page (SQLITE_SECURE_DELETE): pointing the samples
    at their segment then wrote the whole payload a second time, as zeros, into the WAL
    (2.6x the payload beside the segment when measured; the store turns it off: 0.6x, the
    pointer-map, freelist and vacuum pages)."""
    run.finish_groups(32, tokens=8192)  # 4 MiB of payload inline
    with run.store.read() as conn:
        assert conn.exec_driver_sql("PRAGMA secure_delete").scalar_one() == 0
    run.store.db.checkpoint("TRUNCATE")  # nothing older left for the checkpointer to copy meanwhile
    before = _bytes_written_by_this_process()
    with run.pub.lock:
        sealed = seal_inline_payload(run.store, run.ckpt)
    beside_the_segment = _bytes_written_by_this_process() - before - sealed.bytes
    assert sealed.rows == 64
    assert beside_the_segment < sealed.bytes, (beside_the_segment, sealed.bytes)


def test_inline_and_sealed_samples_are_read_together_through_the_one_reader(run):
    old = run.finish_groups(2, tokens=10)
    run.snapshot()
    new = run.finish_groups(2, tokens=10)  # inline until the next snapshot
    with run.store.read() as conn:
        rows = queries.samples_of(conn, old + new, run.store.segments_dir)
    assert [(g, i, tok, lp) for g, i, _p, tok, lp, _r, _v in rows] == expected_rows(old + new, 10)


def test_a_published_segment_cannot_be_written_through_the_read_only_open(run):
    run.finish_groups(1, tokens=10)
    sealed, _ = run.snapshot()
    before = sha(sealed.path)
    conn = open_readonly(sealed.path)
    with pytest.raises((ReadOnlyViolation, sqlite3.DatabaseError)):
        conn.execute("UPDATE payload SET token_ids = x'00'")
    conn.close()
    run.finish_groups(2, tokens=10)
    run.snapshot()
    run.store.samples_of(run.groups)
    assert sha(sealed.path) == before


# --------------------------------------------------------------------------- bytes written


def test_a_snapshot_writes_only_the_payload_that_finished_since_the_last_one(run):
    # 64 groups x 2 x 8192 tokens x 8 bytes = 8 MiB in flight, sealed and published by snapshot 1.
    run.finish_groups(64, tokens=8192)
    run.snapshot()
    seg_dir = segments_dir_of(run.ckpt)
    before = {p.name for p in seg_dir.iterdir()}
    # New payload by hand: 4 groups x 2 samples x 1000 tokens x (4 + 4) bytes.
    run.finish_groups(4, tokens=1000)
    new_payload = 4 * 2 * 1000 * 8
    sealed, published = run.snapshot()
    new_segments = [p for p in seg_dir.iterdir() if p.name not in before]
    assert [p.name for p in new_segments] == [sealed.file_name]
    seg_bytes = new_segments[0].stat().st_size
    snap_bytes = sum(p.stat().st_size for p in published.path.rglob("*") if p.is_file())
    # The segment: the payload plus SQLite's pages (<= 10% + 64 KiB). The snapshot
    # directory: the store file of 68 groups' rows and references (~40 pages of rows,
    # indexes and the schema's ~30 tables and indexes at 4 KiB each: ~300 KiB), its
    # config and manifest; bound 512 KiB, a sixteenth of the 8 MiB in flight.
    assert seg_bytes <= 1.1 * new_payload + 65536
    assert snap_bytes <= 512 * 1024, snap_bytes
    assert seg_bytes + snap_bytes <= 2 * new_payload + 512 * 1024


# --------------------------------------------------------------------------- verify


def test_a_snapshot_lists_its_segments_with_their_checksums_and_verifies_on_its_own(run):
    run.finish_groups(2, tokens=20)
    s1, _ = run.snapshot()
    run.finish_groups(2, tokens=20)
    s2, p2 = run.snapshot()
    manifest = json.loads((p2.path / "manifest.json").read_text())
    import blake3

    listed = {e["path"]: (e["size"], e["blake3"]) for e in manifest["segments"]}
    assert listed == {s.file_name: (s.path.stat().st_size, blake3.blake3(s.path.read_bytes()).hexdigest())
                      for s in (s1, s2)}
    assert verify_path(p2.path).ok and verify_path(run.ckpt).ok


def test_a_flipped_byte_in_a_segment_fails_verify_and_restore_naming_the_segment(run, tmp_path):
    run.finish_groups(2, tokens=20)
    sealed, published = run.snapshot()
    data = bytearray(sealed.path.read_bytes())
    data[-100] ^= 0x01
    sealed.path.write_bytes(bytes(data))
    report = verify_path(published.path)
    assert not report.ok
    assert any(sealed.file_name in p and "differs" in p for p in report.problems), report.problems
    target = tmp_path / "elsewhere" / "rollout_state.sqlite"
    target.parent.mkdir()
    with pytest.raises(SnapshotDamaged, match=sealed.file_name):
        restore_snapshot(published.path, target, groups_per_step=1, **RUN)
    assert not target.exists()


def test_a_missing_segment_fails_verify_naming_it(run):
    run.finish_groups(1, tokens=20)
    sealed, published = run.snapshot()
    sealed.path.unlink()
    problems = verify_path(published.path).problems
    assert any(sealed.file_name in p and "missing" in p for p in problems), problems


# --------------------------------------------------------------------------- retention


def test_retention_keeps_a_segment_only_the_live_store_references(tmp_path):
    r = Run(tmp_path, keep=1)
    try:
        first = r.finish_groups(2, tokens=30)
        r.snapshot()
        # Sealed by an attempt that never published (its cut was aborted): only the live
        # store references this segment.
        more = r.finish_groups(2, tokens=30)
        with r.pub.lock:
            orphan = seal_inline_payload(r.store, r.ckpt)
        # A trainer checkpoint's publication runs retention.
        r.pub.publish_trainer_checkpoint(1, lambda d: (d / "weights.bin").write_bytes(b"w"))
        assert read_payload(r.store, first + more) == expected_rows(first + more, 30)
        assert orphan.path.is_file()
    finally:
        r.close()


def test_retention_removes_a_segment_once_no_kept_snapshot_and_not_the_live_store_reference_it(tmp_path):
    r = Run(tmp_path, keep=1)
    try:
        old = r.finish_groups(2, tokens=30)
        s1, _ = r.snapshot()
        r.store.mark_trained(old, step=1)  # their samples leave the live store
        r.finish_groups(1, tokens=30)
        s2, p2 = r.snapshot()  # snapshot 1 goes (keep 1): nothing references s1 now
        assert not s1.path.exists() and s2.path.is_file()
        assert sorted(p.name for p in segments_dir_of(r.ckpt).iterdir()) == [s2.file_name]
        assert verify_path(r.ckpt).ok
    finally:
        r.close()


def test_a_publisher_that_cannot_ask_the_live_store_removes_no_segment(tmp_path):
    r = Run(tmp_path, keep=1, live_refs=False)
    try:
        old = r.finish_groups(2, tokens=30)
        s1, _ = r.snapshot()
        r.store.mark_trained(old, step=1)
        r.finish_groups(1, tokens=30)
        r.snapshot()
        assert s1.path.is_file()
    finally:
        r.close()


# --------------------------------------------------------------------------- restore


def test_a_restore_references_the_segments_in_place_and_a_resumed_read_gives_the_same_tokens(run, tmp_path,
                                                                                               second_connection):
    groups = run.finish_groups(3, tokens=50_000)  # 3 x 2 x 50k tokens x 8 bytes: 2.4 MB of payload
    conn = second_connection(run.live)  # the payload as the run wrote it, before it was sealed
    before = conn.execute("SELECT group_id, generation_index, token_ids, logprobs FROM samples "
                          "ORDER BY group_id, generation_index").fetchall()
    conn.close()
    sealed, published = run.snapshot()
    seg_dir = segments_dir_of(run.ckpt)
    listing = {p.name: sha(p) for p in seg_dir.iterdir()}
    run.close()
    run.live.unlink()
    plan = restore_snapshot(published.path, run.live, groups_per_step=1, **RUN)
    # Restore copied only the small store file: the live directory holds no segment,
    # and the segments are the same files, byte for byte.
    assert sorted(p.name for p in run.live.parent.iterdir()) == ["checkpoints", "rollout_state.sqlite"]
    assert {p.name: sha(p) for p in seg_dir.iterdir()} == listing
    assert run.live.stat().st_size < 3 * 2 * 50_000 * 8 / 4
    assert plan.counts["replay_groups"] == 3
    with Store.open(run.live) as store:
        store.segments_dir = seg_dir
        assert read_payload(store, groups) == [tuple(r) for r in before]
        with pytest.raises(SegmentMissing, match="no segments directory"):
            Store.open(run.live).samples_of(groups)
    run.store = Store.open(run.live)  # for the fixture's close


def test_a_snapshot_from_before_segments_still_restores_and_verifies_with_its_payload_inline(run, tmp_path):
    groups = run.finish_groups(2, tokens=25)
    _, published = run.snapshot(seal=False)  # what a rolloutdb before v1_6_a published
    manifest = json.loads((published.path / "manifest.json").read_text())
    assert "segments" not in manifest
    assert verify_path(published.path).ok
    target = tmp_path / "other" / "rollout_state.sqlite"
    target.parent.mkdir()
    restore_snapshot(published.path, target, groups_per_step=1, **RUN)
    with Store.open(target) as store:  # no segments directory needed: all inline
        assert read_payload(store, groups) == expected_rows(groups, 25)


# --------------------------------------------------------------------------- crashes


def run_child(workdir: Path, *, fault: str | None = None, iterations: int = 8, kill_after_s: float | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if k != faults.ENV}
    if fault:
        env[faults.ENV] = fault
    proc = subprocess.Popen([sys.executable, str(CHILD), str(workdir), "--iterations", str(iterations)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if kill_after_s is not None:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(kill_after_s)
            proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, -signal.SIGKILL), err
    return proc.returncode


def check_after_kill(workdir: Path) -> None:
    """No dangling reference: every segment the live store references is on disk and
    gives every referenced sample's payload; every complete snapshot verifies with its
    segments; after one more save nothing unreferenced or half-made is left."""
    live, ckpt = workdir / "live.sqlite", workdir / "ckpt"
    seg_dir = segments_dir_of(ckpt)
    with contextlib.closing(sqlite3.connect(live)) as conn:  # a second connection; recovers the WAL
        refs = conn.execute("SELECT p.file_name, s.sample_id FROM samples s JOIN payload_segments p "
                            "USING (segment_id)").fetchall()
    for name, sample_id in refs:
        assert (seg_dir / name).is_file(), f"dangling reference: sample {sample_id} -> {name}"
        with contextlib.closing(sqlite3.connect(f"file:{seg_dir / name}?mode=ro", uri=True)) as seg:
            assert seg.execute("SELECT count(*) FROM payload WHERE sample_id = ?", (sample_id,)).fetchone() == (1,)
    report = verify_path(ckpt)
    assert report.ok, report.problems
    assert run_child(workdir, iterations=1) == 0  # the next save cleans up
    with contextlib.closing(sqlite3.connect(live)) as conn:
        live_refs = {r[0] for r in conn.execute(
            "SELECT DISTINCT p.file_name FROM samples s JOIN payload_segments p USING (segment_id)")}
    listed = set()
    for m in ckpt.rglob("manifest.json"):
        listed |= {e["path"] for e in json.loads(m.read_text()).get("segments", [])}
    on_disk = {p.name for p in seg_dir.iterdir()}
    assert on_disk == live_refs | listed, (on_disk, live_refs, listed)


@pytest.mark.parametrize("point", faults.SEGMENT_POINTS)
def test_a_child_killed_at_each_segment_point_leaves_no_dangling_reference_and_the_next_save_cleans_up(tmp_path, point):
    assert run_child(tmp_path, fault=f"{point}@3") == -signal.SIGKILL, f"the child never reached {point}"
    check_after_kill(tmp_path)


@pytest.mark.parametrize("seed", range(2))
def test_a_child_killed_at_a_random_moment_leaves_no_dangling_reference(tmp_path, seed):
    import random

    delay = random.Random(seed).uniform(0.2, 1.5)
    run_child(tmp_path, iterations=10_000, kill_after_s=delay)
    check_after_kill(tmp_path)


def test_an_upgraded_store_keeps_its_payload_inline_until_its_next_snapshot_seals_it(tmp_path, second_connection):
    import shutil

    from rolloutdb.store import upgrade_file
    from rolloutdb.store.sqlite.revision import head_revision

    fixture = HERE / "fixtures" / "store_v1_4_a.sqlite"
    live = tmp_path / "run" / "rollout_state.sqlite"
    live.parent.mkdir()
    shutil.copyfile(fixture, live)
    assert upgrade_file(live)[1] == head_revision()  # v1_6_a or later
    old = second_connection(fixture)
    expected = old.execute("SELECT group_id, generation_index, token_ids, logprobs FROM samples "
                           "ORDER BY group_id, generation_index").fetchall()
    assert expected
    ckpt = tmp_path / "run" / "checkpoints"
    with Store.open(live) as store:
        store.segments_dir = segments_dir_of(ckpt)
        assert store.segment_references() == set()  # nothing sealed yet
        sealed = seal_inline_payload(store, ckpt)
        assert sealed.rows == len(expected)
        groups = sorted({g for g, *_ in expected})
        assert read_payload(store, groups) == [tuple(r) for r in expected]
    conn = second_connection(live)
    assert conn.execute("SELECT count(token_ids), count(segment_id) FROM samples").fetchone() == (0, len(expected))


# --------------------------------------------------------------------------- the snapshot pump


@pytest.fixture
def pump(tmp_path):
    """A snapshot pump on real parts (a store with one finished sample, a publisher with
    bootstrap published); its thread is started by the test when it wants the loop."""
    import threading

    from rolloutdb.controller.recovery.env_checkpoint import NoEnvironmentCheckpoint
    from rolloutdb.controller.run.runtime import Progress, RolloutParts, RuntimeState
    from rolloutdb.controller.recovery.snapshot_pump import SnapshotPump

    store = Store.create(tmp_path / "rollout_state.sqlite", replay_capacity=8)
    (g,) = store.reserve([Reservation(0, 0, 0)], num_generations=1, target_step=1)
    (a,) = store.dispatch([g], policy_version=0)
    store.finish(a, FinishedGeneration(tokens_of(g, 0, 300), logprobs_of(g, 0, 300), 1.0, [(0, 300)]))
    publisher = Publisher(tmp_path / "checkpoints", retention=Retention(KeepNewestSnapshots(100)))
    publisher.publish_bootstrap(lambda d: (d / "weights.bin").write_bytes(b"w"))
    runtime = RuntimeState()
    parts = RolloutParts(config=None, store=store, order=None, bound=None, engine=None, env=None, trainer=None,
                         dispatcher=None, runtime=runtime, read_progress=lambda: Progress(0, 0),
                         log_event=lambda e: None)
    snapshotter = SnapshotPump(parts, publisher, interval_s=60.0, config_text="a: 1\n",
                               env_checkpoint=NoEnvironmentCheckpoint())
    thread = threading.Thread(target=snapshotter.run, name="snapshot-pump", daemon=True)
    yield snapshotter, store, g, thread
    runtime.stop.set()
    snapshotter.wake()
    if thread.is_alive():
        thread.join(20)
    publisher.close()
    store.close()


def _snapshot_payload(tmp_path: Path, seq: int) -> tuple[int, int]:
    db = tmp_path / "checkpoints" / "bootstrap" / "rollout_snapshots" / f"snapshot_{seq}" / "rollout_state.sqlite"
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return conn.execute("SELECT count(token_ids), count(segment_id) FROM samples").fetchone()


def test_the_snapshot_pump_seals_the_payload_before_its_cut_so_its_snapshot_holds_only_references(pump, tmp_path):
    snapshotter, store, g, _thread = pump
    result = snapshotter.attempt()
    assert result.outcome == "published" and "seal" in result.timings
    assert _snapshot_payload(tmp_path, result.sequence) == (0, 1)
    manifest = json.loads((tmp_path / "checkpoints" / "bootstrap" / "rollout_snapshots" / f"snapshot_{result.sequence}"
                           / "manifest.json").read_text())
    assert [e["path"] for e in manifest["segments"]] == list(store.segment_references())
    assert read_payload(store, [g]) == expected_rows([g], 300, gens=1)


def test_a_cut_the_train_pump_waits_for_never_waits_for_a_seal_and_the_pump_seals_right_after(pump, tmp_path):
    snapshotter, store, g, thread = pump
    thread.start()
    assert snapshotter.anchor_new_checkpoint(0, timeout=120) is True
    deadline = time.monotonic() + 120
    while not (snapshotter.results and store.segment_references()):  # sealed by the loop after the attempt
        assert time.monotonic() < deadline, "the pump never sealed the payload after the attempt"
        time.sleep(0.02)
    # The waited-for cut copied the payload inline (it finished since the last seal).
    first = snapshotter.results[0]
    assert first.outcome == "published", first.error
    assert "seal" not in first.timings
    assert _snapshot_payload(tmp_path, first.sequence) == (1, 0)
    assert read_payload(store, [g]) == expected_rows([g], 300, gens=1)


def test_duckdb_reads_a_segment_in_place_with_the_same_payload_bytes(run, tmp_path):
    from rolloutdb.store.trace.analysis import connect_duckdb

    groups = run.finish_groups(2, tokens=64)
    sealed, _ = run.snapshot()
    before = sha(sealed.path)
    con = connect_duckdb(tmp_path / "duck")
    try:
        rows = con.execute(f"SELECT sample_id, token_ids, logprobs FROM sqlite_scan('{sealed.path}', 'payload') "
                           "ORDER BY sample_id").fetchall()
    finally:
        con.close()
    assert [(bytes(t), bytes(lp)) for _sid, t, lp in rows] == [(t, lp) for _g, _i, t, lp in expected_rows(groups, 64)]
    assert sha(sealed.path) == before


def test_a_segment_only_a_snapshot_being_published_references_is_kept_until_it_is_published(tmp_path):
    r = Run(tmp_path, keep=1)
    try:
        groups = r.finish_groups(2, tokens=30)
        r.pub.publish_trainer_checkpoint(1, lambda d: (d / "weights.bin").write_bytes(b"w"))
        with r.pub.lock:
            sealed = seal_inline_payload(r.store, r.ckpt)
            stage = r.pub.begin_snapshot("step_1")
            capture = r.store.capture(stage.db_path)
            r.store.mark_trained(groups, step=1)  # the live store references it no more
            r.pub.publish_trainer_checkpoint(2, lambda d: (d / "weights.bin").write_bytes(b"w"))  # retention runs
            assert sealed.path.is_file()
            published = stage.publish(capture, "a: 1\n")
        assert [e.path for e in published.manifest.segments] == [sealed.file_name]
        assert verify_path(published.path).ok
    finally:
        r.close()


def test_verify_of_a_run_directory_reads_every_segment_its_live_store_references(run):
    """`rolloutdb verify RUN_DIR` checks the live store's segments too (not only a
    snapshot's): a byte flipped in one after the run is named, with exit 1."""
    run.finish_groups(2, tokens=20)
    sealed, _ = run.snapshot()
    run.close()
    run_dir = run.live.parent
    (run_dir / "config.yaml").write_text("algorithm:\n  groups_per_step: 2\n")

    def verify() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(run_dir)], capture_output=True,
                              text=True, timeout=120)

    intact = verify()
    assert intact.returncode == 0 and sealed.file_name not in intact.stdout + intact.stderr, intact.stderr
    data = bytearray(sealed.path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    sealed.path.chmod(0o644)
    sealed.path.write_bytes(bytes(data))
    damaged = verify()
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    assert sealed.file_name in damaged.stderr and "blake3 differs from" in damaged.stderr, damaged.stderr
    assert "payload_segments" in damaged.stderr, damaged.stderr  # who recorded the checksum: the store


def test_a_sample_trained_while_a_seal_runs_never_lends_its_id_to_a_newer_sample_the_seal_then_points(run,
                                                                                                    second_connection):
    """Sealing reads the inline payload, writes the segment (seconds for a big one), then
    points the ids it read at it. The newest group trained in between (its samples
    deleted) and a new sample finished: the new one must not take a read id (AUTOINCREMENT)
    and so keep its own payload inline, not be pointed at the trained one's."""
    from rolloutdb.store.live.payload import inline_payloads, point_at_segment, record_segment

    groups = run.finish_groups(2, tokens=8)
    with run.store.read() as conn:
        read_ids = [r[0] for r in inline_payloads(conn)]
    run.store.mark_trained([groups[-1]], step=1)  # the newest samples leave
    (newer,) = run.finish_groups(1, tokens=5)
    with run.store.atomic() as tx:
        record_segment(tx, 1, "segment_1.sqlite", "0" * 64, 0, len(read_ids))
        point_at_segment(tx, 1, read_ids)
    conn = second_connection(run.live)
    rows = conn.execute("SELECT sample_id, segment_id, length(token_ids) FROM samples WHERE group_id = ? "
                        "ORDER BY generation_index", (newer,)).fetchall()
    assert [r[1:] for r in rows] == [(None, 5 * 4), (None, 5 * 4)], rows  # inline, its own 5 int32 tokens
    assert not {r[0] for r in rows} & set(read_ids), (rows, read_ids)
