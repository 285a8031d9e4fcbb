"""`--resume` never starts a run over on its own, and restores only this run's snapshots.
A refused resume writes nothing anywhere (the whole run directory is compared, byte for
byte, before and after). Real runs in subprocesses; each test works on a copy."""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import sys

import pytest

from rolloutdb.config import load_config
from rolloutdb.controller.recovery.earlier_fingerprint import earlier_config_fingerprint
from train_cli import (
    GROUPS, STEPS, TIMEOUT, assert_one_error_line, command, digest, env, metrics, train, trained_groups, verify,
)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = train(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(finished_run, dest)
    return dest


def _newest_snapshot(run_dir):
    snaps = sorted(run_dir.glob("checkpoints/step_*/rollout_snapshots/snapshot_*"),
                   key=lambda p: int(p.name.split("_")[1]))
    return snaps[-1]


@pytest.mark.parametrize("damage", ["checkpoints missing", "checkpoints empty"])
def test_a_resume_with_nothing_to_restore_beside_trained_work_is_refused_and_changes_nothing(run_copy, damage):
    shutil.rmtree(run_copy / "checkpoints")
    if damage == "checkpoints empty":
        (run_copy / "checkpoints").mkdir()
    before = digest(run_copy)
    result = train(run_copy, "--resume")
    assert_one_error_line(result, "--start-over")
    assert "trained" in result.stderr  # says what would be lost
    assert digest(run_copy) == before  # no trace row, no metrics line, no directory, no store change


def test_start_over_moves_the_old_run_aside_and_trains_from_step_zero_saying_so(run_copy):
    shutil.rmtree(run_copy / "checkpoints")
    old_store = (run_copy / "rollout_state.sqlite").read_bytes()
    result = train(run_copy, "--resume", "--start-over")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "start" in result.stderr and "over" in result.stderr, result.stderr
    kept = list((run_copy / "discarded").glob("*/rollout_state.sqlite"))
    assert len(kept) == 1 and kept[0].read_bytes() == old_store  # nothing destroyed
    assert trained_groups(run_copy) == {s: GROUPS for s in range(1, STEPS + 1)}
    assert verify(run_copy).returncode == 0
    restores = metrics(run_copy, "restore")
    assert restores[-1]["snapshot"] is None and restores[-1]["step"] == 0


def test_a_run_killed_before_it_handed_out_a_prompt_resumes_by_starting_over(tmp_path):
    """The one silent-safe start over: the live store provably holds no work."""
    run_dir = tmp_path / "run"
    killed = train(run_dir, extra_env={"ROLLOUTDB_FAULT": "publish.tmpdir_created@1"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    result = train(run_dir, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting the run over" in result.stderr
    assert trained_groups(run_dir) == {s: GROUPS for s in range(1, STEPS + 1)}


def test_start_over_is_refused_together_with_a_snapshot_directory(run_copy):
    before = digest(run_copy)
    result = train(run_copy, "--resume", str(_newest_snapshot(run_copy)), "--start-over")
    assert_one_error_line(result, "--start-over")
    assert digest(run_copy) == before


def test_a_snapshot_of_another_run_is_refused_before_anything_is_replaced(run_copy, tmp_path):
    other = tmp_path / "other"
    made = train(other)  # same config and seed: only the run id tells the runs apart
    assert made.returncode == 0, made.stderr[-3000:]
    foreign = _newest_snapshot(other)
    before, other_before = digest(run_copy), digest(other)
    result = train(run_copy, "--resume", str(foreign))
    assert_one_error_line(result, "another run")
    assert digest(run_copy) == before
    assert digest(other) == other_before


# --------------------------------------------------------------------------- the config fingerprint


def _fingerprint_in(snapshot) -> str:
    conn = sqlite3.connect(f"file:{snapshot / 'rollout_state.sqlite'}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT config_fingerprint FROM run_meta").fetchone()[0]
    finally:
        conn.close()


def test_a_resume_with_a_frozen_key_changed_is_refused_and_one_declared_resumable_is_not(run_copy):
    before = digest(run_copy)
    refused = train(run_copy, "--resume", overrides=["algorithm.learning_rate=0.002"])
    assert refused.returncode == 2, refused.stderr[-3000:]
    (error,) = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert "config fingerprint" in error and "resume with the config the run was started with" in error, error
    assert digest(run_copy) == before
    taken = train(run_copy, "--resume", overrides=["generation.max_inflight_calls=5", "logging.plot=false"])
    assert taken.returncode == 0, taken.stderr[-3000:]
    assert verify(run_copy).returncode == 0


# `rolloutdb train` as it fingerprinted configs before the fingerprint became the config
# minus RESUMABLE_KEYS: earlier_config_fingerprint gives what Config.fingerprint() gave
# then (tests/test_hostile_fingerprint.py checks its values against ones made by that code).
EARLIER_TRAIN = (
    "import sys\n"
    "from rolloutdb.config import Config\n"
    "from rolloutdb.controller.recovery.earlier_fingerprint import earlier_config_fingerprint\n"
    "Config.fingerprint = earlier_config_fingerprint\n"
    "from rolloutdb.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_a_run_of_the_earlier_fingerprint_resumes_once_with_a_notice_and_its_later_snapshots_carry_the_current_one(
        tmp_path):
    run_dir = tmp_path / "run"
    made = subprocess.run([sys.executable, "-c", EARLIER_TRAIN, *command(run_dir)[3:]], env=env(),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert made.returncode == 0, made.stderr[-3000:]
    config = load_config(run_dir / "config.yaml")
    earlier, current = earlier_config_fingerprint(config), config.fingerprint()
    assert _fingerprint_in(_newest_snapshot(run_dir)) == earlier != current
    longer = train(run_dir, "--resume", overrides=[f"algorithm.total_steps={STEPS + 2}"])
    assert longer.returncode == 0, longer.stderr[-3000:]
    notices = [line for line in longer.stderr.splitlines() if earlier in line]
    assert len(notices) == 1 and "earlier formula" in notices[0] and current in notices[0], longer.stderr
    assert _fingerprint_in(_newest_snapshot(run_dir)) == current
    again = train(run_dir, "--resume", overrides=[f"algorithm.total_steps={STEPS + 3}"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "earlier formula" not in again.stderr
    assert trained_groups(run_dir) == {s: GROUPS for s in range(1, STEPS + 4)}
    checked = verify(run_dir)
    assert checked.returncode == 0 and "duplicated=0 lost=0" in checked.stdout, checked.stdout + checked.stderr
