"""The vLLM backend's decode rate with prefix-level snapshots every second vs none, and
the cut hold per snapshot, side by side in one run (one engine, rounds alternated), at a
few numbers of running calls.

    VENV/bin/python bench/bench_vllm_capture.py [--calls 16 128] [--tokens 200] [--rounds 4] [--every 1.0]
        [--temperature 1.0] [--json OUT]

Needs vLLM (scripts/install_vllm_cpu.sh VENV). Each round: N calls (greedy, or sampled at
`--temperature`, seeded by index) of `--tokens`
tokens each, submitted at once (all running together: the engine's max_num_seqs is the
largest N). In "snapshot" rounds a thread does, every `--every` seconds, the engine's part
of a prefix-level rollout snapshot and its write of the prefixes: `running_calls()` (what
the snapshot pump asks the engine for before it takes the commit lock; `cut_hold_s` is how long the
read held vLLM's output loop, `wait` how long the caller waited, the output step in
progress included), then the prefixes (int32 token ids, float32 logprobs, one row per call)
written in one transaction into a SQLite file, in this process, as the snapshot copy does:
so the decode rate pays the same GIL and disk traffic. The rest of a snapshot (the ledger
copy, publishing) runs beside the pumps and is measured by bench_snapshot_latency.py and
bench_prefix_cut.py. Rounds alternate none/snapshot, so drift hits both alike.

Printed per N: tokens/s per mode (each round and the median), the ratio of medians, the
hold and wait per snapshot (median, p99, max, count), and the share of the tokens decoded
at the cuts that they kept (the calls the engine's `cut_support` lets continue: a call it
refuses restarts at a stop), with the load average before and after and the CPU count
(figures from a shared machine mean little without them); then all sizes as one table.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def _pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for a p99 of fewer than 100 values (it would be the
    maximum, reported beside it), as bench/benchlib.py's latency_summary does."""
    if not values or (q >= 0.99 and len(values) < 100):
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _write_prefixes(db: sqlite3.Connection, running: dict) -> tuple[int, int]:
    """The snapshot's write of the cut's prefixes: one row per call the engine can
    continue (`cut_refused` None; the snapshot pump saves no prefix of another), in one
    transaction. Returns (tokens kept, tokens decoded at the cut)."""
    kept = {rid: c for rid, c in running.items() if c.token_ids and c.cut_refused is None}
    rows = [(rid, np.asarray(c.token_ids, "<i4").tobytes(), np.asarray(c.logprobs, "<f4").tobytes())
            for rid, c in kept.items()]
    with db:
        db.execute("DELETE FROM prefixes")
        db.executemany("INSERT INTO prefixes VALUES (?, ?, ?)", rows)
    return sum(len(c.token_ids) for c in kept.values()), sum(len(c.token_ids) for c in running.values())


def one_round(eng, calls: int, tokens: int, every: float | None, tag: str, db_path: Path,
              temperature: float = 0.0) -> dict:
    from rolloutdb.gpu_capture import GenerationRequest, SamplingParams

    requests = [GenerationRequest(f"{tag}-{i}", [1, 5 + i % 7, 6, 7, 8 + i % 5],
                                  SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=temperature,
                                                 seed=i if temperature > 0 else None))
                for i in range(calls)]
    holds: list[float] = []
    waits: list[float] = []
    saved: list[tuple[int, int]] = []
    stop = threading.Event()

    def snapshotter() -> None:
        db = sqlite3.connect(db_path, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE IF NOT EXISTS prefixes (request_id TEXT, token_ids BLOB, logprobs BLOB)")
        try:
            while not stop.wait(every):
                t0 = time.perf_counter()
                running = eng.running_calls()
                waits.append(time.perf_counter() - t0)
                holds.append(eng.cut_hold_s)
                saved.append(_write_prefixes(db, running))
        finally:
            db.close()

    thread = threading.Thread(target=snapshotter) if every else None
    t0 = time.perf_counter()
    futures = [eng.submit(r) for r in requests]
    if thread:
        thread.start()
    decoded = sum(len(f.result(1800).token_ids) for f in futures)
    elapsed = time.perf_counter() - t0
    stop.set()
    if thread:
        thread.join()
    return {"rate": decoded / elapsed, "holds": holds, "waits": waits, "saved": saved}


def summary(calls: int, rounds: dict[str, list[dict]]) -> dict:
    rates = {mode: [r["rate"] for r in rs] for mode, rs in rounds.items()}
    holds = [h * 1e3 for r in rounds["snapshot"] for h in r["holds"]]
    waits = [w * 1e3 for r in rounds["snapshot"] for w in r["waits"]]
    saved = [kept for r in rounds["snapshot"] for kept, _ in r["saved"]]
    decoded_at_cuts = sum(decoded for r in rounds["snapshot"] for _, decoded in r["saved"])
    med = {mode: statistics.median(v) for mode, v in rates.items()}
    return {
        "calls": calls,
        "tokens_per_s": {mode: [round(x) for x in v] for mode, v in rates.items()},
        "tokens_per_s_median": {mode: round(v) for mode, v in med.items()},
        "ratio_snapshot_over_none": round(med["snapshot"] / med["none"], 3),
        "pairs_snapshot_over_none": [round(s / n, 2) for s, n in zip(rates["snapshot"], rates["none"])],
        "snapshots": len(holds),
        "hold_ms": {"median": _r(statistics.median(holds) if holds else None), "p99": _r(_pct(holds, 0.99)),
                    "max": _r(max(holds) if holds else None)},
        "wait_ms": {"median": _r(statistics.median(waits) if waits else None), "p99": _r(_pct(waits, 0.99)),
                    "max": _r(max(waits) if waits else None)},
        "prefix_tokens_per_snapshot_mean": round(statistics.mean(saved)) if saved else 0,
        # Of the tokens the running calls had decoded at the cuts, the share the cuts kept
        # (the calls the engine can continue); the rest would restart at a stop.
        "kept_fraction": round(sum(saved) / decoded_at_cuts, 4) if decoded_at_cuts else None,
    }


def table(sizes: list[dict]) -> str:
    """The figures of every size as one table (what scripts/gpu_vllm_check.sh prints)."""
    def ms(x):
        return "-" if x is None else f"{x:.1f}"
    lines = ["| running calls | tokens/s, no snapshots | tokens/s, a snapshot every interval | ratio | "
             "cut hold p50 / p99 / max ms | snapshots | kept of decoded at the cut |",
             "|---|---|---|---|---|---|---|"]
    for r in sizes:
        med, hold = r["tokens_per_s_median"], r["hold_ms"]
        kept = "-" if r["kept_fraction"] is None else f"{100 * r['kept_fraction']:.1f}%"
        lines.append(f"| {r['calls']} | {med['none']} | {med['snapshot']} | {r['ratio_snapshot_over_none']:.2f} | "
                     f"{ms(hold['median'])} / {ms(hold['p99'])} / {ms(hold['max'])} | {r['snapshots']} | {kept} |")
    return "\n".join(lines)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=4, help="rounds per mode and size")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between two snapshots")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every call (> 0: sampled, seeded by index, as an RL run samples)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        from rolloutdb.gpu_capture import build_tiny_policy
        from rolloutdb.gpu_capture.vllm_engine import VLLMEngine, engine_environment

        for key, value in engine_environment(tmp).items():
            os.environ.setdefault(key, value)
        policy = build_tiny_policy(Path(tmp) / "policy", seed=0)
        db_path = Path(tmp) / "snapshot.sqlite"
        with VLLMEngine(policy, max_batch_size=max(args.calls), work_dir=Path(tmp) / "engine") as eng:
            one_round(eng, max(args.calls), 8, None, "warm", db_path)
            for calls in args.calls:
                rounds: dict[str, list[dict]] = {"none": [], "snapshot": []}
                for r in range(args.rounds):
                    for mode in (("none", "snapshot") if r % 2 == 0 else ("snapshot", "none")):
                        every = args.every if mode == "snapshot" else None
                        rounds[mode].append(one_round(eng, calls, args.tokens, every, f"{mode}{calls}-{r}", db_path,
                                                      args.temperature))
                results.append(summary(calls, rounds))
                print(json.dumps(results[-1]), flush=True)
    result = {"tokens": args.tokens, "rounds": args.rounds, "every_s": args.every, "temperature": args.temperature,
              "cpus": os.cpu_count(),
              "load_before": [round(x, 1) for x in load_before],
              "load_after": [round(x, 1) for x in os.getloadavg()], "sizes": results}
    print(json.dumps(result, indent=1))
    print(f"\n{args.tokens}-token calls, temperature {args.temperature}, a snapshot every {args.every} s, "
          f"{args.rounds} rounds per mode (medians):")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
