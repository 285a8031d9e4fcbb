"""The pumps' store share with the old read path and the new one, side by side in one
process.

    python bench/bench_read_path.py                 # 60 steps per phase, 2 repeats (BENCHMARKS.md)
    python bench/bench_read_path.py --steps 20 --repeats 1
    python bench/bench_read_path.py --quick         # smoke test

Each phase runs the real controller (`rolloutdb.controller.job.controller.Controller`: the
rollout, train and snapshot pumps as threads, the tiny Llama, GRPO on the digits task) on
`examples/quickstart.yaml` with `algorithm.total_steps=--steps`; only the store's read
path differs:

* old: every read-only site opens the write transaction without the mutation bump,
  `Store.atomic(mutation=False)` (``BEGIN IMMEDIATE`` on the one writer connection, under
  its lock: a read waits for every write and holds up every write);
* new: `Store.read()`, a ``BEGIN DEFERRED`` read transaction on a reader connection of its
  own (no write lock).

Reported per pump thread ("rollout-pump", "MainThread" = the train pump, "snapshot-pump"):
the share of the pumps' wall time spent inside store transactions (reads and writes,
wall and CPU; the controller's own `store_share` figure), and the read transactions'
count and mean wall time. The share is a ratio inside each run, so the machine's speed
cancels out; phases alternate order across repeats, and new / old is printed per repeat.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import benchlib  # noqa: E402
from benchlib import say  # noqa: E402

from rolloutdb.config import load_config  # noqa: E402
from rolloutdb.controller.job.controller import Controller  # noqa: E402
from rolloutdb.controller.run.run_log import read_metrics  # noqa: E402
from rolloutdb.store import Store  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PUMPS = ("rollout-pump", "MainThread", "snapshot-pump")
PHASES = ("old", "new")


class TimedReads(Store):
    """The real store; every `read()` is also timed on its own, per thread."""

    def __init__(self, db):
        super().__init__(db)
        self.reads: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def _read_path(self):
        with super().read() as conn:
            yield conn

    @contextlib.contextmanager
    def read(self):
        t0 = time.perf_counter()
        with self._read_path() as conn:
            yield conn
        self.reads.setdefault(threading.current_thread().name, []).append(time.perf_counter() - t0)


class OldReadPath(TimedReads):
    """The write-lock read path: the write transaction, without the mutation bump."""

    @contextlib.contextmanager
    def _read_path(self):
        with self.atomic(mutation=False) as tx:
            yield tx


class BenchController(Controller):
    store_cls: type[TimedReads] = TimedReads

    def create_store(self) -> Store:
        cfg = self.config
        return self.store_cls.create(
            self.dirs.store,
            config_fingerprint=cfg.fingerprint(),
            dataset_fingerprint=self.dataset.fingerprint(),
            ledger_dispatch=cfg.ledger_dispatch,
            replay_capacity=cfg.algorithm.replay_capacity,
            seed=cfg.run.seed,
        )


def run_phase(name: str, args, work: Path, repeat: int) -> dict:
    overrides = [f"algorithm.total_steps={args.steps}", "logging.progress=false", "logging.plot=false", *args.set]
    config = load_config(args.config, overrides)
    run_dir = work / f"run_{name}_{repeat}"
    BenchController.store_cls = OldReadPath if name == "old" else TimedReads
    controller = BenchController(config, run_dir)
    t0 = time.perf_counter()
    controller.run()
    wall = time.perf_counter() - t0
    share = next(e for e in read_metrics(run_dir / "logs" / "metrics.jsonl") if e["kind"] == "store_share")
    threads = {}
    for thread in PUMPS:
        s = share["threads"].get(thread)
        if not s:
            continue
        reads = controller.store.reads.get(thread, [])
        threads[thread] = {
            "share": s["share"],
            "cpu_share": s["cpu_share"],
            "transactions": s["transactions"],
            "reads": len(reads),
            "read_mean_ms": statistics.fmean(reads) * 1e3 if reads else 0.0,
        }
    all_s = [v for k, v in share["threads"].items() if k in PUMPS]
    threads["all pumps"] = {
        "share": sum(s["share"] for s in all_s),
        "cpu_share": sum(s["cpu_share"] for s in all_s),
        "transactions": sum(s["transactions"] for s in all_s),
        "reads": sum(len(r) for k, r in controller.store.reads.items() if k in PUMPS),
        "read_mean_ms": statistics.fmean([x for k, r in controller.store.reads.items() if k in PUMPS for x in r] or [0.0]) * 1e3,
    }
    return {"wall_s": wall, "pumps_wall_s": share["pumps_wall_s"], "threads": threads}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="train steps per phase")
    ap.add_argument("--repeats", type=int, default=2, help="pairs of phases (order alternates)")
    ap.add_argument("--config", type=Path, default=REPO / "examples" / "quickstart.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--quick", action="store_true", help="3 steps with tiny batches (smoke test)")
    ap.add_argument("--dir", type=Path, default=None, help="where the runs go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.repeats = 3, 1
        args.set = ["algorithm.groups_per_step=2", "algorithm.group_size=4", "environment.dataset_size=32", *args.set]
    result: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                    "machine": benchlib.machine_line(), "repeats": []}
    say(result["machine"])
    with tempfile.TemporaryDirectory(prefix="bench_read_path_", dir=args.dir) as tmp:
        for r in range(args.repeats):
            pair = {}
            for name in PHASES if r % 2 == 0 else reversed(PHASES):
                res = pair[name] = run_phase(name, args, Path(tmp), r)
                say(f"\n[{name} read path, repeat {r + 1}] {res['wall_s']:.1f} s (pumps {res['pumps_wall_s']:.1f} s)")
                for thread, s in res["threads"].items():
                    say(f"  {thread:<14} store share {100 * s['share']:6.2f}% (CPU {100 * s['cpu_share']:5.2f}%)  "
                        f"{s['transactions']:6d} transactions, {s['reads']:6d} reads of {s['read_mean_ms']:.3f} ms mean")
            say(f"\nnew / old, repeat {r + 1}:")
            ratios = {}
            for thread in (*PUMPS, "all pumps"):
                a, b = pair["new"]["threads"].get(thread), pair["old"]["threads"].get(thread)
                if not a or not b or not b["share"]:
                    continue
                ratios[thread] = {
                    "share": a["share"] / b["share"],
                    "read_mean": a["read_mean_ms"] / b["read_mean_ms"] if b["read_mean_ms"] else float("nan"),
                }
                say(f"  {thread:<14} store share {ratios[thread]['share']:.2f}x   read mean {ratios[thread]['read_mean']:.2f}x")
            result["repeats"].append({"phases": pair, "ratios": ratios})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
