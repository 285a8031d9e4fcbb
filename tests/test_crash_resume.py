"""Kill the main job anywhere, resume, lose nothing: the crash harness over real
subprocesses (see tests/crash_harness.py for what is checked after each kill and over
the whole chain)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from crash_harness import check_after_kill, run_chain  # noqa: F401
from rolloutdb.controller import fault_points as controller_points
from rolloutdb.store import faults

CONTROLLER_SOURCES = Path(__file__).resolve().parents[1] / "controller"


def test_every_controller_fault_point_is_called_in_the_controller():
    source = "".join(p.read_text() for p in CONTROLLER_SOURCES.glob("*.py"))
    for point in controller_points.POINTS:
        assert f'faults.point("{point}")' in source, point


def test_killing_the_main_job_at_fault_points_and_random_moments_loses_nothing(tmp_path):
    """Quick tier: >= 10 kills in one chain."""
    rng = random.Random(11)
    plan = [(f"{p}@{1 + rng.randrange(2)}", None) for p in controller_points.POINTS
            if p != "resume.after_restore" and p not in controller_points.ASYNC_POINTS]
    plan.insert(3, ("resume.after_restore", None))  # kills a resume in the middle of the chain
    plan += [(None, rng.uniform(0.2, 2.5)) for _ in range(3)]
    result = run_chain(tmp_path / "run", plan)
    assert not result.problems, result.problems
    assert result.finished
    assert result.kills >= 10, f"only {result.kills} kills landed: {result.killed_at}"
    assert result.restores, "no resume restored a snapshot"


def test_killing_an_async_checkpointing_run_at_each_of_its_points_resumes_from_the_previous_anchor(tmp_path):
    """Quick tier, checkpointing.async: a kill while a checkpoint is copied, written,
    sealed but not renamed, or renamed before its held snapshot is published. Every
    resume must restore the newest sound snapshot the harness finds on disk (so never
    one under the unpublished checkpoint), and the chain must train every group once."""
    plan = [(f"{p}@{n}", None) for p in controller_points.ASYNC_POINTS for n in (1, 2)]
    result = run_chain(tmp_path / "run", plan, overrides=["checkpointing.async=true"])
    assert not result.problems, result.problems
    assert result.finished
    assert result.kills == len(plan), f"only {result.kills} of {len(plan)} kills landed: {result.killed_at}"
    assert result.restores, "no resume restored a snapshot"


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_hundreds_of_kills_over_many_chains_never_lose_or_duplicate_a_prompt(tmp_path):
    """Long tier: >= 200 kills. Run with `python -m pytest -m slow tests/test_crash_resume.py`;
    the result is recorded in RELIABILITY.md."""
    started = time.time()
    total_kills, chains = 0, 0
    points = list(controller_points.POINTS) + list(faults.POINTS)
    seed = 0
    while total_kills < 200:
        rng = random.Random(seed)
        async_chain = seed % 2 == 1  # every other chain checkpoints asynchronously
        usable = [p for p in points if async_chain or p not in controller_points.ASYNC_POINTS]
        plan = [(f"{p}@{1 + rng.randrange(3)}", None) for p in rng.sample(usable, 8)]
        plan += [(None, rng.uniform(0.0, 3.0)) for _ in range(8)]
        rng.shuffle(plan)
        result = run_chain(tmp_path / f"chain{seed}", plan,
                           overrides=["checkpointing.async=true"] if async_chain else [])
        assert not result.problems, (seed, result.problems)
        total_kills += result.kills
        chains += 1
        seed += 1
    print(f"\nlong tier: {total_kills} kills over {chains} chains in {time.time() - started:.0f} s")
