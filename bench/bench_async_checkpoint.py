"""The train pump's stall per trainer checkpoint, synchronous next to asynchronous
(`checkpointing.async`), on the real controller with a policy large enough for the
write to matter.

    python bench/bench_async_checkpoint.py              # the figure in BENCHMARKS.md
    python bench/bench_async_checkpoint.py --quick      # tiny policy, for the smoke test

Each repeat runs the real `Controller` twice, sync then async, on the same config and
seed: a tiny-Llama policy of `--hidden` x `--layers` (the default, 768 x 8, is 47M
parameters: 0.19 GB of weights, 0.57 GB per checkpoint with the AdamW moments), a
checkpoint every `--interval` steps, rollout snapshots on (each checkpoint gets its
snapshot; the periodic interval is long, so only those). The train pump's time at each
step boundary (`Controller._step_done`: the sync publish, or the async copy + begin and
the later rename, plus the wait for the snapshot cut, which both modes pay) is timed
here from outside; the stall per checkpoint is the sum over the run divided by the
checkpoints published. Also reported: the copy alone (async `begun` lines), the
background write + seal (its timings), and the run's wall time. Load on the shared
machine moves every figure; the ratio sync/async of the same repeat is the result.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from benchlib import machine_line  # noqa: E402

from rolloutdb.config import config_from_dict  # noqa: E402
from rolloutdb.controller.job.controller import Controller  # noqa: E402
from rolloutdb.controller.run.run_log import read_metrics  # noqa: E402
from rolloutdb.store import scan  # noqa: E402


class TimedController(Controller):
    """The real controller; only the train pump's step-boundary time is recorded."""

    boundary_s: list[float]

    def _step_done(self, step: int) -> None:
        t0 = time.perf_counter()
        try:
            super()._step_done(step)
        finally:
            self.boundary_s.append(time.perf_counter() - t0)


def config(args, asynchronous: bool):
    return config_from_dict({
        "run": {"name": "bench", "seed": 5},
        "algorithm": {"total_steps": args.steps, "groups_per_step": 2, "group_size": 2, "max_staleness": 1},
        "policy": {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": args.heads},
        "generation": {"max_tokens": 4, "max_batch_size": 8},
        "environment": {"dataset_size": 64, "n_digits": 2},
        "checkpointing": {"interval_steps": args.interval, "async": asynchronous, "keep_last": 2},
        "rollout_checkpointing": {"enabled": True, "interval_s": 600.0, "keep_last": 2},
        "logging": {"progress": False, "plot": False},
    })


def one_run(args, base: Path, asynchronous: bool, policy: Path | None) -> dict:
    run_dir = base / ("async" if asynchronous else "sync")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    if policy is not None:  # the same initial policy every run: build it once
        shutil.copytree(policy, run_dir / "policy")
    ctl = TimedController(config(args, asynchronous), run_dir)
    ctl.boundary_s = []
    t0 = time.perf_counter()
    ctl.run()
    wall = time.perf_counter() - t0
    events = read_metrics(run_dir / "logs" / "metrics.jsonl", "checkpoint")
    published = [e for e in events if e["outcome"] == "published"]
    begun = [e for e in events if e["outcome"] == "begun"]
    ckpt = scan(run_dir / "checkpoints").complete_anchors()[-1]
    snaps = [e for e in read_metrics(run_dir / "logs" / "metrics.jsonl", "snapshot") if e["outcome"] == "published"]
    out = {
        "mode": "async" if asynchronous else "sync",
        "wall_s": wall,
        "steps": len(ctl.boundary_s),
        "checkpoints_published": len(published),
        "skipped_busy": sum(e["outcome"] == "skipped_busy" for e in events),
        "snapshots_published": len(snaps),
        "checkpoint_bytes": ckpt.size_bytes(),
        "boundary_total_s": sum(ctl.boundary_s),
        "stall_per_checkpoint_s": sum(ctl.boundary_s) / max(1, len(published)),
        # The checkpoint's own part of it (the `checkpoint` lines' stall_s: the sync
        # publish; the async copy + begin and the later rename), without the snapshot cut.
        "checkpoint_stall_per_checkpoint_s": sum(e["stall_s"] for e in events) / max(1, len(published)),
        # Its CPU time on the train pump: what it costs apart from waiting for the disk or
        # for a CPU (the async copy is CPU: a memcpy, plus first-touch page faults).
        "checkpoint_stall_cpu_per_checkpoint_s": sum(e["stall_cpu_s"] for e in events) / max(1, len(published)),
        # The async run's last checkpoint is published after the last step (the end
        # waits for its write): not a stall of training, counted apart.
        "end_wait_s": sum(e["stall_s"] for e in events if e.get("at_end")),
        "copy_cpu_s": [e["copy_cpu_s"] for e in begun],
        # Per checkpoint: the train pump's time at its boundary and the boundaries up
        # to the next checkpoint (where the async one is published); the first one
        # also allocates the async copy buffers, which later checkpoints reuse.
        "stall_by_checkpoint_s": [sum(ctl.boundary_s[i:i + args.interval])
                                  for i in range(args.interval - 1, len(ctl.boundary_s), args.interval)],
        "copy_s": [e["copy_s"] for e in begun],
        "write_seal_s": [e["timings"].get("write", 0) + e["timings"].get("hash_fsync_files", 0)
                         + e["timings"].get("manifest_dirs", 0) for e in published],
    }
    if policy is None:
        keep = base / "policy"
        if not keep.exists():
            shutil.copytree(run_dir / "policy", keep)
    shutil.rmtree(run_dir)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--interval", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny policy, 4 steps, one repeat")
    ap.add_argument("--dir", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.heads, args.steps, args.repeats = 64, 2, 4, 4, 1
    base = Path(tempfile.mkdtemp(prefix="bench_async_ckpt.", dir=args.dir))
    print(machine_line())
    print(f"policy hidden {args.hidden} x {args.layers} layers; {args.steps} steps, a checkpoint every {args.interval}")
    rows = []
    try:
        for rep in range(args.repeats):
            for asynchronous in (False, True):
                policy = base / "policy" if (base / "policy").exists() else None
                r = one_run(args, base, asynchronous, policy)
                r["repeat"] = rep
                rows.append(r)
                print(f"  {r['mode']:5s} rep {rep}: stall/checkpoint {r['stall_per_checkpoint_s'] * 1e3:8.1f} ms "
                      f"(checkpoint's own {r['checkpoint_stall_per_checkpoint_s'] * 1e3:.1f} ms, "
                      f"CPU {r['checkpoint_stall_cpu_per_checkpoint_s'] * 1e3:.1f} ms; end wait {r['end_wait_s']:.2f} s)  "
                      f"checkpoints {r['checkpoints_published']} (skipped {r['skipped_busy']})  "
                      f"{r['checkpoint_bytes'] / 2**20:.0f} MiB each  wall {r['wall_s']:.1f} s  "
                      f"copy {[round(c * 1e3, 1) for c in r['copy_s']]} ms "
                      f"(CPU {[round(c * 1e3, 1) for c in r['copy_cpu_s']]} ms)  "
                      f"write+seal {[round(w, 2) for w in r['write_seal_s']]} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {m: statistics.median(r["stall_per_checkpoint_s"] for r in rows if r["mode"] == m) for m in ("sync", "async")}
    later = {m: statistics.median(x for r in rows if r["mode"] == m for x in r["stall_by_checkpoint_s"][1:])
             for m in ("sync", "async")}
    cpu = {m: statistics.median(r["checkpoint_stall_cpu_per_checkpoint_s"] for r in rows if r["mode"] == m)
           for m in ("sync", "async")}
    ratios = [s["stall_per_checkpoint_s"] / a["stall_per_checkpoint_s"]
              for s, a in zip([r for r in rows if r["mode"] == "sync"], [r for r in rows if r["mode"] == "async"], strict=True)]
    print(f"median stall per checkpoint: sync {med['sync'] * 1e3:.1f} ms, async {med['async'] * 1e3:.1f} ms; "
          f"sync/async per repeat {[round(x, 1) for x in ratios]}; the checkpoint's CPU time on the train pump: "
          f"sync {cpu['sync'] * 1e3:.1f} ms, async {cpu['async'] * 1e3:.1f} ms")
    print(f"median stall of every checkpoint after the first: sync {later['sync'] * 1e3:.1f} ms, "
          f"async {later['async'] * 1e3:.1f} ms ({later['sync'] / later['async']:.1f}x)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                         "machine": machine_line(), "runs": rows, "median_stall_s": med, "median_stall_cpu_s": cpu,
                                         "median_stall_after_first_s": later,
                                         "ratio_sync_over_async": ratios}, indent=1))


if __name__ == "__main__":
    main()
