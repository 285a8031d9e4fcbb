"""A run that keeps publishing, for the crash tests to SIGKILL.

    python tests/publish_child.py WORKDIR [--iterations N] [--seed S] [--keep K]

WORKDIR/live.sqlite is the live store (created on the first run, reopened afterwards:
after a kill SQLite recovers it from its WAL) and WAL/ckpt is the checkpoint directory.
Each iteration changes the store through real transitions (reserve, dispatch, finish,
seal, enter the replay buffer, train), publishes a trainer checkpoint every third iteration,
and publishes a rollout snapshot anchored to the newest durable trainer checkpoint.
Retention keeps few snapshots, so deletes happen all the time. Prints ``ready`` once
set up and ``published <seq>`` after each snapshot.

Kill it from outside, or set ROLLOUTDB_FAULT=<point>[@n] to make it SIGKILL itself at
a named fault point (see rolloutdb.store.faults.POINTS).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

from rolloutdb.store import FinishedGeneration, Publisher, Reservation, Retention, Store, scan, pools
from rolloutdb.store.checkpoints.retention import KeepNewestSnapshotPerAnchor, KeepNewestSnapshots, PruneBootstrap

CONFIG = "run:\n  name: crash-test\n  snapshot_every_s: 0\n"


def open_store(workdir: Path) -> Store:
    live = workdir / "live.sqlite"
    if live.exists():
        return Store.open(live)
    return Store.create(live, replay_capacity=64, config_fingerprint="crash-test")


def newest_durable_anchor(ckpt: Path) -> tuple[str | None, int]:
    anchors = scan(ckpt).complete_anchors()
    if not anchors:
        return None, -1
    a = anchors[-1]
    return a.anchor, (a.step if a.step is not None else -1)


def write_weights(rng: random.Random, size: int):
    def write(tmpdir: Path) -> None:
        (tmpdir / "model.safetensors").write_bytes(rng.randbytes(size))
        (tmpdir / "trainer_state.json").write_text('{"global_step": 0}\n')
    return write


def mutate(store: Store, rng: random.Random) -> None:
    """One iteration of pump work: two new groups, one of them carried to replay and
    the oldest group in replay trained; the other left in flight."""
    with store.read() as conn:
        seq = pools.read_cursor(conn).next_seq
    a, b = store.reserve([Reservation(seq, 0, seq), Reservation(seq + 1, 0, seq + 1)], num_generations=2, target_step=1)
    attempts = store.dispatch([a, b], policy_version=0)
    for attempt in attempts[:2]:
        n = rng.randrange(64, 4096)
        store.finish(attempt, FinishedGeneration(list(range(n)), [-0.25] * n, rng.random(), [(0, n)]))
    store.seal([a])
    store.enter_replay([a])
    with store.read() as conn:
        published = [r[0] for r in conn.exec_driver_sql(
            "SELECT group_id FROM prompt_groups WHERE state = 'published' ORDER BY group_id").fetchall()]
    if len(published) > 3:
        store.mark_trained(published[:1], step=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=int, default=2)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed * 1000003 + os.getpid())
    args.workdir.mkdir(parents=True, exist_ok=True)
    ckpt = args.workdir / "ckpt"
    store = open_store(args.workdir)
    retention = Retention(KeepNewestSnapshots(args.keep), KeepNewestSnapshotPerAnchor(1), PruneBootstrap())
    publisher = Publisher(ckpt, retention=retention)
    anchor, step = newest_durable_anchor(ckpt)
    if anchor is None:
        publisher.publish_bootstrap(write_weights(rng, 4096))
        anchor, step = newest_durable_anchor(ckpt)
    print("ready", flush=True)
    for i in range(args.iterations):
        mutate(store, rng)
        if i % 3 == 2:
            step += 1
            publisher.publish_trainer_checkpoint(step, write_weights(rng, rng.randrange(1 << 14, 1 << 17)))
            anchor = f"step_{step}"
        env = f'{{"episodes": {i}}}\n'
        published = publisher.publish_rollout_snapshot(anchor, lambda p: store.capture(p), CONFIG, env)
        print("published", published.sequence, flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
