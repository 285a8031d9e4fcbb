"""Upgrade of a 100k-group store file from the oldest revision to head, against a plain
copy of the same file, in one run (the v1_4_a compaction and v1_5_a's one row per step;
goal <= 3 s, BENCHMARKS.md "A bounded live store").

    python bench/bench_compaction_upgrade.py                 # 100k groups (the BENCHMARKS.md figure)
    python bench/bench_compaction_upgrade.py --groups 20000 --repeats 1

Builds a file at the oldest revision (v1_0_a, made by the migrations) holding what a long
run leaves: `--groups` ledger groups by sampler position, 8 attempts each (a retried
generation now and then), of which `--in-flight` at the end are dispatched with running
attempts and the rest trained at 8 groups per step, one in 50 discarded for zero reward
variance. Rows are written with plain SQL for v1_0_a's tables (the same content the
store's transitions would leave, without paying for 100k transitions). Then, `--repeats`
times, each on a fresh copy, after `os.sync()`:

* upgrade: `upgrade_file(path)`: every check (integrity, strict identification), the
  backup-API copy, the migrations v1_1_a .. head (v1_4_a compacts: ranges from the
  settled rows, the two tables rebuilt with only the live rows; v1_5_a turns the ranges
  into one settled_steps row per step, in Python), the integrity check of
  the result, fsync and the rename into place;
* migrate: `run_migrations` on a copy alone (the migrations without upgrade_file's checks
  and copy);
* copy: `shutil.copyfile` of the file (what any upgrade through a copy pays at least).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from benchlib import machine_line, say  # noqa: E402

from rolloutdb.store.sqlite.revision import head_revision, known_revisions, run_migrations
from rolloutdb.store.sqlite.upgrade import upgrade_file

GOAL_S = 3.0
GROUPS_PER_STEP = 8
GENERATIONS = 8


def build(path: Path, groups: int, in_flight: int) -> dict[str, int]:
    oldest = known_revisions()[0]
    run_migrations(path, oldest)
    rng = random.Random(0)
    settled = groups - in_flight
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("BEGIN")
        conn.execute("INSERT INTO run_meta VALUES (1, 'bench', 0, 'f', 'f', '{}', 1, 64, 0)")
        conn.execute("INSERT INTO sampler_state VALUES (1, ?, 0, 0, 'target_step')", (groups,))
        group_rows, attempt_rows, attempt_id = [], [], 0
        step, in_step = 1, 0
        for seq in range(groups):
            if seq < settled:
                discarded = rng.random() < 0.02
                state, reason, trained = ("discarded", "zero_reward_variance", None) if discarded else ("trained", None, step)
                target = step
                if not discarded:
                    in_step += 1
                    if in_step == GROUPS_PER_STEP:
                        step, in_step = step + 1, 0
            else:
                state, reason, trained, target = "dispatched", None, None, step + 1
            group_rows.append((seq + 1, seq, seq // 50_000, seq % 50_000, GENERATIONS, target, state, reason,
                               max(0, target - 2), trained, 1.0, 2.0))
            for gen in range(GENERATIONS):
                attempts = 2 if rng.random() < 0.05 else 1
                for a in range(attempts):
                    attempt_id += 1
                    last = a == attempts - 1
                    a_state = ("running" if state == "dispatched" else "finished") if last else "abandoned"
                    attempt_rows.append((attempt_id, seq + 1, gen, a, a_state, None if last else "deadline",
                                         max(0, target - 2), 1.0, None if a_state == "running" else 2.0))
        conn.executemany("INSERT INTO prompt_groups VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", group_rows)
        conn.executemany("INSERT INTO rollouts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", attempt_rows)
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode = DELETE")
    finally:
        conn.close()
    return {"groups": len(group_rows), "rollouts": len(attempt_rows)}


CPU: dict[str, list[float]] = {}


def timed(fn, name: str) -> float:
    """Wall seconds of fn(); its CPU seconds (this process) go to CPU[name]: on a shared,
    loaded machine the wall time follows the load, the CPU time much less."""
    os.sync()
    t, c = time.perf_counter(), time.process_time()
    fn()
    CPU.setdefault(name, []).append(time.process_time() - c)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=100_000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_upgrade_") as tmp:
        work = Path(tmp)
        source = work / "v1_0_a.sqlite"
        t = time.perf_counter()
        counts = build(source, args.groups, args.in_flight)
        say(f"# {machine_line()}")
        say(f"built {source.name}: {counts['groups']} groups, {counts['rollouts']} rollouts, "
            f"{source.stat().st_size / 2**20:.1f} MiB at {known_revisions()[0]} in {time.perf_counter() - t:.1f} s")
        results: dict[str, list[float]] = {"upgrade": [], "migrate": [], "copy": []}
        for r in range(args.repeats):
            for name in ("copy", "upgrade", "migrate")[r % 3:] + ("copy", "upgrade", "migrate")[: r % 3]:
                target = work / f"{name}_{r}.sqlite"
                if name == "copy":
                    results[name].append(timed(lambda: shutil.copyfile(source, target), name))
                    continue
                shutil.copyfile(source, target)
                if name == "upgrade":
                    results[name].append(timed(lambda: upgrade_file(target), name))
                else:
                    results[name].append(timed(lambda: run_migrations(target), name))
                with sqlite3.connect(target) as conn:
                    left = conn.execute("SELECT count(*) FROM prompt_groups").fetchone()[0]
                    ranges = conn.execute("SELECT count(*) FROM settled_steps").fetchone()[0]
                    rev = conn.execute("SELECT version_num FROM alembic_version").fetchone()[0]
                assert rev == head_revision() and left == args.in_flight, (rev, left)
                size = target.stat().st_size
                target.unlink()
        say(f"after ({name}, the last timed): {left} live groups, {ranges} settled_steps rows, file {size / 2**20:.1f} MiB "
            "(upgrade VACUUMs; migrate keeps the free pages)")
        copy = statistics.median(results["copy"])
        for name, values in results.items():
            med = statistics.median(values)
            say(f"{name:<8} median {med:6.3f} s wall, {statistics.median(CPU[name]):6.3f} s CPU  "
                f"(runs {', '.join(f'{v:.3f}' for v in values)})  {med / copy:5.1f}x copy")
        up = statistics.median(results["upgrade"])
        cpu = statistics.median(CPU["upgrade"])
        say(f"upgrade {known_revisions()[0]} -> {head_revision()} of {args.groups} groups: {up:.2f} s wall, "
            f"{cpu:.2f} s CPU (goal <= {GOAL_S} s: {'met' if up <= GOAL_S else 'MISSED'} on wall time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
