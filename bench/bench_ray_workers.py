"""Engine workers on Ray beside the in-process engine, in one run (docs/ray.md):

1. tokens/s on the long-tail workload: the reference engine in this process, then a
   `RayEnginePool` with 1 and with 2 workers, the same calls in the same order (reply
   lengths from `LongTailDigitDataset`: P(L >= k) ~ k^-1.2, up to `--max-digits`, every
   call forced to its length with min_tokens), `--inflight` calls in flight, a new one
   submitted as each finishes (the rollout pump's pattern). On a machine with 2 cores
   the 2-worker ratio is bounded by the cores: the driver, Ray and both workers share them.
2. the cut at prefix level: `running_calls()` every `--cut-every` s during (1). The hold
   (`cut_hold_s`: how long an output step waited; for the pool the longest worker's own)
   and the cut's wall time (in process: the wait for the step in progress and the copy;
   the pool: the gather across workers, round trip included), each side by side.
3. Ray's per-call overhead on the pump: one 1-token call at a time, in process vs pool.
4. The environment-step round trip (`cluster.environment_workers`): one step of the
   multi-turn digit task at a time (scored when it ends the episode, as the pump asks),
   through the in-driver stepper vs one Ray environment worker, the same steps.

    python bench/bench_ray_workers.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from benchlib import fmt_tail, latency_summary, machine_line  # noqa: E402

from rolloutdb.config import Config  # noqa: E402
from rolloutdb.controller.job.build import build_local_engine  # noqa: E402
from rolloutdb.controller.tasks.digits import LongTailDigitDataset  # noqa: E402
from rolloutdb.gpu_capture import GenerationRequest, SamplingParams, build_tiny_policy  # noqa: E402


def requests(n: int, max_digits: int, seed: int) -> list[GenerationRequest]:
    data = LongTailDigitDataset(size=n, max_digits=max_digits, seed=seed)
    out = []
    for i in range(n):
        length = data.length(i) + 1  # the digits and an end of sequence
        out.append(GenerationRequest(f"c{i}", [1, 4 + i % 7, 5 + i % 5, 9],
                                     SamplingParams(length, min_tokens=length, temperature=1.0, seed=i)))
    return out


def throughput(engine, calls: list[GenerationRequest], inflight: int, cut_every: float) -> dict:
    """Run every call with `inflight` in flight; cut every `cut_every` s meanwhile."""
    holds, gathers, stop = [], [], threading.Event()

    def cutter():
        while not stop.wait(cut_every):
            t = time.perf_counter()
            engine.running_calls()
            gathers.append(time.perf_counter() - t)  # what the cut waits, step in progress included
            holds.append(engine.cut_hold_s)  # what an output step waits

    thread = threading.Thread(target=cutter, name="bench-cutter", daemon=True)
    pending, queue, tokens = set(), list(calls), 0
    t0 = time.perf_counter()
    thread.start()
    while queue or pending:
        while queue and len(pending) < inflight:
            pending.add(engine.submit(queue.pop(0)))
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        tokens += sum(len(f.result().token_ids) for f in done)
    wall = time.perf_counter() - t0
    stop.set()
    thread.join()
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "cut_hold": latency_summary(holds),
            "gather": latency_summary(gathers)}


def per_call(engine, n: int) -> dict:
    lat = []
    for i in range(n):
        t = time.perf_counter()
        engine.submit(GenerationRequest(f"one{i}", [1, 4, 5, 9], SamplingParams(1, temperature=0.0))).result()
        lat.append(time.perf_counter() - t)
    return latency_summary(lat)


def env_steps(config: Config, policy: Path, n: int) -> list[tuple[dict, list[int], bool]]:
    """`n` (state, reply, last) steps of the 3-turn digit task, right and wrong replies,
    every turn index, from states the task itself reached."""
    from rolloutdb.controller.tasks.registry import build_task, check_plugins

    env = build_task(config, policy, check_plugins(config))[1]
    cases: list[tuple[dict, list[int], bool]] = []
    prompt = 0
    while len(cases) < n:
        _, state = env.start(prompt)
        for turn in range(env.max_turns):
            target = state["targets"][turn]
            reply = env.codec.encode(target if (prompt + turn) % 2 == 0 else "9" * len(target))
            cases.append((state, reply, turn + 1 >= env.max_turns))
            out, state = env.step(state, reply)
            if out.done:
                break
        prompt += 1
    return cases[:n]


def per_step(stepper, cases) -> dict:
    lat = []
    for state, reply, last in cases:
        t = time.perf_counter()
        stepper.step(state, reply, last=last).result()
        lat.append(time.perf_counter() - t)
    return latency_summary(lat)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few calls: checks that it runs")
    ap.add_argument("--calls", type=int, default=256)
    ap.add_argument("--max-digits", type=int, default=96)
    ap.add_argument("--inflight", type=int, default=32)
    ap.add_argument("--cut-every", type=float, default=0.05)
    ap.add_argument("--one-calls", type=int, default=200)
    ap.add_argument("--env-steps", type=int, default=300)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.quick:
        a.calls, a.max_digits, a.one_calls, a.env_steps = 24, 16, 20, 20
    import ray

    from rolloutdb.gpu_capture.ray_workers import RayEnginePool

    work = Path(tempfile.mkdtemp(prefix="bench_ray"))
    policy = build_tiny_policy(work / "policy", seed=0)
    cfg = Config.model_validate({"generation": {"max_batch_size": a.inflight}})
    factory = partial(build_local_engine, cfg, policy)
    calls = requests(a.calls, a.max_digits, seed=0)
    figures: dict = {"machine": machine_line(), "args": vars(a) | {"json": str(a.json) if a.json else None}}

    env_cfg = Config.model_validate({"environment": {"task": "digits", "turns": 3, "n_digits": 3},
                                     "generation": {"max_tokens": 4}})
    steps = env_steps(env_cfg, policy, a.env_steps)
    from rolloutdb.controller.tasks.registry import build_task, check_plugins
    from rolloutdb.controller.rollout.env_steps import LocalStepper

    figures["env_in_driver"] = per_step(LocalStepper(build_task(env_cfg, policy, check_plugins(env_cfg))[1]), steps)
    engine = factory()
    try:
        figures["in_process"] = throughput(engine, calls, a.inflight, a.cut_every)
        figures["in_process"]["per_call"] = per_call(engine, a.one_calls)
    finally:
        engine.close()
    # Ray's session files go under `work` too (removed at the end). A short path: Ray's
    # socket paths must fit in 107 bytes.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(work / "ray"))
    try:
        for workers in (1, 2):
            with RayEnginePool(factory, workers=workers) as pool:
                pool.submit(calls[0]).result()  # warm: the workers are up
                key = f"ray_{workers}"
                figures[key] = throughput(pool, [c for c in calls], a.inflight, a.cut_every)
                if workers == 1:
                    figures[key]["per_call"] = per_call(pool, a.one_calls)
        from rolloutdb.controller.rollout.ray_environments import EnvironmentWorkerPool

        with EnvironmentWorkerPool(env_cfg, policy, workers=1) as env_pool:
            per_step(env_pool, steps[:3])  # warm: the worker answers
            figures["env_ray_1"] = per_step(env_pool, steps)
    finally:
        ray.shutdown()
    base = figures["in_process"]
    figures["ratios"] = {
        "tokens_per_s_ray1_vs_in_process": figures["ray_1"]["tokens_per_s"] / base["tokens_per_s"],
        "tokens_per_s_ray2_vs_ray1": figures["ray_2"]["tokens_per_s"] / figures["ray_1"]["tokens_per_s"],
        "tokens_per_s_ray2_vs_in_process": figures["ray_2"]["tokens_per_s"] / base["tokens_per_s"],
        "cut_hold_p50_ray2_vs_in_process": figures["ray_2"]["cut_hold"]["p50_ms"] / base["cut_hold"]["p50_ms"],
        "cut_wall_p50_ray2_vs_in_process": figures["ray_2"]["gather"]["p50_ms"] / base["gather"]["p50_ms"],
        "per_call_overhead_p50_ms": figures["ray_1"]["per_call"]["p50_ms"] - base["per_call"]["p50_ms"],
        "env_step_overhead_p50_ms": figures["env_ray_1"]["p50_ms"] - figures["env_in_driver"]["p50_ms"],
    }
    print(figures["machine"])
    for key in ("in_process", "ray_1", "ray_2"):
        f = figures[key]
        print(f"{key:10s} {f['tokens_per_s']:9.0f} tokens/s  cut hold p50 {f['cut_hold']['p50_ms']:.3f} ms "
              f"{fmt_tail(f['cut_hold'])}  cut wall p50 {f['gather']['p50_ms']:.3f} ms"
              + (f"  1-token call p50 {f['per_call']['p50_ms']:.2f} ms" if "per_call" in f else ""))
    print(f"env step  in driver p50 {figures['env_in_driver']['p50_ms']:.3f} ms {fmt_tail(figures['env_in_driver'])}"
          f"  1 Ray env worker p50 {figures['env_ray_1']['p50_ms']:.3f} ms {fmt_tail(figures['env_ray_1'])}")
    print(json.dumps(figures["ratios"], indent=1))
    if a.json:
        a.json.write_text(json.dumps(figures, indent=1))
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
