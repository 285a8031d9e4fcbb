"""Environment workers on Ray (controller/rollout/ray_environments.py) against real actors on a
real local Ray cluster: one cluster and one two-worker pool for the module, built from a
multi-turn run config. Expected turns come from an environment instance built here with
the task builder, stepped with its own `step` and `score`, never from the pool.

The kill tests come last: they change the pool's workers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rolloutdb.config import Config
from rolloutdb.controller.job.build import build_env_stepper
from rolloutdb.controller.tasks.registry import build_task, check_plugins
from rolloutdb.controller.rollout.env_steps import EnvironmentWorkerLost, LocalStepper
from rolloutdb.gpu_capture import build_tiny_policy
from rolloutdb.gpu_capture.protocol import WorkerLost

ray = pytest.importorskip("ray")

from rolloutdb.controller.rollout.ray_environments import EnvironmentWorkerPool  # noqa: E402
from test_ray_workers import HANG_S, ray_processes, short_temp_dir  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # HANG_S per wait: hang detectors, not speed tests

TURNS = 3


@pytest.fixture(scope="module")
def cluster():
    temp = short_temp_dir()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    yield temp
    ray.shutdown()
    deadline = time.monotonic() + 120  # a hang detector (workers outlived 60 s once under load)
    while ray_processes(temp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_processes(temp)


@pytest.fixture(scope="module")
def config():
    return Config.model_validate({"environment": {"task": "digits", "turns": TURNS, "n_digits": 3},
                                  "generation": {"max_tokens": 4}, "cluster": {"backend": "ray",
                                                                               "environment_workers": 2}})


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, config):
    from rolloutdb.controller.tasks.digits import TASK_ALPHABET

    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "p", seed=3, alphabet=TASK_ALPHABET)


@pytest.fixture(scope="module")
def env(config, policy_dir):
    return build_task(config, policy_dir, check_plugins(config))[1]


@pytest.fixture(scope="module")
def pool(cluster, config, policy_dir):
    stepper = build_env_stepper(config, None, policy_dir)  # the run's builder: workers, as configured
    assert isinstance(stepper, EnvironmentWorkerPool)
    with stepper:
        yield stepper


def replies(env, n: int) -> list[tuple[dict, list[int], bool]]:
    """(state, reply, last) for `n` episodes' turns: right and wrong answers, every turn
    index, from states reached with the local environment."""
    cases = []
    codec = env.codec
    for prompt_id in range(n):
        _, state = env.start(prompt_id)
        for turn in range(TURNS):
            target = state["targets"][turn]
            reply = codec.encode(target if (prompt_id + turn) % 2 == 0 else "9" * len(target))
            cases.append((state, reply, turn + 1 >= TURNS))
            turn_out, state = env.step(state, reply)
            if turn_out.done:
                break
    return cases


def expected(env, state: dict, reply: list[int], last: bool) -> tuple:
    turn, new_state = env.step(state, reply)
    ends = turn.done or last
    return new_state, ([] if ends else list(turn.observation_ids)), (float(env.score(new_state)) if ends else None)


def outcome(step) -> tuple:
    return step.state, step.observation_ids, step.reward


def test_steps_through_workers_equal_the_environments_own_steps(pool, env):
    cases = replies(env, 6)
    futures = [pool.step(state, reply, last=last) for state, reply, last in cases]
    got = [outcome(f.result(timeout=HANG_S)) for f in futures]
    assert got == [expected(env, *case) for case in cases]
    assert any(r is not None and r > 0 for _, _, r in got) and any(obs for _, obs, _ in got)  # both kinds of turn
    assert pool.load_per_worker() == [0, 0]


def test_the_in_driver_stepper_answers_at_once_with_the_same_steps(env):
    cases = replies(env, 3)
    futures = [LocalStepper(env).step(state, reply, last=last) for state, reply, last in cases]
    assert all(f.done() for f in futures)
    assert [outcome(f.result()) for f in futures] == [expected(env, *case) for case in cases]


def test_an_environment_error_fails_its_step_with_that_error_and_the_worker_serves_on(pool, env):
    _, state = env.start(0)
    done_state = dict(state, done=True)
    with pytest.raises(ValueError, match="episode already finished"):
        pool.step(done_state, [1], last=False).result(timeout=HANG_S)
    state, reply, last = replies(env, 1)[0]
    assert outcome(pool.step(state, reply, last=last).result(timeout=HANG_S)) == expected(env, state, reply, last)
    assert pool.replacements == 0


def _next_step_is_served_by_a_replacement(pool, env, slot: int, old_pid: int) -> None:
    state, reply, last = replies(env, 1)[0]
    assert outcome(pool.step(state, reply, last=last).result(timeout=HANG_S)) == expected(env, state, reply, last)
    pids = pool.worker_pids()
    assert pids[slot] != old_pid and old_pid not in pids


def _wait_until_dead(actor) -> None:
    """`ray.kill` returns before the actor is down: a step sent at once can still be served
    by it (a fresh-clone CI run saw exactly that). Call it directly, outside the pool, until
    Ray says it died."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        try:
            ray.get(actor.describe.remote(), timeout=HANG_S)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"ray.kill did not take the worker down in {HANG_S} s")


def test_a_worker_killed_with_ray_kill_fails_the_step_sent_to_it_and_the_next_runs_on_a_replacement(pool, env):
    pids = pool.worker_pids()
    ray.kill(pool.workers()[0])
    _wait_until_dead(pool.workers()[0])
    state, reply, last = replies(env, 1)[0]
    future = pool.step(state, reply, last=last)  # least loaded, ties to the lowest index: worker 0
    with pytest.raises(EnvironmentWorkerLost, match="environment worker 0 is gone") as lost:
        future.result(timeout=HANG_S)
    assert isinstance(lost.value, WorkerLost)  # the pump's one rule for lost workers
    _next_step_is_served_by_a_replacement(pool, env, 0, pids[0])


def test_a_worker_sigkilled_mid_step_fails_that_step_and_the_next_runs_on_a_replacement(pool, env):
    pids = pool.worker_pids()
    os.kill(pids[0], signal.SIGSTOP)  # the step cannot finish before the kill: it is in flight
    try:
        state, reply, last = replies(env, 1)[0]
        future = pool.step(state, reply, last=last)
        time.sleep(0.5)
        assert not future.done() and pool.load_per_worker()[0] == 1
    finally:
        os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(EnvironmentWorkerLost, match="environment worker 0 is gone"):
        future.result(timeout=HANG_S)
    _next_step_is_served_by_a_replacement(pool, env, 0, pids[0])
    assert pool.replacements == 2


def test_environment_workers_are_refused_without_ray_and_with_agent_servers():
    with pytest.raises(ValueError, match="environment_workers: 2 needs cluster.backend: ray"):
        Config.model_validate({"cluster": {"environment_workers": 2}})
    servers = {"servers": [{"name": "a"}]}
    with pytest.raises(ValueError, match="agent servers .* own processes"):
        Config.model_validate({"environment": servers, "cluster": {"backend": "ray", "environment_workers": 1}})


def test_a_slot_whose_worker_keeps_dying_is_given_up_and_then_steps_are_refused_with_why(cluster, config, policy_dir,
                                                                                          env):
    from rolloutdb.gpu_capture.ray_workers import MAX_DEATHS_IN_A_ROW

    # worker_cpus=0: the module's pool holds the cluster's two CPUs.
    with EnvironmentWorkerPool(config, policy_dir, workers=1, worker_cpus=0) as own:
        state, reply, last = replies(env, 1)[0]
        for _ in range(MAX_DEATHS_IN_A_ROW + 1):  # each replacement killed before it finishes a step
            # Killed only once placed: the pool watches a new worker until it answers, and a
            # worker killed before that is replaced by the pool's own watch, so the step then
            # ran on the next one (a fresh-clone CI run on 1fb4e82: DID NOT RAISE).
            deadline = time.monotonic() + 180  # a hang detector: placing a worker took >60 s under load
            while own.worker_nodes()[0] is None:
                assert time.monotonic() < deadline, "the replacement worker was never placed"
                time.sleep(0.02)
            victim = own.workers()[0]
            ray.kill(victim)
            _wait_until_dead(victim)  # else the step can be served by the dying worker (a fresh-clone CI run did)
            with pytest.raises(EnvironmentWorkerLost):
                own.step(state, reply, last=last).result(timeout=HANG_S)
            # The step's future fails before the pool has put the replacement in the slot:
            # without this wait the next kill could hit the dead actor again, and the next
            # step then ran on the fresh replacement (seen once in a full run: DID NOT RAISE).
            deadline = time.monotonic() + 60
            while own.workers()[0] is victim:
                assert time.monotonic() < deadline, "the dead worker was never replaced or given up"
                time.sleep(0.02)
        assert own.workers() == [None]
        with pytest.raises(RuntimeError, match=f"environment worker 0 died {MAX_DEATHS_IN_A_ROW + 1} times in a row"):
            own.step(state, reply, last=last)
