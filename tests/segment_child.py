"""A run that keeps sealing payload into segments and publishing, for the segment crash
tests to SIGKILL.

    python tests/segment_child.py WORKDIR [--iterations N] [--seed S]

WORKDIR/live.sqlite is the live store (created on the first run, reopened after a kill)
and WORKDIR/ckpt the checkpoint directory. Each iteration finishes new samples (their
payload inline), trains the oldest published group (its samples leave the store, so
older segments become unreferenced), then does what the snapshot pump does: seal the
inline payload into a segment, capture, publish (retention keeps 2 snapshots and every
segment the live store references). Prints ``ready`` once set up and ``published <seq>``
after each snapshot. ROLLOUTDB_FAULT=<point>[@n] makes it SIGKILL itself at a named
point (rolloutdb.store.faults.SEGMENT_POINTS among them).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

from rolloutdb.store import Publisher, Retention, Store, seal_inline_payload, segments_dir_of
from rolloutdb.store.checkpoints.retention import KeepNewestSnapshots, PruneBootstrap

sys.path.insert(0, str(Path(__file__).resolve().parent))
from publish_child import mutate, open_store  # noqa: E402  (the same pump work)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed * 1000003 + os.getpid())
    args.workdir.mkdir(parents=True, exist_ok=True)
    ckpt = args.workdir / "ckpt"
    store = open_store(args.workdir)
    store.segments_dir = segments_dir_of(ckpt)
    publisher = Publisher(ckpt, retention=Retention(KeepNewestSnapshots(2), PruneBootstrap()),
                          live_references=store.segment_references)
    if not (ckpt / "bootstrap").is_dir():
        publisher.publish_bootstrap(lambda d: (d / "weights.bin").write_bytes(b"w" * 4096))
    print("ready", flush=True)
    for _ in range(args.iterations):
        mutate(store, rng)
        with publisher.lock:
            seal_inline_payload(store, ckpt)
            published = publisher.publish_rollout_snapshot("bootstrap", lambda p: store.capture(p), "a: 1\n")
        print("published", published.sequence, flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
