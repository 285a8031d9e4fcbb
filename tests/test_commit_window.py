"""The commit lock covers only the optimizer commit: with a `StagedTrainer` the train
pump computes a step (`prepare_step`) holding no lock, so interval snapshots are cut
while it runs, and a cut taken then is consistent (controller/training/pump.py argues
why): killed after the backward, a resume trains that batch again, exactly once.

Real runs (`rolloutdb train` subprocesses) of the harness's group-level configuration
with tests/slow_prepare_trainer.py: the built-in GRPO trainer whose prepare spends one
more second, and, seen through `train_step` alone, the same trainer as a whole-step one
(the lock around the whole step: the planted bug, and today's behaviour for trainers
without the split)."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import settled
from crash_harness import (GROUP_LEVEL, ChainResult, _command, check_chain, finish, metrics, newest_usable_snapshot,
                           run_once, start_twin, train_env)
from crash_ledger import compare_with_twin

REPO = Path(__file__).resolve().parents[1]
PREPARE_S = 1.0
# A snapshot attempt recorded in the first moments of a prepare may have been decided
# during the commit before it (its row and metrics line are written after the check).
RECORD_SLACK_S = 0.2


def _trainer(prepare_s: float = PREPARE_S, *, staged: bool = True, windows: Path | None = None) -> list[str]:
    options = f"prepare_s: {prepare_s}, staged: {str(staged).lower()}" + (f", windows: {windows}" if windows else "")
    return [f"trainer.factory={REPO / 'tests' / 'slow_prepare_trainer.py'}:make_trainer",
            f"trainer.options={{{options}}}"]


def _windows(path: Path) -> list[dict]:
    """The prepares the trainer recorded, in order."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [w for w in map(json.loads, lines) if w["stage"] == "prepare"]


def _attempts_inside(run_dir: Path, windows: list[dict]) -> list[dict]:
    """Snapshot attempts of the run that began inside a prepare: a published one by its
    cut (`cut_time`: a cut held for its checkpoint is published later, perhaps during the
    next step's prepare, which its `t` alone placed it in), any other by when it was
    recorded, less the slack."""
    inside = []
    for e in metrics(run_dir, "snapshot"):
        cut = e.get("cut_time")
        start, slack = (cut, 0.0) if cut is not None else (e["t"], RECORD_SLACK_S)
        if any(w["t_start"] + slack <= start <= w["t_end"] for w in windows):
            inside.append(e)
    return inside


@pytest.mark.timeout(900)  # two runs side by side, ~30 s each on 2 idle cores
def test_snapshots_are_cut_while_a_staged_trainer_prepares_and_skipped_while_a_whole_step_trainer_trains(tmp_path):
    runs = {}
    for name, staged in (("staged", True), ("whole", False)):
        run_dir, windows = tmp_path / name, tmp_path / f"{name}.windows.jsonl"
        cmd = _command(run_dir, False, GROUP_LEVEL, [*_trainer(staged=staged, windows=windows), "algorithm.total_steps=4"])
        runs[name] = (run_dir, windows, subprocess.Popen(cmd, env=train_env(), stdout=subprocess.DEVNULL,
                                                         stderr=subprocess.PIPE, text=True))
    outcomes = {}
    for name, (run_dir, windows, proc) in runs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        assert len(_windows(windows)) == 4, name
        outcomes[name] = [e["outcome"] for e in _attempts_inside(run_dir, _windows(windows))]
    staged, whole = outcomes["staged"], outcomes["whole"]
    # The staged trainer's prepares: attempts go on, and cut snapshots (anchored to the step before).
    assert "skipped_commit" not in staged, staged
    assert staged.count("published") >= 1, staged
    # The whole step under the lock: every attempt while it computes is skipped.
    assert whole and set(whole) == {"skipped_commit"}, whole


@pytest.mark.timeout(900)  # one run, ~25 s on 2 idle cores
def test_with_async_checkpoints_snapshots_during_a_step_anchor_to_the_previous_step_once_its_write_ends(tmp_path):
    """`checkpointing.async: true` every step: step_<k-1> is written in the background
    while step k prepares. It is published as soon as the write ends (the snapshot pump
    does it before its next attempt), so attempts during the prepare publish snapshots
    anchored to it; published only at the next step boundary, every attempt of the
    prepare would be `skipped_not_durable` (the planted bug: the snapshot pump's
    `publish_written_checkpoint` left unset)."""
    run_dir, windows = tmp_path / "run", tmp_path / "windows.jsonl"
    cmd = _command(run_dir, False, GROUP_LEVEL, [*_trainer(windows=windows), "algorithm.total_steps=4",
                                                 "checkpointing.async=true"])
    proc = subprocess.run(cmd, env=train_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    by_step = {w["step"]: w for w in _windows(windows)}
    assert sorted(by_step) == [1, 2, 3, 4]
    anchored = []
    for step in (2, 3, 4):
        inside = _attempts_inside(run_dir, [by_step[step]])
        anchored += [e for e in inside if e["outcome"] == "published" and e.get("anchor") == f"step_{step - 1}"]
    published = [e for e in metrics(run_dir, "checkpoint") if e["outcome"] == "published"]
    assert [e["step"] for e in published] == [1, 2, 3, 4], published
    assert len(anchored) >= 2, [(e["outcome"], e.get("anchor")) for e in metrics(run_dir, "snapshot")]


@pytest.mark.timeout(900)  # one run, ~25 s on 2 idle cores
def test_with_async_checkpoints_the_boundary_snapshot_is_published_when_its_checkpoint_is_written_not_a_step_later(tmp_path):
    """The cut a step boundary takes for its asynchronous checkpoint is held until the
    checkpoint is published. With no interval attempts (`interval_s` 600), it is published
    during the next step's prepare, once the background write ends: the write's end wakes
    the snapshot pump. Without that wake (the planted bug), each held cut waited for the next
    step boundary, a whole train step later (on a GPU, tens of seconds of generation a kill
    then loses)."""
    run_dir, windows = tmp_path / "run", tmp_path / "windows.jsonl"
    cmd = _command(run_dir, False, GROUP_LEVEL, [*_trainer(windows=windows), "algorithm.total_steps=4",
                                                 "checkpointing.async=true", "rollout_checkpointing.interval_s=600"])
    proc = subprocess.run(cmd, env=train_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    by_step = {w["step"]: w for w in _windows(windows)}
    assert sorted(by_step) == [1, 2, 3, 4]
    snapshots = [e for e in metrics(run_dir, "snapshot") if e["outcome"] == "published"]
    for step in (2, 3, 4):
        held = [e for e in snapshots if e.get("anchor") == f"step_{step - 1}"]
        assert held, (step, [(e["outcome"], e.get("anchor")) for e in metrics(run_dir, "snapshot")])
        assert held[0]["t"] <= by_step[step]["t_end"], (
            f"step_{step - 1}'s snapshot published {held[0]['t'] - by_step[step]['t_end']:.2f} s after step {step}'s "
            "prepare ended")


def _replay_and_trained(snapshot_db: Path, step: int) -> tuple[int, int]:
    uri = f"file:{snapshot_db}?mode=ro&immutable=1"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        replay = conn.execute("SELECT count(*) FROM replay_groups WHERE target_step = ?", (step,)).fetchone()[0]
        trained = settled.trained_per_step(conn).get(step, 0)
    return replay, trained


@pytest.mark.timeout(1200)  # three processes and a twin, ~60 s on 2 idle cores
def test_killed_after_the_backward_a_run_resumes_from_a_cut_taken_during_it_and_trains_that_batch_once(tmp_path):
    """Killed at `train.prepared` of step 2 (its batch's forward and backward done, not
    committed): the newest snapshot was cut during that prepare, is anchored to step_1
    and holds the batch in replay, untrained. The resume is killed at the same point of
    its first step (the same batch again); the next one finishes. The chain's checks:
    `rolloutdb verify` exactly-once, every step trained its groups once, the prompts
    trained are the never-killed twin's."""
    config = GROUP_LEVEL
    run_dir, windows = tmp_path / "run", tmp_path / "windows.jsonl"
    overrides = _trainer(windows=windows)
    result = ChainResult(config=config, overrides=overrides)
    result.twin_dir = run_dir.with_name("run.twin")
    twin = start_twin(result.twin_dir, config, _trainer())
    try:
        assert run_once(run_dir, result, fault="train.prepared@2") == -signal.SIGKILL, result.problems
        assert [w["step"] for w in _windows(windows)] == [1, 2]
        newest = newest_usable_snapshot(run_dir / "checkpoints")
        assert newest is not None
        sequence, snapshot = newest[0], Path(newest[1])
        assert snapshot.parent.parent.name == "step_1"
        prepare_2 = _windows(windows)[1]
        cut = [e for e in metrics(run_dir, "snapshot") if e.get("sequence") == sequence and e["outcome"] == "published"]
        assert cut and cut[0]["t"] - cut[0]["timings"]["total"] >= prepare_2["t_start"], (cut, prepare_2)
        assert _replay_and_trained(snapshot / "rollout_state.sqlite", 2) == (config.groups, 0)

        assert run_once(run_dir, result, fault="train.prepared@1") == -signal.SIGKILL, result.problems
        assert [w["step"] for w in _windows(windows)] == [1, 2, 2]  # the resume prepared step 2 again
        finish(run_dir, result)
        assert result.finished, result.problems
        check_chain(run_dir, result)
        _, err = twin.communicate(timeout=600)
        assert twin.returncode == 0, err[-2000:]
        result.problems += compare_with_twin(run_dir, result.twin_dir, config)
    finally:
        if twin.poll() is None:
            twin.kill()
            twin.wait()
    assert not result.problems, result.problems
    assert [w["step"] for w in _windows(windows)] == [1, 2, 2, 2, 3, 4, 5]
    verify = subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(run_dir)], capture_output=True, text=True,
                            timeout=300, env=train_env())
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "duplicated=0 lost=0" in verify.stdout and f"trained={config.steps * config.groups}" in verify.stdout
