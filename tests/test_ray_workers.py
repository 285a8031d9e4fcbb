"""Engine workers on Ray (gpu_capture/ray_workers.py) against real actors on a real local
Ray cluster: one cluster and one two-worker pool for the module (ray.init took 2.3-4.5 s,
each worker's engine build a few seconds). Expected outputs come from an in-process
reference engine on the same policy, never from the pool.

The tests run in order: the refit and the kill tests change the pool's weights and
workers, so they come last."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from rolloutdb.config import Config
from rolloutdb.controller.job.build import build_local_engine
from rolloutdb.gpu_capture import GenerationRequest, ReferenceEngine, SamplingParams, build_tiny_policy
from rolloutdb.gpu_capture.protocol import EngineWorkerLost, GenerationEngine, PrefixCapture

ray = pytest.importorskip("ray")

from rolloutdb.gpu_capture.ray_workers import EngineWorker, RayEnginePool, import_ray  # noqa: E402


def short_temp_dir() -> str:
    """Ray's files for one test: a short path under /tmp (Ray's socket paths must stay
    under the 107-byte limit of AF_UNIX, which pytest's tmp_path would pass)."""
    return tempfile.mkdtemp(prefix="ray", dir="/tmp")


def ray_processes(temp_dir: str) -> list[str]:
    """Processes (not this one) whose command line or open files name `temp_dir`: the GCS,
    the raylet, its agents (they retitle themselves but keep their logs open) and workers."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            links = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        if temp_dir in cmdline or any(link.startswith(temp_dir) for link in links):
            found.append(f"{proc.name}: {cmdline[:80]}")
    return found


# Hang detectors, not speed tests: a replacement actor starts in seconds on an idle machine
# and took past 60 s beside two CPU-bound processes (8 errors and a failure, 2026-12-02).
HANG_S = 240
pytestmark = pytest.mark.timeout(900)


def wait_until(predicate, timeout: float = HANG_S, every: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s")


@pytest.fixture(scope="module")
def cluster():
    temp = short_temp_dir()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
    yield temp
    ray.shutdown()
    deadline = time.monotonic() + 60
    while ray_processes(temp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_processes(temp)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "p", seed=3)


@pytest.fixture(scope="module")
def config():
    return Config.model_validate({"generation": {"max_batch_size": 8}})


@pytest.fixture(scope="module")
def pool(cluster, policy_dir, config):
    with RayEnginePool(partial(build_local_engine, config, policy_dir), workers=2) as p:
        yield p


@pytest.fixture(scope="module")
def local(policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=8, num_threads=1) as eng:
        yield eng


def req(rid: str, n: int, max_tokens: int = 12, **params) -> GenerationRequest:
    return GenerationRequest(rid, [1, 4 + n % 7, 5 + n % 5, 9], SamplingParams(max_tokens, **params))


def long_req(rid: str, n: int = 0) -> GenerationRequest:
    """A call that runs a while: 240 tokens, no early end."""
    return req(rid, n, 240, min_tokens=240, temperature=0.0)


def test_the_pool_is_one_engine_with_prefix_capture(pool):
    assert isinstance(pool, GenerationEngine) and isinstance(pool, PrefixCapture)


def test_a_pool_call_decodes_what_the_in_process_reference_engine_decodes(pool, local):
    requests = [req(f"eq{i}", i, temperature=0.0) for i in range(3)] + \
               [req(f"eqs{i}", i, temperature=1.0, seed=11 + i) for i in range(3)]
    got = [f.result(timeout=HANG_S) for f in [pool.submit(r) for r in requests]]
    expected = [f.result(timeout=HANG_S) for f in [local.submit(r) for r in requests]]
    assert len({g.extra["worker_pid"] for g in got}) == 2  # both workers served some
    for g, e in zip(got, expected):
        assert (g.request_id, g.token_ids, g.logprobs, g.token_versions, g.finish_reason) == \
               (e.request_id, e.token_ids, e.logprobs, e.token_versions, e.finish_reason)


def test_a_bad_request_is_refused_at_submit_before_any_worker_sees_it(pool):
    with pytest.raises(ValueError, match="max_tokens"):
        pool.submit(req("bad", 0, 0))
    with pytest.raises(ValueError, match="token ids"):
        pool.submit(GenerationRequest("bad2", [10**6], SamplingParams(3)))
    assert pool.load_per_worker() == [0, 0]


def test_calls_go_to_the_worker_with_the_fewest_calls_in_progress(pool):
    # One long call holds a worker; every short call after it goes to the other one
    # (round robin would send every second short call behind the long one).
    long_call = pool.submit(long_req("lr-long"))
    wait_until(lambda: pool.running_tokens().get("lr-long"))
    busy = [pid for pid, a in zip(pool.worker_pids(), pool.workers())
            if "lr-long" in ray.get(a.running_tokens.remote())]
    shorts = []
    for i in range(4):
        shorts.append(pool.submit(req(f"lr{i}", i, 3)).result(timeout=HANG_S))
    assert not long_call.done(), "the long call ended before the short ones: the test proves nothing"
    assert {r.extra["worker_pid"] for r in shorts} == set(pool.worker_pids()) - set(busy)
    pool.abort(["lr-long"])
    assert long_call.result(timeout=HANG_S).finish_reason == "abort"


def test_an_aborted_call_ends_with_abort_and_the_tokens_it_had(pool, local):
    future = pool.submit(long_req("ab", 2))
    wait_until(lambda: len(pool.running_tokens().get("ab", [])) >= 3)
    pool.abort(["ab", "nobody"])
    result = future.result(timeout=HANG_S)
    assert result.finish_reason == "abort" and 3 <= len(result.token_ids) < 240
    uninterrupted = local.submit(long_req("ab-local", 2)).result(timeout=HANG_S)
    assert result.token_ids == uninterrupted.token_ids[: len(result.token_ids)]


def test_running_calls_gathers_the_calls_of_every_worker_in_one_cut(pool, local):
    futures = [pool.submit(long_req(f"rc{i}", i)) for i in range(4)]
    def both_decoding():
        per_worker = [ray.get(a.running_tokens.remote()) for a in pool.workers()]
        return all(len(w) == 2 and all(len(t) >= 2 for t in w.values()) for w in per_worker)

    wait_until(both_decoding)  # two calls on each worker: the gather really spans two workers
    calls = pool.running_calls()
    rows = pool.decoded_rows
    pool.abort([f"rc{i}" for i in range(4)])
    results = {f.result(timeout=HANG_S).request_id: f.result() for f in futures}
    assert set(calls) == set(results)
    for rid, call in calls.items():
        final = results[rid]
        n = len(call.token_ids)
        assert n >= 2 and call.token_ids == final.token_ids[:n] and call.logprobs == final.logprobs[:n]
        assert (call.max_tokens, call.min_tokens, call.cut_refused) == (240, 240, None)
    assert rows >= sum(len(c.token_ids) for c in calls.values())
    assert 0 < pool.cut_hold_s < pool.gather_s  # a worker's own hold, inside the gather's wall time


def test_a_call_finished_in_its_worker_stays_in_the_cut_until_the_driver_acknowledges_it(policy_dir, config):
    import asyncio

    worker = EngineWorker(partial(build_local_engine, config, policy_dir), None, 0)  # the actor body, in process
    try:
        result = asyncio.run(worker.generate(req("ack", 1, 5, temperature=0.0), []))
        calls, _, _ = asyncio.run(worker.running_calls([]))
        assert calls["ack"].token_ids == result.token_ids and calls["ack"].logprobs == result.logprobs
        calls, _, _ = asyncio.run(worker.running_calls(["ack"]))
        assert calls == {}
    finally:
        worker.engine.close()


class GreedyOnlyEngine(ReferenceEngine):
    """A reference engine that refuses to cut non-greedy calls, as vLLM 0.32 does
    (gpu_capture/vllm_engine.py): a verdict that depends on the call's params."""

    def cut_support(self, request: GenerationRequest) -> str | None:
        return None if request.params.temperature == 0.0 else "non-greedy (test engine)"


def greedy_only_engine(policy_dir: Path) -> GreedyOnlyEngine:
    return GreedyOnlyEngine(policy_dir, max_batch_size=8, num_threads=1)


def test_the_pool_asks_a_worker_for_a_cut_verdict_once_per_kind_of_call_and_answers_the_engines_verdict(
        cluster, policy_dir):
    # The workers cannot import this test module: its class travels by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    # worker_cpus=0: the module's pool holds the cluster's two CPUs.
    with contextlib.ExitStack() as stack:
        stack.callback(ray.cloudpickle.unregister_pickle_by_value, sys.modules[__name__])
        own = stack.enter_context(RayEnginePool(partial(greedy_only_engine, policy_dir), workers=1, worker_cpus=0))
        sampled = [req(f"cs{i}", i, temperature=1.0, seed=100 + i, stop=["x"]) for i in range(6)]
        greedy = [req(f"cg{i}", i, temperature=0.0, stop=("x",)) for i in range(6)]
        verdicts = [own.cut_support(r) for r in sampled + greedy]
        asks = own.cut_support_asks
        # Each call of a run has its own seed (call_seed): one ask per kind of call all the same.
        assert verdicts == ["non-greedy (test engine)"] * 6 + [None] * 6
        assert asks == 2
        assert own.cut_support(req("cs-unseeded", 0, temperature=1.0, stop=["x"])) == "non-greedy (test engine)"
        assert own.cut_support_asks == 3  # seeded or not is part of the key


def perturbed(local_engine, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {name: p.detach() + scale * torch.randn(p.shape, generator=g)
            for name, p in local_engine.model.named_parameters()}


def test_a_refit_reaches_every_worker_and_tags_the_tokens_decoded_after_it(pool, policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=8, num_threads=1) as fresh:
        state = perturbed(fresh, 0.5)
        pool.load_weights(state, 7)
        fresh.load_weights(state, 7)
        assert pool.policy_version == 7
        requests = [req(f"rf{i}", i, 10, temperature=0.0) for i in range(4)]
        got = [f.result(timeout=HANG_S) for f in [pool.submit(r) for r in requests]]
        expected = [f.result(timeout=HANG_S) for f in [fresh.submit(r) for r in requests]]
    assert len({g.extra["worker_pid"] for g in got}) == 2
    for g, e in zip(got, expected):
        assert g.token_versions == [7] * len(g.token_ids)
        assert g.token_ids == e.token_ids and g.logprobs == e.logprobs


def _killed_worker_is_replaced(pool, policy_dir, kill) -> None:
    pids = pool.worker_pids()
    victim_future = pool.submit(long_req("kill-victim", 3))
    wait_until(lambda: pool.running_tokens().get("kill-victim"))
    slot = next(i for i, a in enumerate(pool.workers()) if "kill-victim" in ray.get(a.running_tokens.remote()))
    kill(pool.workers()[slot], pids[slot])
    with pytest.raises(EngineWorkerLost, match=f"engine worker {slot} is gone"):
        victim_future.result(timeout=HANG_S)
    new_pids = pool.worker_pids()
    assert new_pids[slot] != pids[slot] and new_pids[1 - slot] == pids[1 - slot]
    wait_until(lambda: all(pool.worker_nodes()))  # routed to once placed (gpu_capture/ray_slots.py)
    # The replacement runs the current weights at the current version: the same tokens
    # as an in-process engine given the refit, tagged 7.
    with ReferenceEngine(policy_dir, max_batch_size=8, num_threads=1) as fresh:
        fresh.load_weights(perturbed(fresh, 0.5), 7)
        futures = [pool.submit(req(f"after{kill.__name__}{i}", i, 6, temperature=0.0)) for i in range(4)]
        got = [f.result(timeout=HANG_S) for f in futures]
        expected = [fresh.submit(req(f"after{kill.__name__}{i}", i, 6, temperature=0.0)).result(timeout=HANG_S)
                    for i in range(4)]
    assert new_pids[slot] in {g.extra["worker_pid"] for g in got}
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids and g.token_versions == [7] * len(g.token_ids)


def test_a_worker_killed_with_ray_kill_fails_its_calls_with_engine_worker_lost_and_is_replaced(pool, policy_dir):
    # (A worker process SIGKILLed is the other kill: tests/test_ray_real_run.py, through a real run.)
    def ray_kill(actor, pid):
        ray.kill(actor)

    _killed_worker_is_replaced(pool, policy_dir, ray_kill)


def test_without_ray_installed_the_pool_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ValueError, match=r"pip install -e '\.\[ray\]'"):
        import_ray()
