"""Losing a machine, not a run: Ray clusters of several nodes on this machine
(`ray.cluster_utils.Cluster`: each node its own raylet, object store and CPUs), a node
removed while its workers decode (`Cluster.remove_node`: every worker on it dies at once)
and another one added (`Cluster.add_node`). The head node offers no CPU, so it hosts no
worker: the drivers (this process, a `rolloutdb train` subprocess) join it, and a worker
node of one CPU per worker kind holds exactly one worker of each.

The pool test (default tier, about a minute on 2 cores) drives a `RayEnginePool` in this
process; the real run (`slow`, several minutes: three raylets, six workers each importing
torch, a run long enough to outlast a node's return) is `rolloutdb train` with engine and
environment workers spread over two nodes:
    python -m pytest -q -n 0 -m slow tests/test_ray_nodes.py
No Ray process may outlive a test."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import pytest

ray = pytest.importorskip("ray")

import train_cli  # noqa: E402
from crash_harness import TURN_LEVEL  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from test_ray_real_run import abandoned, busy, ledger_abandons, no_ray_processes_left  # noqa: E402
from test_ray_workers import long_req, perturbed, req, short_temp_dir, wait_until  # noqa: E402

from rolloutdb.config import Config  # noqa: E402
from rolloutdb.controller.job.build import build_local_engine  # noqa: E402
from rolloutdb.gpu_capture import ReferenceEngine, build_tiny_policy  # noqa: E402
from rolloutdb.gpu_capture.protocol import EngineWorkerLost  # noqa: E402
from rolloutdb.gpu_capture.ray_workers import NAMESPACE, RayEnginePool  # noqa: E402


def start_cluster(monkeypatch, worker_nodes: int, cpus_per_node: int):
    """(cluster, its worker nodes, Ray's temp dir): a head without CPUs, joined by this
    process, and `worker_nodes` nodes of `cpus_per_node` CPUs each. Cluster writes the
    cluster's address under $RAY_TMPDIR/ray, so that is where all of Ray's files go (and
    the runs' processes inherit it)."""
    base = short_temp_dir()
    monkeypatch.setenv("RAY_TMPDIR", base)
    temp = os.path.join(base, "ray")
    os.mkdir(temp)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "temp_dir": temp,
                                                            "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=cpus_per_node) for _ in range(worker_nodes)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster, nodes, temp


def stop_cluster(cluster, temp: str) -> None:
    ray.shutdown()
    cluster.shutdown()
    assert not no_ray_processes_left(temp, within=60.0)


@pytest.fixture
def policy_dir(tmp_path):
    return build_tiny_policy(tmp_path / "policy", seed=3)


@pytest.mark.timeout(600)
def test_a_node_that_leaves_takes_its_worker_the_pool_serves_on_the_node_left_and_a_node_that_joins_serves_again(
        policy_dir, monkeypatch):
    cluster, (kept_node, lost_node), temp = start_cluster(monkeypatch, 2, 1)
    try:
        config = Config.model_validate({"generation": {"max_batch_size": 8}})
        with RayEnginePool(partial(build_local_engine, config, policy_dir), workers=2) as pool:
            placed = pool.worker_nodes()
            assert sorted(placed) == sorted([kept_node.node_id, lost_node.node_id])  # one worker on each node
            gone, kept = placed.index(lost_node.node_id), placed.index(kept_node.node_id)
            kept_pid = pool.worker_pids()[kept]
            # A long call on each worker (least loaded, ties to the lowest index: call i on slot i).
            futures = [pool.submit(long_req(f"node{i}", i)) for i in range(2)]
            wait_until(lambda: len(pool.running_tokens()) == 2 and all(len(t) >= 2 for t in pool.running_tokens().values()))
            victim = pool.workers()[gone]
            cluster.remove_node(lost_node)
            with pytest.raises(EngineWorkerLost, match=f"engine worker {gone} is gone"):
                futures[gone].result(timeout=120)
            wait_until(lambda: pool.workers()[gone] is not victim, timeout=60)  # its replacement exists...
            assert pool.worker_nodes()[gone] is None  # ...and waits: no node has a CPU for it
            # The node loss is not the worker's fault: the slot is not one death closer to being given up.
            assert (pool.replacements, pool.node_losses) == (1, 1)
            # Calls, cuts and refits go on with the worker left; none waits for the slot without a node.
            short = [pool.submit(req(f"left{i}", i, 4, temperature=0.0)) for i in range(4)]
            assert {f.result(timeout=60).extra["worker_pid"] for f in short} == {kept_pid}
            cut = pool.submit(long_req("cut", 5))
            wait_until(lambda: len(pool.running_tokens().get("cut", [])) >= 2)
            assert "cut" in pool.running_calls()
            with ReferenceEngine(policy_dir, max_batch_size=8, num_threads=1) as fresh:
                state = perturbed(fresh, 0.5)
                pool.load_weights(state, 3)
                fresh.load_weights(state, 3)
                pool.abort([f"node{kept}", "cut"])
                futures[kept].result(timeout=120), cut.result(timeout=120)
                assert pool.worker_nodes()[gone] is None
                # A node joins: the waiting replacement lands on it, with the refit it missed.
                joined = cluster.add_node(num_cpus=1)
                wait_until(lambda: pool.worker_nodes()[gone] == joined.node_id, timeout=240)
                both = [req(f"back{i}", i, 6, temperature=0.0) for i in range(2)]
                got = [f.result(timeout=120) for f in [pool.submit(r) for r in both]]  # one on each worker
                expected = [fresh.submit(r).result(timeout=60) for r in both]
            replacement_pid = pool.worker_pids()[gone]
            assert {g.extra["worker_pid"] for g in got} == {kept_pid, replacement_pid}
            for g, e in zip(got, expected):
                assert g.token_ids == e.token_ids and g.token_versions == [3] * len(g.token_ids)
            assert pool.replacements == 1  # it waited for a node, never dying meanwhile
    finally:
        stop_cluster(cluster, temp)


def newest(kind: str, slot: int):
    """The run's newest `kind` ("engine" or "env") worker actor of `slot`, and its generation."""
    found = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        name = a["name"]
        if a["namespace"] == NAMESPACE and name.startswith(f"{kind}-") and f"-w{slot}." in name:
            found.append((int(name.rsplit(".", 1)[1]), name))
    if not found:
        return None, -1
    generation, name = max(found)
    return ray.get_actor(name, namespace=NAMESPACE), generation


def described(kind: str, slot: int) -> dict | None:
    """The newest worker's `describe` (pid, node_id, served), None while it is not placed."""
    try:
        actor, generation = newest(kind, slot)
        return {**ray.get(actor.describe.remote(), timeout=5), "generation": generation} if actor else None
    except (ray.exceptions.RayError, TimeoutError, ValueError):  # ValueError: it died after the listing
        return None


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_run_that_loses_a_node_mid_rollout_redoes_its_attempts_on_the_node_left_and_serves_on_a_node_that_joins(
        tmp_path, monkeypatch):
    """The multi-turn task at turn level on two engine and two environment workers, one of
    each on each worker node (cluster.worker_placement: spread). The node holding engine
    worker 1 is removed while both engine workers decode; the run must train on with the
    node left before a node joins, then the replacements land on the new node and serve."""
    cluster, (kept_node, lost_node), temp = start_cluster(monkeypatch, 2, 2)
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "rolloutdb", "train", "--config", str(TURN_LEVEL.example), "--run-dir",
               str(run_dir), *TURN_LEVEL.overrides, "cluster.backend=ray", "cluster.engine_workers=2",
               "cluster.environment_workers=2", f"cluster.address={cluster.address}", "algorithm.total_steps=150"]
    proc = subprocess.Popen(command, env=train_cli.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (busy(0) and busy(1)) if proc.poll() is None else True, timeout=300)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        before = {(kind, slot): described(kind, slot) for kind in ("engine", "env") for slot in (0, 1)}
        for kind in ("engine", "env"):  # spread: one worker of each kind on each node
            assert {before[kind, 0]["node_id"], before[kind, 1]["node_id"]} == {kept_node.node_id, lost_node.node_id}
        lost = {kind: next(s for s in (0, 1) if before[kind, s]["node_id"] == lost_node.node_id)
                for kind in ("engine", "env")}
        steps = len(train_cli.metrics(run_dir, "train_step"))
        cluster.remove_node(lost_node)
        # The run trains on with the node left, and the attempts the lost workers held,
        # abandoned with reason error, are redone there (the trace: a later attempt finished).
        def redone_on_the_node_left() -> bool:
            lost_attempts = abandoned(run_dir, "error")
            return len(train_cli.metrics(run_dir, "train_step")) >= steps + 3 and bool(lost_attempts) \
                and all(r for *_, r in lost_attempts)

        wait_until(lambda: redone_on_the_node_left() or proc.poll() is not None, timeout=180, every=0.5)
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) with a node gone: " \
                                    f"{proc.communicate()[1][-3000:]}"
        for kind in ("engine", "env"):  # the node left kept its workers
            now = described(kind, 1 - lost[kind])
            assert now is not None and now["pid"] == before[kind, 1 - lost[kind]]["pid"]
        joined = cluster.add_node(num_cpus=2)

        def serving_on_the_joined_node():
            found = [described(kind, lost[kind]) for kind in ("engine", "env")]
            return all(d and d["node_id"] == joined.node_id and d["served"] > 0 for d in found)

        wait_until(lambda: serving_on_the_joined_node() or proc.poll() is not None, timeout=300)
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the joined node served: " \
                                    f"{proc.communicate()[1][-2000:]}"
        assert all(described(kind, lost[kind])["generation"] == 1 for kind in ("engine", "env"))  # one replacement each
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stop_cluster(cluster, temp)
    assert proc.returncode == 0, err[-3000:]
    redone = abandoned(run_dir, "error")
    assert redone, "no attempt was running on the lost node"
    assert all(r for *_, r in redone), redone  # every one started again and finished
    assert ledger_abandons(run_dir, "error") <= {(g, i, a) for g, i, a, _ in redone}
    verified = train_cli.verify(run_dir)
    assert verified.returncode == 0 and "duplicated=0 lost=0" in verified.stdout, verified.stdout + verified.stderr
