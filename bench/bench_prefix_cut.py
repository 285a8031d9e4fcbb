"""The prefix cut's hold: how long `running_calls()` keeps the reference engine's output
step waiting, at 16 and 256 running calls, side by side in one run, next to the decode
step it delays.

    python bench/bench_prefix_cut.py [--calls 16 256] [--tokens 96] [--cuts 40] [--json OUT]

Each size: N seeded calls of `--tokens` tokens decode in one engine; a thread cuts every
~5 ms (`running_calls()`, what a snapshot at target_level prefix does under the commit
lock) and records the engine's `cut_hold_s` (the time inside the engine lock: the
output step's wait, not the cut's own wait for the step in progress) and the copy's size.
The hold is a copy of Python lists, O(tokens decoded so far); the goal is <= 5 ms at 256.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from rolloutdb.gpu_capture import GenerationRequest, ReferenceEngine, SamplingParams, build_tiny_policy


def measure(policy: Path, calls: int, tokens: int, cuts: int) -> dict:
    with ReferenceEngine(policy, max_batch_size=calls) as eng:
        reqs = [GenerationRequest(f"c{i}", [1, 5 + i % 7, 6, 7], SamplingParams(max_tokens=tokens, min_tokens=tokens,
                                                                                 seed=i)) for i in range(calls)]
        futures = [eng.submit(r) for r in reqs]
        holds, saved = [], []
        stop = threading.Event()

        def cutter() -> None:
            while not stop.is_set() and len(holds) < cuts:
                running = eng.running_calls()
                if running:
                    holds.append(eng.cut_hold_s)
                    saved.append(sum(len(c.token_ids) for c in running.values()))
                time.sleep(0.005)

        t = threading.Thread(target=cutter)
        t0 = time.perf_counter()
        t.start()
        for f in futures:
            f.result(600)
        wall = time.perf_counter() - t0
        stop.set()
        t.join()
        steps = tokens  # one decode step per token when every call runs at once
        ms = sorted(h * 1000 for h in holds)
        return {
            "calls": calls, "cuts": len(ms), "hold_ms_p50": statistics.median(ms) if ms else None,
            "hold_ms_p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None,
            "hold_ms_max": ms[-1] if ms else None, "tokens_per_cut_mean": statistics.mean(saved) if saved else 0,
            "step_ms_mean": 1000 * wall / steps,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--cuts", type=int, default=40)
    ap.add_argument("--quick", action="store_true", help="4 and 16 calls, 12 tokens: a smoke run")
    ap.add_argument("--dir", default=None, help="where the tiny policy is built (a temporary directory if unset)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.calls, args.tokens, args.cuts = [4, 16], 12, 5
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        policy = build_tiny_policy(Path(tmp) / "policy", seed=0)
        rows = [measure(policy, n, args.tokens, args.cuts) for n in args.calls]
    for r in rows:
        print(f"{r['calls']:4d} calls: hold p50 {r['hold_ms_p50']:.3f} ms, p99 {r['hold_ms_p99']:.3f} ms, "
              f"max {r['hold_ms_max']:.3f} ms over {r['cuts']} cuts of {r['tokens_per_cut_mean']:.0f} tokens; "
              f"decode step {r['step_ms_mean']:.1f} ms")
    lo, hi = rows[0], rows[-1]
    ratio = hi["hold_ms_p50"] / lo["hold_ms_p50"] if lo["hold_ms_p50"] else None
    print(f"hold p50 {hi['calls']} / {lo['calls']} calls: {ratio:.1f}x" if ratio else "")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "sizes": rows, "ratio_p50": ratio}, indent=2))


if __name__ == "__main__":
    main()
