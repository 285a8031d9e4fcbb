"""Per-event work against the run's length: each cost that could grow, timed at a small
and a large size side by side (BENCHMARKS.md, "Per-event costs against the run's length
(issue 32 item 3)").

    python bench/bench_per_event.py                      # 30 vs 3000 steps, 0 vs 3M trace rows
    python bench/bench_per_event.py --steps 30 300 --trace-rows 300000   # shorter
    python bench/bench_per_event.py --only trace         # the trace's batches alone

- settle: `Store.mark_trained` and `Store.discard` p50 over the first and the last 30
  steps of bench_bounded_store.py's loop (the quickstart's shape through the Store API);
- the snapshot's copy check (`check_invariants`, which `copy_problems` runs on every
  copy) and `settled_runs` (its decode of the settled record) on that loop's snapshot at
  each step count, and `audit_ledger` (a resume's, verify's audit);
- a trace batch: 1000 `call_finished` rows committed into an empty trace and into one
  holding --trace-rows rows (random prompt ids, group ids in the order a run reserves
  them), its index keyed as at trace_v1_5_a (prompt first), as at trace_v1_6_a (group
  first) and with none, batches alternated across the three (`--only trace`: just this);
- a turn's save (`pools.put_episodes`, 256 tokens added) to a 1k- and a 32k-token transcript;
- the memory `PromptOrder` holds after walking 40 epochs of a 100k-prompt dataset.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sqlite3
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import bench_bounded_store as loop  # noqa: E402
from benchlib import machine_line, say  # noqa: E402

from rolloutdb.controller.run.sampler import PromptOrder
from rolloutdb.store import Reservation, Store, check_invariants, pools, queries
from rolloutdb.store.restore.choice import audit_ledger
from rolloutdb.store.trace.writer import open_trace_file

_CALL = ("INSERT INTO call_finished (seq, t, run, group_id, prompt_id, generation_index, attempt, step, "
         "policy_version, turn, tokens, finish_reason) VALUES (?, 0, 1, ?, ?, ?, 0, 1, 1, 0, 100, 'stop')")


def _ms(f, n: int = 20) -> float:
    return loop.median_ms(f, n)


def settles_and_checks(work: Path, steps: list[int]) -> None:
    """Time the Store's settling calls inside bench_bounded_store's loop, then the
    copy check on the snapshot it took at each step count."""
    taken: dict[str, list[float]] = {"mark_trained": [], "discard": []}
    for name in taken:
        real = getattr(Store, name)

        def timed(self, *a, _real=real, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _real(self, *a, **k)
            finally:
                taken[_name].append(time.perf_counter() - t0)
        setattr(Store, name, timed)
    loop.run(work / "live.sqlite", steps, work)
    for name, xs in taken.items():
        say(f"{name}: p50 {statistics.median(xs[:30]) * 1e3:.3f} ms over the first 30 calls, "
            f"{statistics.median(xs[-30:]) * 1e3:.3f} ms over the last 30")
    for s in steps:
        path = work / f"live_{s}.sqlite"
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            say(f"{s:>6} steps: check_invariants {_ms(lambda: check_invariants(conn)):.2f} ms, settled_runs "
                f"{_ms(lambda: queries.settled_runs(conn)):.2f} ms, audit_ledger "
                f"{_ms(lambda: audit_ledger(path, groups_per_step=loop.GROUPS), 5):.2f} ms")


# The index keys the trace's per-attempt tables have had: trace_v1_5_a's (led by the
# prompt id, which a run draws at random), trace_v1_6_a's (led by the group id, which
# grows as the run reserves groups), and none at all (the floor).
_INDEX_KEYS = {
    "prompt_id first (trace_v1_5_a)": ("prompt_id", "generation_index", "attempt"),
    "group_id first (trace_v1_6_a)": ("group_id", "generation_index", "attempt"),
    "none": None,
}
# Calls finish out of order among the groups in flight: a row's group is one of the last
# this many reserved.
IN_FLIGHT_GROUPS = 1024


def trace_batches(work: Path, rows: int, rounds: int = 20) -> None:
    """1000-row `call_finished` batches into traces of 0 and `rows` rows under each index
    key, alternated (each round one batch into each file, the same rows): the median."""
    rng = random.Random(0)
    for n in (0, rows):
        files = {}
        for k, (label, key) in enumerate(_INDEX_KEYS.items()):
            path = open_trace_file(work / f"trace_{n}_{k}.sqlite")
            conn = sqlite3.connect(path)
            conn.execute("PRAGMA synchronous = NORMAL")  # as the trace writer
            conn.execute("INSERT INTO runs (run, run_id, pid, host, first_t, last_t, last_seq) "
                         "VALUES (1, 'bench', 0, 'bench', 0, 0, 0)")
            conn.execute("DROP INDEX ix_call_finished_group_id_generation_index_attempt")
            # Groups of 8 generations reserved in order, prompts drawn at random.
            conn.execute(f"WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < {n}) "
                         "INSERT INTO call_finished (seq, t, run, group_id, prompt_id, generation_index, attempt, step, "
                         "policy_version, turn, tokens, finish_reason) SELECT i, 0, 1, i / 8, abs(random()) % 300000, "
                         "i % 8, 0, i / 64, i / 64, 0, 100, 'stop' FROM k" if n else "SELECT 1")
            if key:
                conn.execute(f"CREATE INDEX bench_key ON call_finished ({', '.join(key)})")
            conn.commit()
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            files[label] = (conn, [])
        seq = n + 1
        for _ in range(rounds):
            batch = [(seq + j, max(0, (seq + j) // 8 - rng.randrange(IN_FLIGHT_GROUPS)), rng.randrange(300_000), j % 8)
                     for j in range(1000)]
            seq += 1000
            for conn, xs in files.values():
                t0 = time.perf_counter()
                conn.executemany(_CALL, batch)
                conn.commit()
                xs.append(time.perf_counter() - t0)
        floor = statistics.median(files["none"][1])
        for label, (conn, xs) in files.items():
            say(f"trace of {n:>9} call_finished rows, index {label}: a 1000-row batch "
                f"{statistics.median(xs) * 1e3:.2f} ms ({statistics.median(xs) / floor:.2f}x the unindexed table)")
            conn.close()


def episode_saves(work: Path) -> None:
    store = Store.create(work / "episodes.sqlite", replay_capacity=16)
    (g,) = store.reserve([Reservation(0, 0, 0)], num_generations=1, target_step=1)
    (a,) = store.dispatch([g], policy_version=0)
    # A turn of 256 tokens on top of n saved (v1_11_a: `saved_tokens` n, the turn's tokens
    # appended; a store before it rewrote all n + 256); bench_turn_saves.py has the A/B.
    appends = "saved_tokens" in pools.EpisodeProgress.__dataclass_fields__
    for n in (1_000, 32_000):
        def save(turn=[0], n=n) -> None:  # noqa: B006 (a counter)
            turn[0] += 1
            m = n + 256
            extra = {"saved_tokens": n} if appends else {}
            p = pools.EpisodeProgress(a, g, 0, 0, turn[0], {"turn": turn[0]}, list(range(m)), [-0.1] * m,
                                      [0] * (m // 2) + [-1] * (m - m // 2), **extra)
            with store.atomic() as tx:
                pools.put_episodes(tx, [p])
        say(f"a turn's save (256 tokens) of a {n}-token transcript: {_ms(save):.2f} ms")
    store.close()


def sampler_memory() -> None:
    size = 100_000
    order = PromptOrder(size, seed=0)
    tracemalloc.start()
    for epoch in range(40):
        order.take(epoch * size, 3)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    say(f"PromptOrder after 40 epochs of {size} prompts: {held / 1e6:.1f} MB held")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[30, 3000])
    parser.add_argument("--trace-rows", type=int, default=3_000_000)
    parser.add_argument("--only", choices=("trace",), help="run only this part")
    args = parser.parse_args(argv)
    say(f"# {machine_line()}")
    with tempfile.TemporaryDirectory(prefix="bench_per_event_") as tmp:
        work = Path(tmp)
        if args.only == "trace":
            trace_batches(work, args.trace_rows)
            return 0
        settles_and_checks(work, sorted(args.steps))
        trace_batches(work, args.trace_rows)
        episode_saves(work)
    sampler_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
