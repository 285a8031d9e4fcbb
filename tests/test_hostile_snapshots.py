"""Hostile input, forged snapshots that pass every checksum: `verify` checks what it
promises, a restore refuses what `verify` refuses, and publication checks its own copy.

Each snapshot here is a real one (a real store, real segments, real publication),
forged afterwards and republished as a snapshot written that way would have been (its
manifest's checksums recomputed over the forged bytes, `reseal`):

* a store file that points samples at the wrong (listed, sound) payload segment;
* a segment file, or `payload_segments/` itself, that is a symlink out of the
  checkpoint directory (with the very bytes the manifest lists);
* the settled record (`settled_steps`, `discard_reasons`, `settled_prompts`) holding a
  value of another SQLite type than the one the decoder reads, a 200 KB varint, or an
  integer of 5000 digits;
* a copy that breaks an invariant or names the wrong segment *before* it is published:
  the attempt fails, nothing is published, the previous snapshot stands.

Helpers: tests/hostile.py (one `error:` line, no backstop, nothing changed on disk).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from hostile import assert_refused, run_cli, unchanged
from rolloutdb.store import (
    FinishedGeneration,
    Publisher,
    PublishError,
    Reservation,
    Retention,
    Store,
    scan,
    seal_inline_payload,
    segments_dir_of,
    verify_path,
)
from rolloutdb.store.checkpoints.manifest import describe_files, read_manifest
from rolloutdb.store.checkpoints.retention import KeepNewestSnapshots
from rolloutdb.store.errors import SnapshotDamaged
from rolloutdb.store.restore.apply import restore_snapshot

RUN = dict(config_fingerprint="cfg", dataset_fingerprint="data", forest_training={})
ANCHOR = "step_1"  # the snapshots' anchor: groups were trained at step 1


# ----------------------------------------------------------------------------- a real run's snapshots


class Run:
    """A live store and its checkpoint directory wired as the snapshot pump wires them:
    groups trained and discarded (a settled record), payload sealed into two segments."""

    def __init__(self, root: Path):
        self.live = root / "run" / "rollout_state.sqlite"
        self.live.parent.mkdir(parents=True)
        self.ckpt = root / "run" / "checkpoints"
        self.store = Store.create(self.live, replay_capacity=64, **RUN)
        self.store.segments_dir = segments_dir_of(self.ckpt)
        self.pub = Publisher(self.ckpt, retention=Retention(KeepNewestSnapshots(10)),
                             live_references=self.store.segment_references)
        self.pub.publish_bootstrap(lambda d: (d / "weights.bin").write_bytes(b"w" * 64))
        self.seq = 0

    def finish(self, count: int) -> list[int]:
        made = []
        for _ in range(count):
            (g,) = self.store.reserve([Reservation(self.seq, 0, self.seq)], num_generations=2, target_step=1)
            self.seq += 1
            for i, a in enumerate(self.store.dispatch([g], policy_version=0)):
                tokens = [g * 100 + i * 10 + k for k in range(6)]
                self.store.finish(a, FinishedGeneration(tokens, [-0.5] * 6, 1.0, [(0, 6)]))
            self.store.seal([g])
            self.store.enter_replay([g])
            made.append(g)
        return made

    def snapshot(self, capture=None):
        with self.pub.lock:
            seal_inline_payload(self.store, self.ckpt)
            return self.pub.publish_rollout_snapshot(ANCHOR, capture or (lambda p: self.store.capture(p)), "a: 1\n")

    def close(self) -> None:
        self.pub.close()
        self.store.close()


def build(root: Path) -> Run:
    run = Run(root)
    first = run.finish(4)
    run.store.mark_trained(first[:2], step=1)
    run.store.discard(first[2:3], reason="zero_reward_variance")
    run.pub.publish_trainer_checkpoint(1, lambda d: (d / "weights.bin").write_bytes(b"v" * 64))
    run.snapshot()  # segment 1: the samples of groups 3 and 4
    run.finish(3)
    run.snapshot()  # segment 2: the three new groups' samples; snapshot 2 lists both
    return run


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("snapshots")
    build(base).close()
    return base


@pytest.fixture
def ckpt(built, tmp_path) -> Path:
    """A private copy of the checkpoint directory (symlinks kept as they are)."""
    return Path(shutil.copytree(built / "run" / "checkpoints", tmp_path / "checkpoints", symlinks=True))


def latest(ckpt: Path) -> Path:
    return ckpt / ANCHOR / "rollout_snapshots" / "snapshot_2"


def reseal(snap: Path) -> None:
    """Recompute the manifest's file checksums over the forged bytes, as publication of a
    snapshot written that way would have (its `segments` list is kept)."""
    manifest = read_manifest(snap)
    manifest.files = describe_files(snap)
    (snap / "manifest.json").write_bytes(manifest.to_json())


def forge(snap: Path, sql: str, *params) -> Path:
    db = snap / "rollout_state.sqlite"
    with sqlite3.connect(db) as conn:
        conn.execute(sql, params)
    conn.close()
    reseal(snap)
    return db


def restore_refused(snap: Path, tmp_path: Path, match: str) -> SnapshotDamaged:
    target = tmp_path / "elsewhere" / "rollout_state.sqlite"
    target.parent.mkdir(exist_ok=True)
    with unchanged(snap.parents[2]):
        with pytest.raises(SnapshotDamaged, match=match) as info:
            restore_snapshot(snap, target, groups_per_step=1, **RUN)
    assert len(str(info.value).splitlines()) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == []  # no copy left behind
    return info.value


def test_the_unforged_snapshots_verify_and_restore(ckpt, tmp_path):
    """The control: every forgery below starts from snapshots that are sound."""
    assert verify_path(ckpt).ok, verify_path(ckpt).problems
    target = tmp_path / "live" / "rollout_state.sqlite"
    target.parent.mkdir()
    restore_snapshot(latest(ckpt), target, groups_per_step=1, **RUN)
    assert target.is_file()


# ----------------------------------------------------------------------------- (a) the wrong segment


def test_a_store_that_names_the_wrong_listed_segment_for_its_samples_fails_verify_and_restore(ckpt, tmp_path):
    snap = latest(ckpt)
    # Samples of segment 2 pointed at segment 1: both listed, both sound, every checksum matches.
    db = forge(snap, "UPDATE samples SET segment_id = 1 WHERE segment_id = 2")
    with unchanged(ckpt):
        line = assert_refused(run_cli("verify", snap), {1})
    assert str(db) in line and "segment_1.sqlite" in line and "lacks their payload" in line, line
    assert not verify_path(ckpt).ok
    err = restore_refused(snap, tmp_path, "lacks their payload")
    assert "segment_1.sqlite" in str(err)


def test_verify_of_a_run_directory_finds_a_live_store_naming_the_wrong_segment(tmp_path):
    from rolloutdb.store import store_segment_problems

    run = build(tmp_path)
    run.close()
    with sqlite3.connect(run.live) as conn:
        conn.execute("UPDATE samples SET segment_id = 1 WHERE segment_id = 2")
    conn.close()
    problems = store_segment_problems(run.live, run.ckpt)
    assert len(problems) == 1 and "segment_1.sqlite" in problems[0] and "lacks their payload" in problems[0], problems


# ----------------------------------------------------------------------------- (b) symlinks out


def _segment_symlinked_out(ckpt: Path, outside: Path) -> str:
    seg = segments_dir_of(ckpt) / "segment_2.sqlite"
    shutil.copyfile(seg, outside / seg.name)  # the very bytes the manifest lists
    seg.unlink()
    os.symlink(outside / seg.name, seg)
    return seg.name


def _segments_dir_symlinked_out(ckpt: Path, outside: Path) -> str:
    directory = segments_dir_of(ckpt)
    shutil.copytree(directory, outside / directory.name)
    shutil.rmtree(directory)
    os.symlink(outside / directory.name, directory)
    return directory.name


@pytest.mark.parametrize("plant", [_segment_symlinked_out, _segments_dir_symlinked_out],
                         ids=["segment file", "payload_segments directory"])
def test_a_segment_symlinked_out_of_the_checkpoint_directory_is_refused_as_a_manifest_file_is(ckpt, tmp_path, plant):
    outside = tmp_path / "outside"
    outside.mkdir()
    name = plant(ckpt, outside)
    snap = latest(ckpt)
    with unchanged(tmp_path):
        line = assert_refused(run_cli("verify", snap), {1})
        assert_refused(run_cli("verify", ckpt), {1})
    assert "resolves outside" in line and name in line, line
    restore_refused(snap, tmp_path, "resolves outside")


# ----------------------------------------------------------------------------- (c, d) the settled record


BIG = "9" * 5000

# (what is forged, SQL, the table and column the line must name). Every column the
# settled record's decoder reads, given a value of another SQLite type.
FORGED_RECORDS = {
    "others TEXT": ("UPDATE settled_steps SET others = 'abc'", "settled_steps", "others"),
    "others INTEGER": ("UPDATE settled_steps SET others = 42", "settled_steps", "others"),
    "others REAL": ("UPDATE settled_steps SET others = 1.5", "settled_steps", "others"),
    "others a 5000-digit integer as TEXT": (f"UPDATE settled_steps SET others = '{BIG}'", "settled_steps", "others"),
    "seq_end REAL": ("UPDATE settled_steps SET seq_end = 1e308", "settled_steps", "seq_end"),
    "seq_end a 5000-digit TEXT": (f"UPDATE settled_steps SET seq_end = '{BIG}'", "settled_steps", "seq_end"),
    "trained_step TEXT": ("UPDATE settled_steps SET trained_step = 'x'", "settled_steps", "trained_step"),
    "target_step BLOB": ("UPDATE settled_steps SET target_step = x'01'", "settled_steps", "target_step"),
    "discard reason BLOB": ("UPDATE discard_reasons SET reason = x'00ff'", "discard_reasons", "reason"),
    "a 200 KB varint": ("UPDATE settled_steps SET others = ?", "settled_steps", "varint"),
    # v1_12_a: the folded prefix's counts
    "prefix seq_end TEXT": ("INSERT INTO settled_prefix (id, seq_end, trained, discarded, through_step) "
                            "VALUES (1, 'x', 0, '{}', NULL)", "settled_prefix", "seq_end"),
    "prefix discarded not JSON": ("INSERT INTO settled_prefix (id, seq_end, trained, discarded, through_step) "
                                  "VALUES (1, 0, 0, 'nope', NULL)", "settled_prefix", "discarded"),
    "prefix counts that do not add up": ("INSERT INTO settled_prefix (id, seq_end, trained, discarded, through_step) "
                                         f"VALUES (1, 0, 0, '{{\"x\": {BIG}}}', NULL)", "settled_prefix", "discarded"),
}


@pytest.mark.parametrize("name", list(FORGED_RECORDS))
def test_a_forged_settled_record_is_one_line_naming_the_file_table_and_row(ckpt, tmp_path, name):
    sql, table, column = FORGED_RECORDS[name]
    snap = latest(ckpt)
    params = (b"\xff" * 200_000 + b"\x01\x01\x01",) if "?" in sql else ()
    db = forge(snap, sql, *params)
    with unchanged(ckpt):
        line = assert_refused(run_cli("verify", snap), {1})
        shown = assert_refused(run_cli("inspect", db), {2})
    for said in (line, shown):
        assert str(db) in said and f"{table} row" in said and column in said, said
        assert "Exceeds the limit" not in said and len(said) < 600, said
    restore_refused(snap, tmp_path, table)


@pytest.mark.parametrize("sql", ["UPDATE settled_prompts SET bits = 9223372036854775807",
                                 "UPDATE settled_prompts SET settles = 'many'"], ids=["bits INTEGER", "settles TEXT"])
def test_a_forged_prompt_bitmap_is_one_line_naming_its_row_not_an_allocation_of_its_value(ckpt, tmp_path, sql):
    snap = latest(ckpt)
    db = forge(snap, sql)
    with unchanged(ckpt):
        line = assert_refused(run_cli("verify", snap), {1})
    assert str(db) in line and "settled_prompts row epoch=0" in line, line
    restore_refused(snap, tmp_path, "settled_prompts")


def test_a_5000_digit_integer_in_the_run_settings_is_refused_naming_the_file_and_column(ckpt, tmp_path):
    snap = latest(ckpt)
    forge(snap, "UPDATE run_meta SET forest_training = ?", '{"depth": ' + BIG + "}")
    err = restore_refused(snap, tmp_path, "run_meta.forest_training")
    assert "Exceeds the limit" not in str(err)


# ----------------------------------------------------------------------------- (e) the save side


def _break_invariant(db: Path) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE sampler_state SET next_seq = 0")  # invariant 4: saved groups beyond the cursor
    conn.close()


def _wrong_segment(db: Path) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE samples SET segment_id = (SELECT min(segment_id) FROM payload_segments) "
                     "WHERE segment_id = (SELECT max(segment_id) FROM payload_segments)")
    conn.close()


PLANTED = {"an invariant broken": (_break_invariant, "invariant 4"),
           "the wrong segment named": (_wrong_segment, "lacks their payload")}


@pytest.mark.parametrize("planted", list(PLANTED))
def test_a_bad_copy_is_not_published_and_the_previous_snapshot_stands(tmp_path, planted):
    corrupt, said = PLANTED[planted]
    run = build(tmp_path)
    try:
        run.finish(2)  # new payload: the next seal writes segment 3

        def capture(path):
            done = run.store.capture(path)
            corrupt(path)  # what a defect in the capture would leave
            return done

        with pytest.raises(PublishError, match=said) as info:  # CopyRefused
            run.snapshot(capture)
        assert len(str(info.value).splitlines()) == 1
        inv = scan(run.ckpt)
        assert [s.sequence for s in inv.snapshots] == [1, 2] and not inv.leftovers()
        assert verify_path(run.ckpt).ok
        published = run.snapshot()  # the run goes on: the next attempt publishes
        assert published.sequence == 4 and "check_copy" in published.timings
        assert verify_path(published.path).ok
    finally:
        run.close()


def test_the_snapshot_pump_records_a_bad_copy_as_a_failed_attempt_and_publishes_the_next(tmp_path, second_connection):
    from rolloutdb.controller.recovery.env_checkpoint import NoEnvironmentCheckpoint
    from rolloutdb.controller.run.runtime import Progress, RolloutParts, RuntimeState
    from rolloutdb.controller.recovery.snapshot_pump import SnapshotPump

    class PlantingPump(SnapshotPump):
        """The real pump, with a hook that corrupts its copy right after the cut."""

        plant = True

        def _cut(self, db_path, *args):
            capture = super()._cut(db_path, *args)
            if self.plant:
                _break_invariant(db_path)
            return capture

    run = build(tmp_path)
    try:
        run.finish(1)
        parts = RolloutParts(config=None, store=run.store, order=None, bound=None, engine=None, env=None, trainer=None,
                             dispatcher=None, runtime=RuntimeState(), read_progress=lambda: Progress(1, 0),
                             log_event=lambda e: None)
        pump = PlantingPump(parts, run.pub, interval_s=60.0, config_text="a: 1\n",
                            env_checkpoint=NoEnvironmentCheckpoint())
        result = pump.attempt(force=True)
        assert result.outcome == "failed" and "invariant 4" in result.error and "not published" in result.error
        assert [s.sequence for s in scan(run.ckpt).snapshots] == [1, 2]
        conn = second_connection(run.live)
        row = conn.execute("SELECT outcome, snapshot_seq, error FROM snapshot_attempts ORDER BY rowid DESC LIMIT 1").fetchone()
        assert row[0] == "failed" and row[1] == result.sequence and "invariant 4" in row[2], row
        pump.plant = False
        again = pump.attempt(force=True)
        assert again.outcome == "published", again.error
        assert verify_path(run.ckpt).ok
    finally:
        run.close()
