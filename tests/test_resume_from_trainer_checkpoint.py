"""A trainer checkpoint is a restore point by itself (issue 30 item 3): a run with
rollout snapshots off, SIGKILLed a step after its newest checkpoint, resumes from that
checkpoint alone; the live store is rolled back to its step (store/restore/rewind.py)
and every prompt is still trained exactly once. Real runs in subprocesses.

The oracle is the trace, not the store: which prompts each process trained at which
step (train_step -> trained_groups -> group_reserved), read with plain sqlite3. The
resumed lineage keeps the killed process's steps up to the checkpoint and its own
steps after it; those must train every prompt once, hand out again the prompts the
killed process trained after the checkpoint, and never hand out a prompt it discarded.
"""

from __future__ import annotations

import shutil
import sqlite3

import pytest

import settled
from train_cli import GROUPS, assert_one_error_line, digest, metrics, train, verify

STEPS = 6
# Checkpoints at steps 2 and 4; the kill comes after step 5's commit, before step 6:
# step 5 is trained in the store and in no checkpoint.
OFF = ["rollout_checkpointing.enabled=false", "checkpointing.interval_steps=2", f"algorithm.total_steps={STEPS}"]
KILL_AFTER_STEP_5 = {"ROLLOUTDB_FAULT": "train.after_commit@5"}


def _trained_by_run(run_dir) -> dict[int, dict[int, set[tuple[int, int]]]]:
    """run -> step -> the (epoch, prompt id)s that step trained, from the trace."""
    with sqlite3.connect(f"file:{run_dir / 'logs' / 'rollout_trace.sqlite'}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT s.run, s.step, r.epoch, r.prompt_id FROM train_step s JOIN trained_groups g ON g.seq = s.seq "
            "JOIN group_reserved r ON r.group_id = g.group_id").fetchall()
    out: dict[int, dict[int, set[tuple[int, int]]]] = {}
    for run, step, epoch, prompt in rows:
        out.setdefault(run, {}).setdefault(step, set()).add((epoch, prompt))
    return out


def _trace_rows(run_dir, sql: str) -> list[tuple]:
    with sqlite3.connect(f"file:{run_dir / 'logs' / 'rollout_trace.sqlite'}?mode=ro", uri=True) as conn:
        return conn.execute(sql).fetchall()


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    killed = train(run_dir, overrides=[*OFF, "trace.enabled=true"], extra_env=KILL_AFTER_STEP_5)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_2", "step_4"]
    assert not list(run_dir.glob("checkpoints/*/rollout_snapshots/snapshot_*"))
    with sqlite3.connect(f"file:{run_dir / 'rollout_state.sqlite'}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT max(trained_step) FROM settled_steps").fetchone()[0] == 5
    return run_dir


@pytest.fixture
def run_copy(killed_run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(killed_run, dest)
    return dest


def test_a_run_without_rollout_snapshots_resumes_from_its_newest_trainer_checkpoint_training_every_prompt_once(run_copy):
    resumed = train(run_copy, "--resume", overrides=[*OFF, "trace.enabled=true"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"no rollout snapshot: resumed from the trainer checkpoint step_4 alone, at step 4; in-flight and replay "
            f"work of the steps after 4 is generated again ({GROUPS} group(s) trained after step 4") in resumed.stderr

    runs = _trained_by_run(run_copy)
    first, second = sorted(runs)
    # The killed process's step 5 may be missing from the trace (its last events die
    # unflushed with it); steps 1-4 are in the checkpoint, so in the trace long before.
    assert {1, 2, 3, 4} <= set(runs[first]) and sorted(runs[second]) == [5, 6]
    lineage = [p for step in (1, 2, 3, 4) for p in runs[first][step]] + [p for s in (5, 6) for p in runs[second][s]]
    assert len(lineage) == STEPS * GROUPS and len(set(lineage)) == len(lineage)  # every prompt trained once
    reserved = lambda run: set(_trace_rows(  # noqa: E731
        run_copy, f"SELECT epoch, prompt_id FROM group_reserved WHERE run = {run}"))
    discarded = set(_trace_rows(run_copy, f"SELECT r.epoch, r.prompt_id FROM group_discarded d JOIN group_reserved r "
                                          f"ON r.group_id = d.group_id WHERE d.run = {first}"))
    # Whatever the killed process handed out after its checkpoint's steps (trained at
    # step 5, in flight, in replay) is handed out again, or still waits in the spare pool
    # (the run ended first), or was discarded by it in a commit whose trace event died
    # unflushed with the process (seen in CI: its prompt's settled bit is set, and the
    # store records one discard more than the trace). No more of those than the store's
    # discards the trace does not know: a rewind that left a step-5 prompt settled would
    # exceed that. A discard is final: none of its discarded prompts comes back.
    kept = {p for step in (1, 2, 3, 4) for p in runs[first][step]}
    with sqlite3.connect(f"file:{run_copy / 'rollout_state.sqlite'}?mode=ro", uri=True) as conn:
        spare = set(conn.execute("SELECT epoch, prompt_id FROM spare_prompts").fetchall())
        settled_bits = settled.settled_prompt_ids(conn)
        store_discards = settled.states(conn)["discarded"]
    traced_discards = len(_trace_rows(run_copy, "SELECT group_id FROM group_discarded WHERE reason IS NOT 'rewind'"))
    unexplained = reserved(first) - kept - discarded - reserved(second) - spare
    assert unexplained <= settled_bits and len(unexplained) <= store_discards - traced_discards, unexplained
    assert len(reserved(first) - kept - discarded) >= GROUPS
    assert discarded and not discarded & reserved(second)

    checked = verify(run_copy)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"trained={STEPS * GROUPS} " in checked.stdout and "duplicated=0 lost=0" in checked.stdout
    restore = [m for m in metrics(run_copy, "restore")]
    assert restore[-1]["snapshot"] is None and restore[-1]["anchor"] == "step_4"
    assert restore[-1]["rewound"]["trained_after"] == GROUPS
    # Every group the rewind withdrew is in the trace, recorded by the resumed run as it
    # left the ledger untrained: a group of the killed run (whose own reservation event
    # may have died unflushed with it), not trained by its checkpoint's steps, not
    # discarded by it, and no group of the resumed run.
    withdrawn = _trace_rows(run_copy, "SELECT run, group_id FROM group_discarded WHERE reason = 'rewind'")
    assert len(withdrawn) == restore[-1]["rewound"]["withdrawn"] > 0
    assert {run for run, _ in withdrawn} == {second}
    ids = lambda sql: {r[0] for r in _trace_rows(run_copy, sql)}  # noqa: E731
    settled_first = ids(f"SELECT g.group_id FROM train_step s JOIN trained_groups g ON g.seq = s.seq WHERE s.run = {first} "
                        f"AND s.step <= 4 UNION SELECT group_id FROM group_discarded WHERE run = {first}")
    reserved_second = ids(f"SELECT group_id FROM group_reserved WHERE run = {second}")
    assert not {g for _, g in withdrawn} & (settled_first | reserved_second)
    assert {g for _, g in withdrawn} & ids(f"SELECT group_id FROM group_reserved WHERE run = {first}")
    # The trace knows the stop's cut: the checkpoint's time, no snapshot.
    (cut, seq), = _trace_rows(run_copy, "SELECT cut_time, snapshot_seq FROM restore_done")
    assert cut is not None and seq is None


def test_turning_rollout_snapshots_on_at_the_resume_snapshots_the_rewound_store(run_copy):
    resumed = train(run_copy, "--resume", overrides=[*OFF[1:], "rollout_checkpointing.enabled=true"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from the trainer checkpoint step_4 alone" in resumed.stderr
    assert list(run_copy.glob("checkpoints/step_*/rollout_snapshots/snapshot_*"))
    checked = verify(run_copy)
    assert checked.returncode == 0 and "duplicated=0 lost=0" in checked.stdout, checked.stdout + checked.stderr


def test_a_store_that_lost_the_commits_of_its_checkpoints_step_is_refused_and_changes_nothing(run_copy):
    # A power loss under synchronous=NORMAL: the checkpoint of step 4 is durable, the
    # store's commits from step 3 on are gone (here: the settled record of steps 3-5).
    with sqlite3.connect(run_copy / "rollout_state.sqlite") as conn:
        conn.execute("DELETE FROM settled_steps WHERE trained_step >= 3")
    before = digest(run_copy)
    refused = train(run_copy, "--resume", overrides=OFF)
    assert_one_error_line(refused, "step_4 alone", "records training only up to step 2", "--start-over")
    assert digest(run_copy) == before


def test_a_run_without_the_ledger_is_refused_a_resume_from_its_trainer_checkpoint_and_nothing_changes(tmp_path):
    run_dir = tmp_path / "run"
    none = [*OFF, "rollout_recovery.target_level=none"]
    killed = train(run_dir, overrides=none, extra_env=KILL_AFTER_STEP_5)
    assert killed.returncode == -9, killed.stderr[-3000:]
    before = digest(run_dir)
    refused = train(run_dir, "--resume", overrides=none)
    assert_one_error_line(refused, "step_4 alone", "records no ledger", "--start-over")
    assert digest(run_dir) == before


def test_switching_from_a_ledger_level_to_target_level_none_at_a_resume_is_refused_with_the_reason(run_copy):
    before = digest(run_copy)
    refused = train(run_copy, "--resume", overrides=[*OFF, "rollout_recovery.target_level=none"])
    assert_one_error_line(refused, "step_4 alone", "this config runs without one", "which prompts were in flight",
                          "target_level group, turn or prefix")
    assert digest(run_copy) == before


def test_a_kill_right_after_the_rollback_resumes_again_and_still_trains_every_prompt_once(run_copy):
    killed = train(run_copy, "--resume", overrides=OFF, extra_env={"ROLLOUTDB_FAULT": "resume.after_restore"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    # The rollback committed; the second resume rolls back to the same step again, which
    # now finds nothing trained after it and nothing in flight.
    resumed = train(run_copy, "--resume", overrides=OFF)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_4 alone, at step 4" in resumed.stderr and "(0 group(s) trained after step 4 and 0 in flight" \
        in resumed.stderr
    checked = verify(run_copy)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"trained={STEPS * GROUPS} " in checked.stdout and "duplicated=0 lost=0" in checked.stdout


def test_a_run_killed_before_its_first_step_checkpoint_resumes_from_the_bootstrap_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # Checkpoints every 4 steps: the kill after step 2 leaves only bootstrap/ durable.
    every4 = ["rollout_checkpointing.enabled=false", "checkpointing.interval_steps=4", "algorithm.total_steps=3"]
    killed = train(run_dir, overrides=every4, extra_env={"ROLLOUTDB_FAULT": "train.after_commit@2"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not list((run_dir / "checkpoints").glob("step_*"))
    resumed = train(run_dir, "--resume", overrides=every4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"resumed from the trainer checkpoint bootstrap alone, at step 0; in-flight and replay work of the steps "
            f"after 0 is generated again ({2 * GROUPS} group(s) trained after step 0") in resumed.stderr
    checked = verify(run_dir)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"trained={3 * GROUPS} " in checked.stdout and "duplicated=0 lost=0" in checked.stdout
