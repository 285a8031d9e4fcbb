"""The store's transition code at another git revision next to the working tree's, in one
run: batched rounds and one-transition transactions alternate between the two versions
of `store/live/ledger.py` and `store/live/pools.py` on the same live store, so a change to the
hot paths is judged by a ratio measured side by side.

    python bench/bench_ledger_ab.py --rev c38c2a6      # the store skeleton's ledger
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_transitions as bt
import benchlib
from benchlib import fmt_latency, latency_summary, say

import rolloutdb.store.live.store as store_module
from rolloutdb.store import Store, ledger, pools

REPO = Path(__file__).resolve().parents[1]


# In older commits the store is one flat folder: a module of such a commit imports its
# siblings as `.codec`, `.errors`, `.schema`; these names point it at the checkout's modules.
FLAT_NAMES = {"codec": "live.codec", "schema": "live.schema", "ledger": "live.ledger", "errors": "errors"}


def module_at(rev: str, name: str, workdir: Path):
    """`store/live/<name>.py` (or the flat `store/<name>.py` of an older commit) as it is at
    `rev`, loaded beside the checkout's modules (so its relative imports resolve to the
    checkout's codec, schema and errors)."""
    for where, package in ((f"store/live/{name}.py", "rolloutdb.store.live"), (f"store/{name}.py", "rolloutdb.store")):
        src = subprocess.run(["git", "show", f"{rev}:{where}"], cwd=REPO, capture_output=True, text=True)
        if src.returncode == 0:
            break
    else:
        sys.exit(f"error: cannot read store/live/{name}.py at {rev!r} ({src.stderr.strip()}); "
                 "pass a commit of this repository")
    if package == "rolloutdb.store":
        for old, new in FLAT_NAMES.items():
            sys.modules.setdefault(f"rolloutdb.store.{old}", importlib.import_module(f"rolloutdb.store.{new}"))
    path = workdir / f"{name}_at_rev.py"
    path.write_text(src.stdout)
    spec = importlib.util.spec_from_file_location(f"{package}.{name}_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def use(ledger_module, pools_module) -> None:
    bt.ledger, bt.pools = ledger_module, pools_module
    store_module.ledger, store_module.pools = ledger_module, pools_module


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", required=True, help="git revision whose ledger.py and pools.py to compare against")
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--reps", type=int, default=6, help="alternations (the first is warm-up)")
    p.add_argument("--single-groups", type=int, default=150, help="groups taken one transition at a time per rep")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-ledger-ab-") as tmp:
        versions = {
            args.rev: (module_at(args.rev, "ledger", Path(tmp)), module_at(args.rev, "pools", Path(tmp))),
            "working tree": (ledger, pools),
        }
        store = Store.create(Path(tmp) / "live.sqlite", replay_capacity=2 * args.batch)
        runq = benchlib.RunQueueClock()
        try:
            seq = bt.Sequencer(0)
            bt.prefill_ledger(store, 100_000, seq)
            gen = bt.generation(64)
            busy = {v: 0.0 for v in versions}
            single = {v: [] for v in versions}
            for rep in range(args.reps):
                for name, modules in versions.items():
                    use(*modules)
                    q0, t0 = runq(), time.perf_counter()
                    for _ in range(2):
                        bt.store_batched_round(store, seq, args.batch, 4, gen, dict.fromkeys(bt.BATCH_STEPS, 0.0))
                    elapsed = time.perf_counter() - t0 - (runq() - q0)
                    lat = {k: [] for k in bt.BATCH_STEPS}
                    waits: list[float] = []
                    for _ in range(args.single_groups):
                        bt.store_single_group(store, seq, gen, lat, runq, waits)
                    if rep:  # the first alternation warms both up
                        busy[name] += elapsed
                        order = [x for block in zip(*lat.values()) for x in block]
                        single[name] += [t - w for t, w in zip(order, waits)]
            use(ledger, pools)
        finally:
            runq.close()
            store.close()
    transitions = (args.reps - 1) * 2 * args.batch * 5
    say(f"machine: {benchlib.machine_line()}; figures less run-queue wait")
    for name in versions:
        s = latency_summary(single[name])
        say(f"  {name:<14} batched {transitions / busy[name]:>8,.0f} group transitions/s   "
            f"single {fmt_latency(s)}")
    say(f"  batched speed, working tree / {args.rev}: {busy[args.rev] / busy['working tree']:.2f}x")


if __name__ == "__main__":
    main()
