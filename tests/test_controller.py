"""The single controller on the embedded default: real tiny Llama, real GRPO, real
SQLite. Runs are small (a few steps) so the suite stays fast."""

from __future__ import annotations

import sqlite3

import pytest
import settled

from rolloutdb.config import config_from_dict
from rolloutdb.controller.job.controller import Controller
from rolloutdb.controller.run.run_log import read_metrics

SMALL = {
    "run": {"name": "t", "seed": 3},
    "algorithm": {"total_steps": 4, "groups_per_step": 3, "group_size": 4, "max_staleness": 1},
    "generation": {"max_tokens": 4, "max_batch_size": 12},
    "environment": {"dataset_size": 64, "n_digits": 2},
    "checkpointing": {"interval_steps": 2},
    "logging": {"progress": False, "plot": False},
}


def _config(**sections):
    data = {k: dict(v) for k, v in SMALL.items()}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return config_from_dict(data)


@pytest.fixture(scope="module")
def ledger_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ledger") / "run"
    # The trace is on: trained groups leave the store's ledger (settled_ranges keep their
    # positions), so per-group facts such as the dispatch version are read from it.
    summary = Controller(_config(trace={"enabled": True}), run_dir).run()
    return run_dir, summary


def test_a_run_trains_every_step_and_writes_metrics_checkpoints_and_a_summary(ledger_run):
    run_dir, summary = ledger_run
    steps = read_metrics(run_dir / "logs" / "metrics.jsonl", "train_step")
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert all(e["groups"] == 3 for e in steps)
    assert (run_dir / "checkpoints" / "step_4" / "manifest.json").is_file()
    assert (run_dir / "config.yaml").is_file()
    assert summary.line.startswith("steps=4 reward first5=")


def test_every_sampled_prompt_is_trained_once_or_discarded_with_a_reason(ledger_run):
    run_dir, _ = ledger_run
    conn = sqlite3.connect(run_dir / "rollout_state.sqlite")
    states = settled.states(conn)
    assert set(states) <= {"trained", "discarded"}
    assert states["trained"] == 4 * 3
    assert settled.trained_per_step(conn) == {1: 3, 2: 3, 3: 3, 4: 3}
    ledger = settled.positions(conn)
    assert all(o[3] is not None for records in ledger.values() for o in records if o[0] == "discarded")
    # No gap in the sampler's order: every position below the cursor is a group or a spare,
    # and none is recorded twice.
    cursor = conn.execute("SELECT next_seq FROM sampler_state").fetchone()[0]
    spare = [r[0] for r in conn.execute("SELECT sample_seq FROM spare_prompts")]
    assert sorted(spare + [seq for seq, records in ledger.items() for _ in records]) == list(range(cursor))
    assert conn.execute("SELECT count(*) FROM replay_groups").fetchone()[0] == 0


def test_the_staleness_bound_holds_for_every_trained_group(ledger_run):
    run_dir, _ = ledger_run
    conn = sqlite3.connect(run_dir / "logs" / "rollout_trace.sqlite")
    # Per trained group: the step that trained it and the version of its first attempt
    # (the group's dispatch version, which the ledger held before v1_4_a).
    rows = conn.execute("SELECT t.step, min(a.policy_version) FROM train_step t JOIN trained_groups g ON g.seq = t.seq "
                        "JOIN attempt_dispatched a ON a.group_id = g.group_id GROUP BY t.step, g.group_id").fetchall()
    assert len(rows) == 4 * 3 and all((step - 1) - version <= 1 for step, version in rows)
    steps = read_metrics(run_dir / "logs" / "metrics.jsonl", "train_step")
    assert max(e["staleness_max"] for e in steps) <= 1


def test_generation_for_later_steps_overlaps_training(ledger_run):
    run_dir, _ = ledger_run
    events = read_metrics(run_dir / "logs" / "metrics.jsonl")
    trains = [e for e in events if e["kind"] == "train_step"]
    windows = [e for e in events if e["kind"] == "rollout" and e["steps"]]
    overlapping = [
        (t["step"], w["steps"])
        for t in trains
        for w in windows
        if max(w["steps"]) > t["step"] and w["t_start"] < t["t_end"] and w["t_end"] > t["t_start"]
    ]
    assert overlapping, "no rollout for a later step finished while a step trained"


def test_no_ledger_dispatch_writes_no_ledger_rows_and_still_trains(tmp_path):
    run_dir = tmp_path / "run"
    Controller(_config(rollout_recovery={"target_level": "none"}, algorithm={"total_steps": 2}), run_dir).run()
    conn = sqlite3.connect(run_dir / "rollout_state.sqlite")
    assert conn.execute("SELECT count(*) FROM prompt_groups").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM rollouts").fetchone()[0] == 0
    assert conn.execute("SELECT ledger_dispatch FROM run_meta").fetchone()[0] == 0
    steps = read_metrics(run_dir / "logs" / "metrics.jsonl", "train_step")
    assert [e["step"] for e in steps] == [1, 2]


def test_a_multi_turn_run_trains_on_policy_tokens_only(tmp_path):
    run_dir = tmp_path / "run"
    Controller(_config(environment={"turns": 2}, algorithm={"total_steps": 2}), run_dir).run()
    steps = read_metrics(run_dir / "logs" / "metrics.jsonl", "train_step")
    assert [e["step"] for e in steps] == [1, 2]
    windows = [w for w in read_metrics(run_dir / "logs" / "metrics.jsonl", "rollout") if w["attempts_finished"]]
    # Every episode has two policy turns and the environment's reply between them:
    # those tokens are in the completions but masked out of the policy's.
    assert windows and all(w["tokens"] > w["policy_tokens"] > 0 for w in windows)


def test_every_trainer_checkpoint_gets_a_snapshot_anchored_to_it(tmp_path):
    from rolloutdb.store.checkpoints.layout import scan

    run_dir = tmp_path / "run"
    Controller(
        _config(checkpointing={"interval_steps": 1, "keep_last": 10},
                rollout_checkpointing={"enabled": True, "interval_s": 30.0, "keep_last": 10}),
        run_dir,
    ).run()
    inv = scan(run_dir / "checkpoints")
    anchored = {s.anchor for s in inv.complete_snapshots()}
    steps = {a.anchor for a in inv.complete_anchors() if a.anchor != "bootstrap"}
    assert steps == {f"step_{n}" for n in range(1, 5)}
    # The periodic interval (30 s) never fires in this short run: these come from the
    # train pump handing each new checkpoint to the snapshot pump.
    assert steps <= anchored
    events = read_metrics(run_dir / "logs" / "metrics.jsonl", "snapshot")
    assert all(e["outcome"] in ("published", "skipped_unchanged") for e in events), events


def test_a_policy_whose_groups_are_all_flat_still_finishes_the_run(tmp_path):
    # Greedy decoding gives every generation of a group the same reply: every group has
    # zero reward variance. Discarding them forever would never fill a step.
    run_dir = tmp_path / "run"
    Controller(
        _config(generation={"temperature": 0.0}, algorithm={"total_steps": 2, "max_flat_groups_in_a_row": 6}),
        run_dir,
    ).run()
    steps = read_metrics(run_dir / "logs" / "metrics.jsonl", "train_step")
    assert [e["step"] for e in steps] == [1, 2]
    conn = sqlite3.connect(run_dir / "rollout_state.sqlite")
    discarded = settled.discarded_for(conn, "zero_reward_variance")
    assert discarded >= 6


def test_a_run_without_rollout_snapshots_still_knows_where_its_store_reads_sealed_payload(tmp_path):
    # The snapshot pump seals payload into CHECKPOINT_DIR/payload_segments; a run resumed
    # with rollout_checkpointing off has no snapshot pump but may hold samples sealed
    # before the stop: its store must still be pointed at the segments (else SegmentMissing).
    run_dir = tmp_path / "run"
    ctl = Controller(_config(rollout_checkpointing={"enabled": False}, algorithm={"total_steps": 1}), run_dir)
    ctl.run()
    assert ctl.snapshotter is None
    assert ctl.store.segments_dir == run_dir / "checkpoints" / "payload_segments"
