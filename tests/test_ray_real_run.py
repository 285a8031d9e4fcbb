"""`rolloutdb train` with `cluster.backend: ray` as a user runs it, in real subprocesses:
the quickstart on two engine workers to the end, engine workers killed mid-rollout
(`ray.kill`, and SIGKILL of the worker's process), and the driver SIGKILLed then resumed
on a fresh cluster. What the runs left is read with plain sqlite3 (a second connection)
and `rolloutdb verify`; no Ray process may outlive a test."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import train_cli  # noqa: E402
from crash_harness import (  # noqa: E402
    GROUP_LEVEL,
    PREFIX_LEVEL,
    TURN_LEVEL,
    ChainResult,
    check_chain,
    finish,
    run_once,
)
from test_ray_workers import ray_processes, short_temp_dir, wait_until  # noqa: E402

from rolloutdb.gpu_capture.ray_workers import NAMESPACE  # noqa: E402

RAY = ["cluster.backend=ray", "cluster.engine_workers=2"]


def no_ray_processes_left(temp: str, within: float = 20.0) -> list[str]:
    deadline = time.monotonic() + within
    while ray_processes(temp) and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray_processes(temp)


def abandoned(run_dir: Path, reason: str) -> list[tuple]:
    """(group, generation, attempt) abandoned for `reason`, each with whether a later
    attempt of the same generation finished; from the trace, read by plain sqlite3 (a
    settled group's attempt rows leave the live store with it, revision v1_4_a)."""
    trace = run_dir / "logs" / "rollout_trace.sqlite"
    with contextlib.closing(sqlite3.connect(f"file:{trace}?mode=ro", uri=True)) as conn:
        return conn.execute(
            "SELECT a.group_id, a.generation_index, a.attempt, EXISTS (SELECT 1 FROM rollout_finished f WHERE "
            "f.group_id = a.group_id AND f.generation_index = a.generation_index AND f.attempt > a.attempt) "
            "FROM attempt_abandoned a WHERE a.reason = ?", (reason,)).fetchall()


def ledger_abandons(run_dir: Path, reason: str) -> set[tuple]:
    """The attempts abandoned for `reason` that the live store still holds (groups in flight)."""
    with contextlib.closing(sqlite3.connect(f"file:{run_dir / 'rollout_state.sqlite'}?mode=ro", uri=True)) as conn:
        return set(conn.execute("SELECT group_id, generation_index, attempt FROM rollouts "
                                "WHERE state = 'abandoned' AND abandon_reason = ?", (reason,)))


@pytest.fixture(scope="module")
def cluster():
    """A cluster this test process starts; the runs join it (`cluster.address`), so the
    test can find their workers and kill them."""
    temp = short_temp_dir()
    # Logical CPUs: two engine and two environment workers each reserve one (on 2 cores).
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
    assert not no_ray_processes_left(temp)


def worker(slot: int, generation: int, kind: str = "engine"):
    """The run's `kind` ("engine" or "env") worker actor of `slot` (its `generation`-th),
    once it exists."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and a["name"].startswith(f"{kind}-")
             and a["name"].endswith(f"-w{slot}.{generation}")]
    return ray.get_actor(names[0], namespace=NAMESPACE) if names else None


def busy(slot: int, generation: int = 0):
    """The worker once it runs a call that has decoded a token (mid-rollout), else None."""
    actor = worker(slot, generation)
    try:
        return actor if actor is not None and any(ray.get(actor.running_tokens.remote(), timeout=5).values()) else None
    except (ray.exceptions.RayError, TimeoutError):
        return None


@pytest.mark.slow  # 3-4 min each (a long run outlasting a replacement's start); the pools' kill tests are the default tier
@pytest.mark.timeout(600)
def test_engine_workers_killed_mid_rollout_have_their_attempts_abandoned_as_error_and_redone(tmp_path, cluster):
    run_dir = tmp_path / "run"
    # Long enough for a replacement to be placed and take calls: until it answers, calls go
    # to the other worker (gpu_capture/ray_slots.py), and 12 steps ended first.
    proc = train_cli.start(run_dir, overrides=[*RAY, f"cluster.address={cluster}", "algorithm.total_steps=300"])
    try:
        # Worker 0 by ray.kill while it decodes.
        ray.kill(wait_until(lambda: busy(0) if proc.poll() is None else True, timeout=240))
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        # Its replacement comes up and serves; then worker 1's process is SIGKILLed while it decodes.
        wait_until(lambda: busy(0, 1) or proc.poll() is not None, timeout=240)
        victim = wait_until(lambda: busy(1) or proc.poll() is not None, timeout=240)
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the second kill: " \
                                    f"{proc.communicate()[1][-2000:]}"
        os.kill(ray.get(victim.describe.remote())["pid"], signal.SIGKILL)
        wait_until(lambda: worker(1, 1) or proc.poll() is not None, timeout=60)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    lost = abandoned(run_dir, "error")
    assert len(lost) >= 2, lost  # one kill at least each, mid-call
    assert all(redone for *_, redone in lost), lost  # every one started again and finished
    assert ledger_abandons(run_dir, "error") <= {(g, i, a) for g, i, a, _ in lost}  # the ledger agrees
    verified = train_cli.verify(run_dir)
    assert verified.returncode == 0 and "duplicated=0 lost=0" in verified.stdout, verified.stdout + verified.stderr


def serving(slot: int, generation: int):
    """The run's environment worker once its environment is built (it answers), else None."""
    actor = worker(slot, generation, "env")
    try:
        return actor if actor is not None and ray.get(actor.describe.remote(), timeout=5) else None
    except (ray.exceptions.RayError, TimeoutError):
        return None


@pytest.mark.slow  # 3-4 min each (a long run outlasting a replacement's start); the pools' kill tests are the default tier
@pytest.mark.timeout(600)
def test_environment_workers_killed_mid_run_have_their_attempts_abandoned_as_error_and_the_run_verifies(
        tmp_path, cluster):
    """The multi-turn task at turn level, its steps on two environment workers: worker 0
    (which takes most steps: least loaded, ties to the lowest index) by ray.kill, then its
    replacement's process by SIGKILL, each once it serves."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "rolloutdb", "train", "--config", str(TURN_LEVEL.example), "--run-dir",
               str(run_dir), *TURN_LEVEL.overrides, *RAY, "cluster.environment_workers=2",
               f"cluster.address={cluster}", "algorithm.total_steps=200"]
    proc = subprocess.Popen(command, env=train_cli.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = wait_until(lambda: serving(0, 0) if proc.poll() is None else True, timeout=240)
        time.sleep(1.0)  # steps flow
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        ray.kill(first)
        second = wait_until(lambda: serving(0, 1) if proc.poll() is None else True, timeout=240)
        time.sleep(1.0)
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the second kill: " \
                                    f"{proc.communicate()[1][-2000:]}"
        os.kill(ray.get(second.describe.remote())["pid"], signal.SIGKILL)
        wait_until(lambda: worker(0, 2, "env") or proc.poll() is not None, timeout=60)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    lost = abandoned(run_dir, "error")
    assert len(lost) >= 2, lost  # each kill's next step failed at least
    assert all(redone for *_, redone in lost), lost  # every one started again and finished
    assert ledger_abandons(run_dir, "error") <= {(g, i, a) for g, i, a, _ in lost}
    verified = train_cli.verify(run_dir)
    assert verified.returncode == 0 and "duplicated=0 lost=0" in verified.stdout, verified.stdout + verified.stderr


@pytest.mark.timeout(900)
def test_a_sigkilled_driver_takes_its_local_cluster_with_it_and_resumes_on_a_fresh_one(tmp_path, monkeypatch):
    temp = short_temp_dir()
    monkeypatch.setenv("RAY_TMPDIR", temp)  # the harness's runs inherit it
    run_dir = tmp_path / "run"
    result = ChainResult(config=GROUP_LEVEL, overrides=RAY)
    assert run_once(run_dir, result, kill_after=0.3) == -signal.SIGKILL, result.problems
    # Ray's agents outlived a SIGKILLed driver by about a minute without the guard.
    assert not no_ray_processes_left(temp, within=10.0)
    finish(run_dir, result)  # --resume, on a fresh local cluster, to the end
    assert result.finished, result.problems
    check_chain(run_dir, result)  # verify_run, the restore used, exactly-once over the chain
    assert not result.problems, result.problems
    assert not no_ray_processes_left(temp)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_prefix_level_run_stopped_on_two_workers_continues_its_cut_calls_on_one(tmp_path, monkeypatch):
    """Restore hands the saved calls to whichever workers exist now (measured: 20 calls
    continued from 96 saved tokens; about 95 s, hence `slow`)."""
    monkeypatch.setenv("RAY_TMPDIR", short_temp_dir())
    run_dir = tmp_path / "run"
    result = ChainResult(config=PREFIX_LEVEL, overrides=RAY)
    assert run_once(run_dir, result, kill_after=1.0) == -signal.SIGKILL, result.problems
    result.overrides = ["cluster.backend=ray", "cluster.engine_workers=1"]
    finish(run_dir, result)
    assert result.finished, result.problems
    check_chain(run_dir, result)
    assert not result.problems, result.problems
    trace = run_dir / "logs" / "rollout_trace.sqlite"
    with contextlib.closing(sqlite3.connect(f"file:{trace}?mode=ro", uri=True)) as conn:
        continued = conn.execute("SELECT count(*) FROM attempt_dispatched WHERE prefix_tokens > 0").fetchone()[0]
    assert continued > 0  # the kill landed while calls ran: some continued from their prefixes
