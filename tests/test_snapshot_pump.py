"""The snapshot pump on real parts: a real store, a real Publisher on a real checkpoint
directory, the pump on its own thread. Slowness comes from an environment checkpoint
whose drain takes a set time (a slowed callable, not a mock of the store)."""

from __future__ import annotations

import contextlib
import errno
import json
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from conftest import copying_clone
from rolloutdb.controller.recovery.env_checkpoint import NoEnvironmentCheckpoint
from rolloutdb.controller.run.run_log import MetricsLog, read_metrics
from rolloutdb.controller.run.runtime import Progress, RolloutParts, RuntimeState
from rolloutdb.controller.recovery.snapshot_pump import SnapshotPump
from rolloutdb.controller.training.checkpoints import TrainerCheckpoints
from rolloutdb.config import config_from_dict
from rolloutdb.store import (
    FinishedGeneration,
    KeepNewestSnapshots,
    Publisher,
    Reservation,
    Retention,
    Store,
    faults,
)
from rolloutdb.store.checkpoints.layout import SNAPSHOT_DB
from rolloutdb.store.live.capture import capture_snapshot
from rolloutdb.store.restore.verification import verify_snapshot_dir

DEADLINE_S = 20


class SlowDrain(NoEnvironmentCheckpoint):
    """An environment whose drain takes `seconds`; `draining` is set when it starts."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.draining = threading.Event()

    def drain(self) -> None:
        self.draining.set()
        time.sleep(self.seconds)


class Weights:
    """The trainer's side of a trainer checkpoint: writes a file into the directory."""

    def save_checkpoint(self, path: Path) -> None:
        (path / "weights.bin").write_bytes(b"w" * 64)


@pytest.fixture
def pump(tmp_path):
    """(snapshotter, publisher, store, metrics path, pump thread), the bootstrap published
    and the pump running; stopped and closed afterwards."""
    made = []

    def make(drain_s: float, env=None):
        store = Store.create(tmp_path / "rollout_state.sqlite", replay_capacity=8)
        store.reserve([Reservation(0, 0, 0)], num_generations=1, target_step=1)  # something to snapshot
        publisher = Publisher(tmp_path / "checkpoints", retention=Retention(KeepNewestSnapshots(100)))
        publisher.publish_bootstrap(Weights().save_checkpoint)
        metrics = MetricsLog(tmp_path / "metrics.jsonl")
        runtime = RuntimeState()
        # The pieces the snapshot pump never touches are left out (None).
        parts = RolloutParts(config=None, store=store, order=None, bound=None, engine=None, env=None, trainer=None,
                             dispatcher=None, runtime=runtime, read_progress=lambda: Progress(0, 0),
                             log_event=metrics.write)
        env = SlowDrain(drain_s) if env is None else env
        snapshotter = SnapshotPump(parts, publisher, interval_s=60.0, config_text="a: 1\n", env_checkpoint=env)
        thread = threading.Thread(target=snapshotter.run, name="snapshot-pump", daemon=True)
        thread.start()
        made.append((runtime, snapshotter, thread, metrics, publisher, store))
        return snapshotter, publisher, store, env, tmp_path / "metrics.jsonl"

    yield make
    for runtime, snapshotter, thread, metrics, publisher, store in made:
        runtime.stop.set()
        snapshotter.wake()
        thread.join(DEADLINE_S)
        metrics.close()
        publisher.close()
        store.close()


def _outcomes(store_path: Path) -> list[str]:
    with sqlite3.connect(store_path) as conn:
        return [r[0] for r in conn.execute("SELECT outcome FROM snapshot_attempts ORDER BY attempt_seq")]


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_timed_out_wait_for_the_cut_is_logged_and_training_goes_on(pump, tmp_path):
    snapshotter, _publisher, _store, env, metrics = pump(drain_s=1.5)
    t0 = time.monotonic()
    cut = snapshotter.anchor_new_checkpoint(0, timeout=0.3)
    waited = time.monotonic() - t0
    assert cut is False
    assert waited < 1.2, f"the train pump waited {waited:.2f} s, past its timeout, for a slow attempt"
    events = read_metrics(metrics, "snapshot_wait")
    assert [(e["outcome"], e["step"], e["anchor"]) for e in events] == [("timed_out", 0, "bootstrap")]
    assert events[0]["waited_s"] == pytest.approx(0.3)
    # The slow attempt itself still finishes and publishes: the timeout gave up the wait, not the snapshot.
    _wait_for(lambda: "published" in _outcomes(tmp_path / "rollout_state.sqlite"), "the slow attempt's outcome")
    assert (tmp_path / "checkpoints" / "bootstrap" / "rollout_snapshots" / "snapshot_1" / "manifest.json").is_file()


def test_a_wait_that_sees_its_cut_in_time_logs_no_timeout(pump):
    snapshotter, _publisher, _store, _env, metrics = pump(drain_s=0.0)
    assert snapshotter.anchor_new_checkpoint(0, timeout=DEADLINE_S) is True
    assert read_metrics(metrics, "snapshot_wait") == []


def test_a_trainer_checkpoint_waits_for_the_snapshot_attempt_in_progress(pump, tmp_path):
    """One save lock (the Publisher's) serializes saves: a trainer checkpoint asked for
    while a snapshot attempt is under way is published only after that attempt has
    published, so no save or retention runs between the attempt's staging and its end."""
    snapshotter, publisher, _store, env, _metrics = pump(drain_s=0.8)
    checkpoints = TrainerCheckpoints(config_from_dict({"checkpointing": {"interval_steps": 1}}), Weights(), publisher)
    snapshotter.wake(force=True)
    assert env.draining.wait(DEADLINE_S)
    assert checkpoints.maybe_publish(1) is True
    snapshot_manifest = tmp_path / "checkpoints" / "bootstrap" / "rollout_snapshots" / "snapshot_1" / "manifest.json"
    assert snapshot_manifest.is_file(), "the trainer checkpoint was published inside the snapshot attempt"
    assert (tmp_path / "checkpoints" / "step_1" / "manifest.json").is_file()


def test_each_pump_attempt_leaves_exactly_one_outcome_row_matching_its_metrics_line(pump, tmp_path):
    """Mixed outcomes: published, skipped_unchanged, skipped_commit, failed (a real
    injected fsync error while publishing), published again. The store holds one row per
    attempt, in order, and each row says what the attempt's metrics line says (the pump
    records both from one result; the Publisher records nothing)."""
    snapshotter, _publisher, store, _env, metrics = pump(drain_s=0.0)
    results = [snapshotter.attempt()]  # the reservation above: something changed
    results.append(snapshotter.attempt())  # nothing changed since
    with snapshotter.p.runtime.commit_lock:  # an optimizer commit in progress
        results.append(snapshotter.attempt())
    store.reserve([Reservation(1, 0, 1)], num_generations=1, target_step=1)
    with faults.inject_io("fsync", errno.EIO, match=SNAPSHOT_DB) as fault:
        results.append(snapshotter.attempt())
    assert fault.fired == 1
    results.append(snapshotter.attempt())
    assert [r.outcome for r in results] == ["published", "skipped_unchanged", "skipped_commit", "failed", "published"]

    with contextlib.closing(sqlite3.connect(f"file:{store.path}?mode=ro", uri=True)) as conn:
        rows = conn.execute("SELECT outcome, anchor, snapshot_seq, error, mutation_counter FROM snapshot_attempts "
                            "ORDER BY attempt_seq").fetchall()
    lines = read_metrics(metrics, "snapshot")
    assert [(e["outcome"], e["anchor"], e["sequence"], e["error"]) for e in lines] == [row[:4] for row in rows]
    assert [row[:3] for row in rows] == [
        ("published", "bootstrap", 1), ("skipped_unchanged", None, None), ("skipped_commit", None, None),
        ("failed", "bootstrap", 2), ("published", "bootstrap", 3),
    ]
    assert "EIO" in rows[3][3] and "PublishError" in rows[3][3]
    # A published row carries the mutation counter its snapshot was cut at (its manifest's).
    for row, line in zip(rows, lines):
        if row[0] == "published":
            manifest = json.loads((tmp_path / "checkpoints" / "bootstrap" / "rollout_snapshots" / f"snapshot_{row[2]}"
                                   / "manifest.json").read_text())
            assert row[4] == line["mutation_counter"] == manifest["mutation_counter"]


def test_a_disk_failure_creating_the_snapshot_directory_is_a_failed_attempt_and_training_goes_on(pump, tmp_path):
    """The first half of publication (the temporary directory) failing is an outcome like
    a failed publish: a `failed` row naming the error, the pump alive, the next attempt
    publishes. Before, the error escaped the attempt and ended the whole run."""
    snapshotter, _publisher, store, _env, metrics = pump(drain_s=0.0)
    with faults.inject_io("mkdir", errno.ENOSPC) as fault:
        failed = snapshotter.attempt()
    assert fault.fired == 1
    assert failed.outcome == "failed" and "ENOSPC" in failed.error and "PublishError" in failed.error
    assert not snapshotter.p.runtime.stop.is_set()
    assert snapshotter.attempt(force=True).outcome == "published"
    with contextlib.closing(sqlite3.connect(f"file:{store.path}?mode=ro", uri=True)) as conn:
        rows = conn.execute("SELECT outcome, anchor FROM snapshot_attempts ORDER BY attempt_seq").fetchall()
    assert rows == [("failed", "bootstrap"), ("published", "bootstrap")]
    snapshots = tmp_path / "checkpoints" / "bootstrap" / "rollout_snapshots"
    assert sorted(p.name for p in snapshots.iterdir()) == ["snapshot_2"]  # no temporary directory left behind


class ExportThenSettle(NoEnvironmentCheckpoint):
    """An agent server's side of the cut: it exports `keys`; then (`settle`) the group
    finishes and the train pump discards it, after the export and before the cut."""

    holds_rollout_state = True

    def __init__(self, store: Store, keys: list[str], settle: list[int]):
        self.store, self.keys, self.settle = store, keys, settle

    def export(self) -> dict[str, dict]:
        out = {k: {"turn": 1, "state": "waiting"} for k in self.keys}
        if self.settle:
            self.store.discard(self.settle, reason="zero_reward_variance")
            self.settle = []
        return out

    def expected_keys(self) -> list[str]:
        return []


def test_an_exported_episode_whose_group_settled_before_the_cut_is_dropped_and_an_unknown_one_refused(pump, tmp_path):
    """The group leaves the live store in the commit that settles it (compaction), so at
    the cut its key has no ledger row: it is a finished episode (dropped, the snapshot
    published), not an unknown one. A key of a group id never handed out is still refused."""
    env = ExportThenSettle(None, [], [])
    snapshotter, _publisher, store, _env, _metrics = pump(drain_s=0.0, env=env)
    (g,) = store.reserve([Reservation(1, 0, 1)], num_generations=1, target_step=1)
    (a,) = store.dispatch([g], policy_version=0)
    store.finish(a, FinishedGeneration([1, 2], [-0.1, -0.2], 1.0, [(0, 2)]))
    env.store, env.keys, env.settle = store, [f"{g}.0-a0"], [g]
    result = snapshotter.attempt(force=True)
    assert (result.outcome, result.error) == ("published", None)
    with contextlib.closing(sqlite3.connect(f"file:{store.path}?mode=ro", uri=True)) as conn:
        assert conn.execute("SELECT count(*) FROM prompt_groups WHERE group_id = ?", (g,)).fetchone() == (0,)
    snapshot = tmp_path / "checkpoints" / "bootstrap" / "rollout_snapshots" / f"snapshot_{result.sequence}" / SNAPSHOT_DB
    with contextlib.closing(sqlite3.connect(f"file:{snapshot}?mode=ro", uri=True)) as conn:
        assert conn.execute("SELECT count(*) FROM env_episodes").fetchone() == (0,)  # the settled one was dropped

    (live,) = store.reserve([Reservation(2, 0, 2)], num_generations=1, target_step=1)  # something changed
    env.keys = [f"{g}.0-a0", f"{live}.0-a0", f"{live + 1}.0-a0"]  # settled, live without the attempt, never handed out
    refused = snapshotter.attempt(force=True)
    assert refused.outcome == "failed"
    assert f"2 unknown or retired episodes ({live}.0-a0, {live + 1}.0-a0)" in refused.error
    assert "ExportMismatch" in refused.error


def test_each_cut_clones_the_newest_published_snapshot_and_its_metrics_line_counts_the_blocks_written(pump, tmp_path):
    """The pump hands each cut the newest published snapshot as its base. ext4 cannot
    clone, so the capture here clones by copying the base's bytes (tests/test_incremental_capture.py
    runs the real FICLONE where it can); the published snapshot passes the copy's check
    and verifies like one written whole."""
    snapshotter, publisher, store, _env, metrics = pump(drain_s=0.0)
    bases = []

    def capture(dst, *, at_cut=None, into_copy=None, base=None):
        bases.append(base)
        return capture_snapshot(store.path, dst, at_cut=at_cut, into_copy=into_copy, base=base, clone=copying_clone)

    store.capture = capture
    first = snapshotter.attempt()
    store.reserve([Reservation(1, 0, 1)], num_generations=1, target_step=1)
    second = snapshotter.attempt()
    assert [first.outcome, second.outcome] == ["published", "published"]
    snaps = tmp_path / "checkpoints" / "bootstrap" / "rollout_snapshots"
    assert bases == [None, snaps / f"snapshot_{first.sequence}" / SNAPSHOT_DB]
    lines = read_metrics(metrics, "snapshot")
    assert "cut_blocks_written" not in lines[0]["timings"]
    written, blocks = lines[1]["timings"]["cut_blocks_written"], lines[1]["timings"]["cut_blocks"]
    assert 0 < written < blocks
    report = verify_snapshot_dir(snaps / f"snapshot_{second.sequence}")
    assert report.ok, report.problems
