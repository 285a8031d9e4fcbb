"""The quickstart as a benchmark: wall time, reward gain, and the share of each pump's
wall time spent inside store transactions (wall and CPU), all from one run.

    python bench/bench_quickstart.py                      # the full quickstart
    python bench/bench_quickstart.py --steps 20           # shorter
    python bench/bench_quickstart.py --quick              # smoke: 3 steps, tiny batches

The share is a ratio measured inside the run (store seconds / pump seconds), so the
machine's speed cancels out; the wall time is printed with the load average beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="train steps (default: the quickstart's)")
    ap.add_argument("--quick", action="store_true", help="3 steps with tiny batches (smoke test)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()

    from rolloutdb.config import load_config
    from rolloutdb.controller.job.controller import Controller
    from rolloutdb.controller.run.run_log import latest_per_step, read_metrics

    overrides = ["logging.progress=false"]
    if args.steps:
        overrides.append(f"algorithm.total_steps={args.steps}")
    if args.quick:
        overrides += ["algorithm.total_steps=3", "algorithm.groups_per_step=2", "algorithm.group_size=4",
                      "environment.dataset_size=32", "logging.plot=false"]
    config = load_config(REPO / "examples" / "quickstart.yaml", overrides)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        summary = Controller(config, run_dir).run()
        wall = time.perf_counter() - t0
        events = read_metrics(run_dir / "logs" / "metrics.jsonl")
    steps = latest_per_step([e for e in events if e["kind"] == "train_step"])
    windows = [e for e in events if e["kind"] == "rollout"]
    share = next(e for e in events if e["kind"] == "store_share")
    figures = {
        "steps": len(steps),
        "wall_s": round(wall, 1),
        "load_avg_at_start": load_before,
        "summary": summary.line,
        "commit_batches": sum(w["batches"] for w in windows),
        "calls": sum(w["calls"] for w in windows),
        "commit_p99_ms_max": max((w["commit_p99_ms"] or 0.0 for w in windows), default=None),
        "window_p99_ms_max": max((w["window_p99_ms"] or 0.0 for w in windows), default=None),
        "pumps_wall_s": round(share["pumps_wall_s"], 2),
        "store_share": share["threads"],
    }
    print(f"quickstart: {figures['steps']} steps in {wall:.1f} s (load {load_before:.1f}); {summary.line}")
    print(f"rollout: {figures['calls']} calls in {figures['commit_batches']} commit batches; worst per-second p99: "
          f"commit {figures['commit_p99_ms_max']} ms, call finished -> committed {figures['window_p99_ms_max']} ms")
    for name, s in share["threads"].items():
        print(f"  {name:14s} {s['transactions']:6d} transactions  store {s['store_s']:7.3f} s "
              f"({100 * s['share']:.2f}% of pump wall time; CPU {100 * s['cpu_share']:.2f}%)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
