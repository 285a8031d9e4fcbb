"""Capture + publish of a large rollout snapshot, against `cp` + `sync` of the same bytes.

    python bench/bench_publish.py --gb 1       # the figure in BENCHMARKS.md
    python bench/bench_publish.py --gb 0.1     # quick
    python bench/bench_publish.py --gb 1 --page-size 65536   # what-if: larger pages

Builds a live store holding about `--gb` of sample payload (token ids and logprobs
BLOBs, written through the store API in batched transactions), folds its WAL into the
file, then alternates, `--repeats` times, in the same run:

* publish: `Publisher.publish_rollout_snapshot` with `store.capture` as the capture:
  backup API copy at one read cut, checksum (blake3, manifest format 2) of every file, fsync of every file and
  directory, manifest, rename, parent fsync (the whole commit protocol);
* cp: ``cp live.sqlite copy.sqlite`` then ``sync copy.sqlite`` (fsync of the copy, so
  both sides pay for durability).

Both read the source from the page cache (it was just written); neither drops caches.
Reports medians and the ratio cp_time / publish_time (1.0 = as fast as cp; goal >= 0.5).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from benchlib import machine_line  # noqa: E402

from rolloutdb.store import FinishedGeneration, KeepNewestSnapshots, Publisher, Reservation, Retention, Store, ledger

TOKENS_PER_SAMPLE = 16384  # 64 KiB of token ids + 64 KiB of logprobs per sample
GROUP_SIZE = 4
BATCH_GROUPS = 64


def build_store(path: Path, gb: float, page_size: int | None = None) -> Store:
    store = Store.create(path, replay_capacity=1 << 20, synchronous="OFF")
    per_sample = TOKENS_PER_SAMPLE * 8
    groups = max(1, int(gb * 2**30 / per_sample / GROUP_SIZE))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, TOKENS_PER_SAMPLE, dtype=np.int32)
    logprobs = -rng.random(TOKENS_PER_SAMPLE, dtype=np.float32)
    seq = 0
    while seq < groups:
        n = min(BATCH_GROUPS, groups - seq)
        with store.atomic() as tx:
            ids = ledger.reserve_groups(tx, [Reservation(s, 0, s) for s in range(seq, seq + n)],
                                        num_generations=GROUP_SIZE, target_step=1)
            attempts = ledger.dispatch_groups(tx, ids, policy_version=0)
            gen = FinishedGeneration(tokens, logprobs, 1.0, [(0, TOKENS_PER_SAMPLE)])
            ledger.finish_attempts(tx, [(a, gen) for a in attempts])
        seq += n
    with store.atomic() as tx:
        from rolloutdb.store import pools

        pools.advance_cursor(tx, groups, 0)
    store.close()  # the last close folds the WAL into the file, where cp will see the bytes
    assert not Path(f"{path}-wal").exists()
    if page_size:
        # What-if: the same rows in pages of another size (VACUUM rewrites the file).
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute("PRAGMA journal_mode = DELETE")
            conn.execute(f"PRAGMA page_size = {int(page_size)}")
            conn.execute("VACUUM")
            conn.execute("PRAGMA journal_mode = WAL")
    return Store.open(path)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="sample payload in the store (GiB)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=None,
                    help="rebuild the store with this SQLite page size first (default: the store's own, 4096)")
    ap.add_argument("--dir", type=Path, default=None, help="where to build (default: a temp dir in /tmp)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_publish_", dir=args.dir))
    try:
        print(machine_line())
        t0 = time.perf_counter()
        store = build_store(work / "live.sqlite", args.gb, args.page_size)
        size = (work / "live.sqlite").stat().st_size
        with contextlib.closing(sqlite3.connect(work / "live.sqlite")) as conn:
            page = conn.execute("PRAGMA page_size").fetchone()[0]
        print(f"built a {size / 2**30:.2f} GiB store ({page}-byte pages) in {time.perf_counter() - t0:.1f} s")
        pub = Publisher(work / "ckpt", retention=Retention(KeepNewestSnapshots(100)))
        pub.publish_bootstrap()
        publish_s, cp_s, phases = [], [], []
        copy = work / "copy.sqlite"

        def publish():
            published.append(pub.publish_rollout_snapshot("bootstrap", lambda p: store.capture(p), "bench: 1\n"))

        def cp():
            subprocess.run(["cp", str(work / "live.sqlite"), str(copy)], check=True)
            subprocess.run(["sync", str(copy)], check=True)

        for i in range(args.repeats):
            published: list = []
            # Alternate which goes first, and start each from a clean page cache state
            # (no dirty pages left by the other), so neither inherits the other's writeback.
            order = [("publish", publish), ("cp", cp)]
            for name, fn in order if i % 2 == 0 else reversed(order):
                os.sync()
                (publish_s if name == "publish" else cp_s).append(timed(fn))
            phases.append({**published[0].manifest.timings, **published[0].timings})
            snap_bytes = published[0].manifest.total_bytes
            shutil.rmtree(published[0].path)  # clean up outside the timings
            copy.unlink()
            print(f"  run {i + 1}: publish {publish_s[-1]:.2f} s ({snap_bytes / 2**30:.2f} GiB), "
                  f"cp+sync {cp_s[-1]:.2f} s, ratio {cp_s[-1] / publish_s[-1]:.2f}", flush=True)
        store.close()
        p, c = statistics.median(publish_s), statistics.median(cp_s)
        ratios = sorted(cp / pub_t for cp, pub_t in zip(cp_s, publish_s))
        ph = {k: statistics.median(d.get(k, 0.0) for d in phases) for k in phases[0]}
        print(f"\nmedian of {args.repeats}: capture+publish {p:.2f} s ({size / 2**20 / p:.0f} MiB/s), "
              f"cp+sync {c:.2f} s ({size / 2**20 / c:.0f} MiB/s)")
        print(f"ratio (cp time / publish time), per run: median {statistics.median(ratios):.2f}x, "
              f"range {ratios[0]:.2f}-{ratios[-1]:.2f}; of medians {c / p:.2f}x (goal >= 0.5x)")
        print("publish phases (median s): " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
