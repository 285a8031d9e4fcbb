"""The prefix cut's cost against the tokens decoded so far: how long a cut's read of the
reference engine keeps its output step waiting (the hold), how long the read takes in
all, and how many payload bytes the cut writes, early in the calls and late, at 16 and
256 running calls, side by side in one run.

    python bench/bench_prefix_cut.py [--calls 16 256] [--tokens 384] [--cuts 60] [--json OUT]
    python bench/bench_ab.py --rev a80a9d1 bench_prefix_cut.py --calls 256 --tokens 384

Each size: N seeded calls of `--tokens` tokens decode in one engine; a thread cuts every
~5 ms as a snapshot at target_level prefix does, and records the engine's `cut_hold_s`
(the time inside the engine lock: the output step's wait, not the cut's own wait for the
step in progress), the read's wall time, the tokens decoded so far and the payload the
cut writes (int32 token + float32 logprob = 8 bytes a token; chunk metadata, a few
dozen bytes a call, not counted):

* `whole`: `running_calls()`, every call's whole output, written whole: what every cut
  did before incremental cuts;
* `since`: `running_calls(since=...)` from the offsets the previous cut saved, writing
  only the new tokens (controller/recovery/prefix_chunks.py). An engine without `since`
  (a revision before it, under bench_ab.py) is read whole here too.

The hold and the bytes are reported for the first and the last quarter of the cuts (by
tokens decoded so far), so their growth with the prefix shows as a ratio (late / early):
~1 means independent of prefix length (the goal: a cut's cost follows the new tokens,
not the prefix; printed met/missed against late/early <= 1.5x for the `since` hold).

What a cut pays is more than the hold: `running_calls` first waits for the decode step
in progress to end (the engine copies at a step boundary), then holds the next step while
it copies. The bench reports the cut's whole wall time from request to data (`cut_wall`:
the wait for the step boundary + the hold + the copy) next to the hold, and the wait
(wall - hold). Which lock covers it today (controller/recovery/snapshot_pump.py `_cut`,
cut_contents.py `read_engine`): none of ours. The engine read is step 1, taken before the
rollout pump is flushed and before the commit lock; the commit lock is held afterwards
only to begin the cut's read transaction and check the trainer's step. So the wait is
paid by the snapshot pump (and the hold by the engine's output step), not by the train
pump's optimizer commit.

Latencies use bench/benchlib.py's latency_summary: a p99 only with 100+ cuts, else the
maximum, labelled as such.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchlib import fmt_tail, latency_summary

from rolloutdb.gpu_capture import GenerationRequest, ReferenceEngine, SamplingParams, build_tiny_policy

BYTES_PER_TOKEN = 8  # int32 token id + float32 logprob (store/live/codec.py)


HOLD_GROWTH_GOAL = 1.5  # late / early hold with incremental reads: independent of the prefix


def measure(policy: Path, calls: int, tokens: int, cuts: int, mode: str) -> dict:
    incremental = mode == "since" and "since" in inspect.signature(ReferenceEngine.running_calls).parameters
    with ReferenceEngine(policy, max_batch_size=calls) as eng:
        reqs = [GenerationRequest(f"c{i}", [1, 5 + i % 7, 6, 7], SamplingParams(max_tokens=tokens, min_tokens=tokens,
                                                                                 seed=i)) for i in range(calls)]
        futures = [eng.submit(r) for r in reqs]
        rows: list[tuple[int, float, float, int]] = []  # (decoded so far, hold s, read s, bytes written)
        stop = threading.Event()
        saved: dict[str, int] = {}

        def cutter() -> None:
            while not stop.is_set() and len(rows) < cuts:
                t0 = time.perf_counter()
                running = eng.running_calls(since=dict(saved)) if incremental else eng.running_calls()
                read = time.perf_counter() - t0
                if running:
                    start = {rid: getattr(c, "start", 0) for rid, c in running.items()}
                    decoded = sum(start[rid] + len(c.token_ids) for rid, c in running.items())
                    new = sum(len(c.token_ids) for c in running.values())
                    rows.append((decoded, eng.cut_hold_s, read, BYTES_PER_TOKEN * new))
                    if incremental:
                        saved.clear()
                        saved.update({rid: start[rid] + len(c.token_ids) for rid, c in running.items()})
                time.sleep(0.005)

        t = threading.Thread(target=cutter)
        t0 = time.perf_counter()
        t.start()
        for f in futures:
            f.result(600)
        wall = time.perf_counter() - t0
        stop.set()
        t.join()
    rows.sort()
    quarter = max(1, len(rows) // 4)
    early, late = rows[:quarter], rows[-quarter:]

    def part(sample: list[tuple[int, float, float, int]]) -> dict:
        return {"decoded_tokens_mean": statistics.mean(r[0] for r in sample),
                "hold_ms_p50": 1000 * statistics.median(r[1] for r in sample),
                "read_ms_p50": 1000 * statistics.median(r[2] for r in sample),
                "bytes_per_cut_mean": statistics.mean(r[3] for r in sample)}

    e, la = part(early), part(late)
    hold = latency_summary([r[1] for r in rows])
    wall_summary = latency_summary([r[2] for r in rows])
    return {
        "calls": calls, "mode": mode, "incremental": incremental, "cuts": len(rows),
        "hold": hold, "cut_wall": wall_summary,
        # The wait for the step in progress to end: the read's wall time less its hold.
        "step_wait": latency_summary([max(0.0, r[2] - r[1]) for r in rows]),
        "hold_ms_p50": hold["p50_ms"],
        # None with fewer than 100 cuts (the max stands in; see "hold").
        "hold_ms_p99": hold["p99_ms"],
        "read_ms_p50": wall_summary["p50_ms"],
        "bytes_per_cut_mean": statistics.mean(r[3] for r in rows),
        "early": e, "late": la,
        "hold_growth": la["hold_ms_p50"] / e["hold_ms_p50"] if e["hold_ms_p50"] else None,
        "bytes_growth": la["bytes_per_cut_mean"] / e["bytes_per_cut_mean"] if e["bytes_per_cut_mean"] else None,
        "step_ms_mean": 1000 * wall / tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--cuts", type=int, default=60)
    ap.add_argument("--quick", action="store_true", help="4 and 16 calls, 12 tokens: a smoke run")
    ap.add_argument("--dir", default=None, help="where the tiny policy is built (a temporary directory if unset)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.calls, args.tokens, args.cuts = [4, 16], 12, 5
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        policy = build_tiny_policy(Path(tmp) / "policy", seed=0)
        rows = [measure(policy, n, args.tokens, args.cuts, mode) for n in args.calls for mode in ("whole", "since")]
    print("cut wall = request to data (wait for the step in progress + hold + copy); no lock of ours is held "
          "during it (the engine read precedes the commit lock)")
    for r in rows:
        print(f"{r['calls']:4d} calls, {r['mode']:5s}: hold p50 {r['hold_ms_p50']:.3f} ms (early {r['early']['hold_ms_p50']:.3f}, "
              f"late {r['late']['hold_ms_p50']:.3f}: {r['hold_growth'] or 0:.1f}x), {fmt_tail(r['hold'])}; "
              f"cut wall p50 {r['cut_wall']['p50_ms']:.3f} ms, {fmt_tail(r['cut_wall'])} "
              f"(step wait p50 {r['step_wait']['p50_ms']:.3f} ms); bytes per cut early {r['early']['bytes_per_cut_mean']:.0f}, "
              f"late {r['late']['bytes_per_cut_mean']:.0f} ({r['bytes_growth'] or 0:.1f}x) at "
              f"{r['early']['decoded_tokens_mean']:.0f} -> {r['late']['decoded_tokens_mean']:.0f} tokens decoded; "
              f"{r['cuts']} cuts; decode step {r['step_ms_mean']:.1f} ms")
    by = {f"{r['calls']}_{r['mode']}": r for r in rows}
    growth = {k: r["hold_growth"] for k, r in by.items() if r["mode"] == "since" and r["hold_growth"] is not None}
    goal = {"hold_growth_goal": HOLD_GROWTH_GOAL, "since_hold_growth": growth,
            "met": bool(growth) and all(g <= HOLD_GROWTH_GOAL for g in growth.values())}
    print(f"goal: incremental hold late/early <= {HOLD_GROWTH_GOAL}x: "
          f"{', '.join(f'{k} {g:.2f}x' for k, g in growth.items()) or '-'}: {'met' if goal['met'] else 'missed'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "sizes": rows, "by": by, "goal": goal}, indent=2))


if __name__ == "__main__":
    main()
