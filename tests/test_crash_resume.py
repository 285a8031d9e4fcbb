"""Kill the main job anywhere, resume, lose nothing: the crash harness over real
subprocesses (see tests/crash_harness.py for what is checked after each kill and over
the whole chain)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from crash_harness import GROUP_LEVEL, PREFIX_LEVEL, TURN_LEVEL, HarnessConfig, check_after_kill, run_chain  # noqa: F401
from rolloutdb.controller import fault_points as controller_points
from rolloutdb.store import faults

CONTROLLER_SOURCES = Path(__file__).resolve().parents[1] / "controller"


def test_every_controller_fault_point_is_called_in_the_controller():
    source = "".join(p.read_text() for p in sorted(CONTROLLER_SOURCES.rglob("*.py")))
    for point in controller_points.POINTS:
        assert f'faults.point("{point}")' in source, point


@pytest.mark.timeout(1200)  # ~75 s on 2 cores; more than 300 s on a loaded machine (seen 2026-12-01)
def test_killing_the_main_job_at_fault_points_and_random_moments_loses_nothing(tmp_path):
    """Quick tier: >= 10 kills in one chain."""
    rng = random.Random(11)
    # pump.after_turn_commit never fires at group level (no turn progress is written), nor
    # the async checkpoint points with checkpointing.async off: a plan item that kills
    # nothing lets the run end and the rest of the plan kill nothing.
    plan = [(f"{p}@{1 + rng.randrange(2)}", None) for p in controller_points.POINTS
            if p not in ("resume.after_restore", "pump.after_turn_commit") and p not in controller_points.ASYNC_POINTS
            and p not in controller_points.ENV_POINTS]
    plan.insert(3, ("resume.after_restore", None))  # kills a resume in the middle of the chain
    # Sealing payload into a segment (W2-G): killed after the segment is durable and before
    # any sample points at it, so the chain's later saves must remove it and restores ignore it.
    plan.insert(6, ("segment.durable@2", None))
    plan += [(None, rng.uniform(0.2, 2.5)) for _ in range(3)]
    result = run_chain(tmp_path / "run", plan)
    assert not result.problems, result.problems
    assert result.finished
    assert result.kills >= 10, f"only {result.kills} kills landed: {result.killed_at}"
    assert result.restores, "no resume restored a snapshot"


@pytest.mark.slow  # ~2 min; the default tier kills turn level in test_turn_recovery_real_run (CI time, 2026-12-02)
@pytest.mark.timeout(1200)  # ~130 s on 2 cores with 12 kills; 7 since 2026-12-01 (CI time)
def test_killing_a_multi_turn_run_at_turn_level_keeps_its_committed_turns_and_loses_nothing(tmp_path):
    """Quick tier at turn level: 7 kills in one chain of the multi-turn long-tail task,
    after a turn's commit batch, between a call finishing and its batch committing, at a
    resume, at a snapshot's cut, and at a random moment (each kind at least once, the
    turn-level points twice; the long tier, -m slow, draws hundreds). Besides the chain's
    checks, every episode a resume restored matches its snapshot's saved turn, and a stop
    kept tokens."""
    rng = random.Random(12)
    # The first kill lands well into the fresh run, once snapshots hold saved episodes (the
    # first ones, before any rollout, hold none); ~120 turn-commit batches in a whole run.
    after_turn = [(f"pump.after_turn_commit@{12 + rng.randrange(8)}", None),
                  (f"pump.after_turn_commit@{2 + rng.randrange(8)}", None)]
    uncommitted = [(f"pump.call_finished_uncommitted@{10 + rng.randrange(60)}", None) for _ in range(2)]
    plan = [after_turn[0], uncommitted[0], (None, rng.uniform(*TURN_LEVEL.random_kill_s)),
            ("resume.after_restore", None), after_turn[1], ("snapshot.after_cut@2", None), uncommitted[1]]
    result = run_chain(tmp_path / "run", plan, config=TURN_LEVEL)
    assert not result.problems, result.problems
    assert result.finished
    assert result.kills >= 6, f"only {result.kills} kills landed: {result.killed_at}"
    assert {"pump.after_turn_commit", "pump.call_finished_uncommitted"} <= {k.split("@")[0] for k in result.killed_at}
    assert result.episodes_restored > 0, "no resume restored an episode at its last committed turn"
    assert any(k > 0 for k in result.kept_per_stop), f"no stop kept a token: {result.kept_per_stop}"


@pytest.mark.slow  # ~2 min; the default tier kills prefix level in test_prefix_recovery_real_run (CI time, 2026-12-02)
@pytest.mark.timeout(1200)  # ~90 s on 2 cores with 8 kills; 6 since 2026-12-01 (CI time)
def test_killing_a_multi_turn_run_at_prefix_level_continues_its_calls_and_loses_nothing(tmp_path):
    """Quick tier at prefix level: 6 kills in one chain of the multi-turn long-tail task
    (after a turn's commit, between a call finishing and its commit, at a snapshot's cut,
    at a resume and at a random moment), with the chain's checks and the turn-level ones."""
    rng = random.Random(13)
    plan = [(f"pump.after_turn_commit@{12 + rng.randrange(8)}", None),
            (None, rng.uniform(*PREFIX_LEVEL.random_kill_s)),
            (f"pump.call_finished_uncommitted@{10 + rng.randrange(60)}", None),
            ("resume.after_restore", None),
            ("snapshot.after_cut@3", None),
            (f"pump.after_turn_commit@{2 + rng.randrange(8)}", None)]
    result = run_chain(tmp_path / "run", plan, config=PREFIX_LEVEL)
    assert not result.problems, result.problems
    assert result.finished
    assert result.kills >= 5, f"only {result.kills} kills landed: {result.killed_at}"


@pytest.mark.timeout(1200)  # a hang detector: 203 s beside two CPU hogs, over 300 s at load ~10 (2026-12-03)
def test_killing_an_async_checkpointing_run_at_each_of_its_points_resumes_from_the_previous_anchor(tmp_path):
    """Quick tier, checkpointing.async: a kill while a checkpoint is copied, written,
    sealed but not renamed, or renamed before its held snapshot is published. Every
    resume must restore the newest sound snapshot the harness finds on disk (so never
    one under the unpublished checkpoint), and the chain must train every group once.
    One kill per point, at its 1st or 2nd occurrence in turn (the 1st checkpoint's
    previous anchor is the bootstrap, a later one's a step: both kinds are met; the long
    tier, -m slow, draws from these points in every other group-level chain)."""
    plan = [(f"{p}@{1 + i % 2}", None) for i, p in enumerate(controller_points.ASYNC_POINTS)]
    result = run_chain(tmp_path / "run", plan, overrides=["checkpointing.async=true"])
    assert not result.problems, result.problems
    assert result.finished
    assert result.kills == len(plan), f"only {result.kills} of {len(plan)} kills landed: {result.killed_at}"
    assert result.restores, "no resume restored a snapshot"


@pytest.mark.slow
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("config", [TURN_LEVEL, GROUP_LEVEL, PREFIX_LEVEL], ids=lambda c: c.name)
def test_hundreds_of_kills_over_many_chains_never_lose_or_duplicate_a_prompt(tmp_path, config: HarnessConfig):
    """Long tier: >= 200 kills per configuration. Run with
    `python -m pytest -m slow tests/test_crash_resume.py -s`; the result is recorded in
    RELIABILITY.md."""
    started = time.time()
    total_kills, chains, restored, kept = 0, 0, 0, 0
    # Sealing's points fire at every snapshot with new payload; retention's removal of a
    # segment (segment.trashed, .removed) only once a snapshot holding one retires, which a
    # chain may not reach (a point that never fires ends the plan early): those two are
    # killed by tests/test_payload_segments.py's child processes and by the segment chain below.
    points = list(controller_points.POINTS) + list(faults.POINTS) + ["segment.built", "segment.durable",
                                                                     "segment.referenced"]
    seed = 0
    while total_kills < 200:
        rng = random.Random(seed)
        # Every other group-level chain checkpoints asynchronously (its points only fire then).
        async_chain = config is GROUP_LEVEL and seed % 2 == 1
        usable = [p for p in points if (async_chain or p not in controller_points.ASYNC_POINTS)
                  and p not in controller_points.ENV_POINTS]
        plan = [(f"{p}@{1 + rng.randrange(3)}", None) for p in rng.sample(usable, 8)]
        plan += [(None, rng.uniform(*config.random_kill_s)) for _ in range(8)]
        rng.shuffle(plan)
        result = run_chain(tmp_path / f"chain{seed}", plan, config=config,
                           overrides=["checkpointing.async=true"] if async_chain else [])
        assert not result.problems, (seed, result.problems)
        total_kills += result.kills
        restored += result.episodes_restored
        kept += sum(result.kept_per_stop)
        chains += 1
        seed += 1
        print(f"\n{config.name} chain {seed - 1}: {result.kills} kills at {result.killed_at}; "
              f"{result.episodes_restored} episodes restored, kept {result.kept_per_stop}", flush=True)
    print(f"\nlong tier ({config.name}): {total_kills} kills over {chains} chains in {time.time() - started:.0f} s; "
          f"{restored} episodes restored at their committed turn, {kept} tokens kept")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("config", [GROUP_LEVEL, TURN_LEVEL, PREFIX_LEVEL], ids=lambda c: c.name)
def test_a_chain_killed_at_every_segment_point_loses_nothing_and_leaves_no_dangling_reference(tmp_path,
                                                                                            config: HarnessConfig):
    """Payload segments under SIGKILL in the real controller: sealing (a segment built,
    durable but unreferenced, referenced) and retention's removal of one (trashed,
    removed), among random kills; every check of the chain after each kill (`verify`, the
    snapshot chain, no segment referenced and missing) and the twin at the end. About 150 s
    per configuration on 2 cores. Every planned point must land: a point that never fired
    would let the run end and the rest of the plan kill nothing."""
    if config is GROUP_LEVEL:  # 5 short steps: a third seal, or a retired segment, may never come
        plan = [("segment.durable@1", None), ("segment.referenced@1", None), (None, 1.0), ("segment.built@1", None),
                (None, 2.0)]
    else:
        plan = [("segment.durable@2", None), ("segment.referenced@1", None), (None, 1.0), ("segment.built@3", None),
                ("segment.referenced@3", None), ("segment.trashed@1", None), (None, 2.0), ("segment.removed@1", None)]
    result = run_chain(tmp_path / "run", plan, config=config)
    assert not result.problems, result.problems
    assert result.finished
    planned = [p for p, _ in plan if p is not None]
    assert [k for k in result.killed_at if k.startswith("segment.")] == planned, result.killed_at
