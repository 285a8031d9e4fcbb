"""Size of the live store and of a rollout snapshot vs steps run, with settled groups
compacted (v1_4_a, one row per step since v1_5_a) and without (every settled group kept
as a ledger row), side by side in one run (BENCHMARKS.md, "A bounded live store").

    python bench/bench_bounded_store.py                    # 30, 300, 3000 steps
    python bench/bench_bounded_store.py --steps 30 300     # shorter
    python bench/bench_ab.py --rev REV bench_bounded_store.py --steps 30 3000 --no-baseline

The quickstart's shape through the Store API (no model, so 3000 steps take seconds, not
hours): 8 groups per step of 8 generations, 4-token samples, groups stamped one step
ahead (max_staleness 1) so one step's groups are in flight while the previous one trains,
one group in 8 discarded for zero reward variance and refilled, a generation retried now
and then (an abandoned attempt), and a snapshot attempt recorded every step (the
quickstart snapshots every 2 s, about a step). At each size it reports the live store's
file size and the size of a snapshot taken with `Store.capture` (the backup API, as the
snapshot pump takes them). Like with like: in both columns the WAL is checkpointed and
truncated through the store's own writer (`wal_checkpoint(TRUNCATE)`, repeated until no
reader keeps it busy) before the file is measured, and the WAL left (0 bytes when the
truncate succeeded) is printed apart from the file, for both. A checkpoint from a second
connection reported busy without saying so and left one column's WAL in its figure.

"before" is the same loop with `compaction.settle_groups` replaced by a no-op: settled
groups keep their ledger and attempt rows, as they did before v1_4_a. "after" is the
compaction at head (v1_5_a: one `settled_steps` row per step; its rows and pages are
listed; v1_12_a: the rows of steps older than the kept ones fold into `settled_prefix`).
Goal, as issue 32 states it: the live store after 3000 steps <= 1.2x its size after
30 (flat); every size is printed against the smallest, met/missed, live file and snapshot.

At each size it also times, on the snapshot, the check every snapshot's publish runs on
its copy (`check_invariants`, via `copy_problems`) and a resume's audit (`audit_ledger`):
both decode the settled record, so they follow its rows. `--json PATH` writes the
"after" figures (bench_ab.py compares them across revisions); `--no-baseline` skips the
"before" loop.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from benchlib import machine_line, say  # noqa: E402

from rolloutdb.store import FinishedGeneration, Reservation, Store, check_invariants, ledger, pools
from rolloutdb.store.restore.choice import audit_ledger

GROUPS, GENERATIONS, TOKENS = 8, 8, 4
GOAL = 1.2


def _gen(rng: random.Random) -> FinishedGeneration:
    return FinishedGeneration([rng.randint(3, 40) for _ in range(TOKENS)], [-rng.random() for _ in range(TOKENS)],
                              float(rng.random() < 0.5), [(0, TOKENS)])


def _truncate_wal(store: Store) -> None:
    """Checkpoint and truncate the WAL through the writer until no reader holds it."""
    for _ in range(50):
        if store.db.checkpoint("TRUNCATE")[0] == 0:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{store.path}: the WAL stayed busy; the sizes would not compare")


# Seconds per `mark_trained` of the "after" loop: the steps whose settle folds (v1_12_a,
# every FOLD_EVERY steps past KEEP_STEPS) and the others.
SETTLES: dict[str, list[float]] = {"fold": [], "plain": []}


def run(path: Path, steps: list[int], snaps: Path) -> dict[int, tuple[int, int, int, int, int, int]]:
    """Sizes (live file bytes, snapshot bytes, ledger + attempt rows, settled_steps rows,
    settled_steps pages, WAL bytes after the truncate) at each step count in `steps`."""
    rng = random.Random(0)
    out: dict[int, tuple[int, int, int, int, int, int]] = {}
    store = Store.create(path, replay_capacity=64)
    seq, published = 0, {}

    def stamp(step: int) -> None:
        nonlocal seq
        need = GROUPS
        while need:
            (g,) = store.reserve([Reservation(seq, seq // 1000, seq % 1000)], num_generations=GENERATIONS,
                                 target_step=step)
            zero = seq % 8 == 5
            seq += 1
            attempts = store.dispatch([g], policy_version=step - 1)
            if rng.random() < 0.1:
                store.abandon(attempts[:1], "deadline")
                with store.atomic() as tx:
                    attempts[0] = ledger.start_attempts(tx, [(g, 0)], policy_version=step - 1)[0]
            with store.atomic() as tx:
                ledger.finish_attempts(tx, [(a, _gen(rng)) for a in attempts])
            if zero:
                store.discard([g], reason="zero_reward_variance")
                continue
            store.seal([g])
            store.enter_replay([g])
            published.setdefault(step, []).append(g)
            need -= 1
        with store.atomic() as tx:
            pools.advance_cursor(tx, seq, seq // 1000)

    stamp(1)
    every, kept = getattr(ledger, "FOLD_EVERY", None), getattr(ledger, "KEEP_STEPS", 0)  # v1_12_a on
    for step in range(1, max(steps) + 1):
        stamp(step + 1)
        t0 = time.perf_counter()
        store.mark_trained(published.pop(step), step=step)
        folds = bool(every) and step % every == 0 and step > kept
        SETTLES["fold" if folds else "plain"].append(time.perf_counter() - t0)
        store.record_snapshot_attempt("published", anchor=f"step_{step}", snapshot_seq=step,
                                      timings={"lock": 0.0001, "env": 0.0, "cut": 0.0004, "capture": 0.003,
                                               "publish": 0.01})
        if step in steps:
            _truncate_wal(store)
            with contextlib.closing(sqlite3.connect(path)) as conn:
                rows = conn.execute("SELECT (SELECT count(*) FROM prompt_groups) + (SELECT count(*) FROM rollouts)"
                                    ).fetchone()[0]
                settled = conn.execute("SELECT count(*) FROM settled_steps").fetchone()[0]
                pages = conn.execute("SELECT count(*) FROM dbstat WHERE name = 'settled_steps'").fetchone()[0]
            snap = snaps / f"{path.stem}_{step}.sqlite"
            store.capture(snap)
            wal = path.with_name(path.name + "-wal")
            out[step] = (path.stat().st_size, snap.stat().st_size, rows, settled, pages,
                         wal.stat().st_size if wal.exists() else 0)
    store.close()
    return out


def median_ms(f, n: int) -> float:
    """The median of `n` timed calls of `f`, in ms."""
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e3


def checks(snaps: Path, steps: list[int]) -> dict[int, tuple[float, float]]:
    """(copy check ms, audit ms), medians, on the "after" snapshot at each step count."""
    out = {}
    for s in steps:
        path = snaps / f"after_{s}.sqlite"
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            assert check_invariants(conn).ok, f"{path}: the snapshot fails its own check"
            check = median_ms(lambda: check_invariants(conn), 15)
        out[s] = (check, median_ms(lambda: audit_ledger(path, groups_per_step=GROUPS), 5))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[30, 300, 3000])
    parser.add_argument("--no-baseline", action="store_true", help="skip the loop without compaction")
    parser.add_argument("--json", type=Path, default=None, help="write the 'after' figures here")
    args = parser.parse_args(argv)
    steps = sorted(args.steps)
    say(f"# {machine_line()}")
    with tempfile.TemporaryDirectory(prefix="bench_bounded_") as tmp:
        work = Path(tmp)
        after = run(work / "after.sqlite", steps, work)
        settles = {k: statistics.median(v) * 1e3 if v else None for k, v in SETTLES.items()}
        timed = checks(work, steps)
        keep = ledger.settle_groups
        ledger.settle_groups = lambda conn, ids: None  # the baseline: settled rows stay in the ledger
        try:
            before = after if args.no_baseline else run(work / "before.sqlite", steps, work)
        finally:
            ledger.settle_groups = keep
    say(f"{'steps':>6} | {'before: live':>13} {'WAL':>7} {'snapshot':>10} {'rows':>8} | {'after: live':>12} {'WAL':>7} "
        f"{'snapshot':>10} {'rows':>5} {'settled_steps rows':>18} {'pages':>5}")
    for s in steps:
        b, a = before[s], after[s]
        say(f"{s:>6} | {b[0] / 1024:>10.0f} KiB {b[5] / 1024:>3.0f} KiB {b[1] / 1024:>6.0f} KiB {b[2]:>8} | "
            f"{a[0] / 1024:>8.0f} KiB {a[5] / 1024:>3.0f} KiB {a[1] / 1024:>6.0f} KiB {a[2]:>5} {a[3]:>18} {a[4]:>5}")
    base = steps[0]
    for s in steps[1:]:
        for name, figures in (("before", before), ("after", after)):
            live, snap = figures[s][0] / figures[base][0], figures[s][1] / figures[base][1]
            verdict = "met" if max(live, snap) <= GOAL else "missed"
            if name == "after" or not args.no_baseline:
                say(f"{name:<6} {s} vs {base} steps: live {live:.2f}x, snapshot {snap:.2f}x (goal <= {GOAL}x: {verdict})")
    for s in steps:
        say(f"after  {s:>6} steps: the copy check {timed[s][0]:.2f} ms, the audit {timed[s][1]:.2f} ms (medians)")
    top = steps[-1]
    say(f"after: a train step's settle p50 {settles['plain']:.3f} ms; one that folds "
        + (f"p50 {settles['fold']:.3f} ms ({len(SETTLES['fold'])} folds)" if settles["fold"] else "never ran"))
    say(f"after  {top} vs {base} steps: copy check {timed[top][0] / timed[base][0]:.2f}x, "
        f"audit {timed[top][1] / timed[base][1]:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({
            "by": {str(s): {"live_kib": after[s][0] / 1024, "snapshot_kib": after[s][1] / 1024,
                            "settled_rows": after[s][3], "check_ms": timed[s][0], "audit_ms": timed[s][1]}
                   for s in steps},
            "live_growth": after[top][0] / after[base][0], "snapshot_growth": after[top][1] / after[base][1],
            "check_growth": timed[top][0] / timed[base][0], "audit_growth": timed[top][1] / timed[base][1],
            "largest": {"settled_rows": after[top][3], "check_ms": timed[top][0], "audit_ms": timed[top][1]},
            "settle_ms_p50": settles["plain"], "fold_settle_ms_p50": settles["fold"],
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
