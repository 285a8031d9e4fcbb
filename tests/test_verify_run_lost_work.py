"""`rolloutdb verify RUN_DIR` counts work the algorithm did not decide to drop as lost.

A group discarded for zero reward variance is the algorithm's choice (GRPO learns nothing
from it). A group discarded for any other reason (a pump that throws away the groups a
restore handed back with reason `restart`, say) is trained work lost: `lost=` counts it and
a problem line names the reason and examples. Stores are built with the real ledger
transitions (the Store API), read back by the CLI in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rolloutdb.store import FinishedGeneration, Reservation, Store, pools
from rolloutdb.store.live.ledger import ALGORITHM_DISCARD_REASONS, ZERO_REWARD_VARIANCE
from rolloutdb.controller.recovery.run_audit import verify_run


def _gen(reward: float) -> FinishedGeneration:
    return FinishedGeneration([1, 2, 3], [-0.1, -0.2, -0.3], reward, [(0, 3)])


def build_run(tmp_path: Path, discards: dict[int, str]) -> Path:
    """groups_per_step 2, steps 1 and 2. Positions 0..3 are stamped 1, 1, 2, 2; each
    position in `discards` is discarded with that reason and its step refilled by the next
    position from the dataloader, as the rollout pump does; the rest are trained."""
    run_dir = tmp_path / "run"
    store = Store.create(run_dir / "rollout_state.sqlite", replay_capacity=16)
    steps = [1, 1, 2, 2]
    seq, trained = 0, {1: [], 2: []}
    while steps:
        step = steps.pop(0)
        (g,) = store.reserve([Reservation(seq, 0, 100 + seq)], num_generations=2, target_step=step)
        for i, a in enumerate(store.dispatch([g], policy_version=0)):
            store.finish(a, _gen(float(i)))
        if seq in discards:
            store.discard([g], reason=discards[seq])
            steps.insert(0, step)
        else:
            store.seal([g])
            store.enter_replay([g])
            trained[step].append(g)
        seq += 1
    for step, groups in trained.items():
        store.mark_trained(groups, step=step)
    with store.atomic() as tx:
        pools.advance_cursor(tx, seq, 0)
    store.close()
    (run_dir / "config.yaml").write_text("algorithm:\n  groups_per_step: 2\n")
    return run_dir


def verify_cli(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(run_dir)],
                          capture_output=True, text=True, timeout=120)


def test_the_algorithm_owns_only_the_zero_reward_variance_reason():
    assert ALGORITHM_DISCARD_REASONS == frozenset({ZERO_REWARD_VARIANCE})
    assert ZERO_REWARD_VARIANCE == "zero_reward_variance"


def test_the_rollout_pump_discards_with_the_reason_the_store_says_the_algorithm_owns():
    from rolloutdb.controller.rollout import pump as rollout_pump

    assert rollout_pump.ZERO_VARIANCE in ALGORITHM_DISCARD_REASONS


def test_a_group_discarded_for_zero_reward_variance_is_not_lost(tmp_path):
    run_dir = build_run(tmp_path, {1: ZERO_REWARD_VARIANCE})
    verdict = verify_run(run_dir)
    assert verdict.ok, verdict.problems
    assert verdict.line() == "trained=4 discarded=1 duplicated=0 lost=0"
    proc = verify_cli(run_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "trained=4 discarded=1 duplicated=0 lost=0"


def test_a_group_discarded_as_restart_is_lost_work_and_verify_exits_1_naming_the_reason(tmp_path):
    run_dir = build_run(tmp_path, {1: "restart", 2: "restart", 3: ZERO_REWARD_VARIANCE})
    verdict = verify_run(run_dir)
    assert not verdict.ok
    assert verdict.line() == "trained=4 discarded=3 duplicated=0 lost=2"
    (problem,) = [p for p in verdict.problems if "restart" in p]
    assert "2 group(s) discarded for a reason the algorithm does not own" in problem
    # Settled groups are position ranges (v1_4_a): positions 1 and 2, not 3 (zero variance).
    assert "positions 1..2 ('restart')" in problem and "3" not in problem.split("e.g.")[1]
    proc = verify_cli(run_dir)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines()[-1] == "trained=4 discarded=3 duplicated=0 lost=2"
    err = proc.stderr.strip().splitlines()
    assert err and all(line.startswith("error: ") for line in err)
    assert any("'restart'" in line and "positions 1..2" in line for line in err)


def test_each_reason_the_algorithm_does_not_own_is_named_with_its_own_count(tmp_path):
    run_dir = build_run(tmp_path, {0: "restart", 2: "deadline", 4: "restart"})
    verdict = verify_run(run_dir)
    assert verdict.lost == 3
    (problem,) = [p for p in verdict.problems if "does not own" in p]
    assert "'deadline' x1" in problem and "'restart' x2" in problem
