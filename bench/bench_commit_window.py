"""Snapshot attempts skipped for the optimizer commit, with a trainer whose step spends
`--prepare-s` (2 s: a GPU step's forward and backward) before a commit of a few ms, and
interval snapshots every `--interval-s` (0.5 s). The staged trainer (`StagedTrainer`:
the train pump holds the commit lock around `commit_step` only) next to the same trainer
seen through `train_step` alone (the lock around the whole step: what every trainer got
before the split, and what a trainer without it still gets), both runs side by side,
started together on the same config and seed.

    python bench/bench_commit_window.py            # the figure in BENCHMARKS.md
    python bench/bench_commit_window.py --quick    # 3 steps of 0.5 s

The trainer is tests/slow_prepare_trainer.py (the built-in GRPO trainer plus a sleep
after its backward; it records each prepare and commit). Reported per run: snapshot
attempts by outcome (the metrics log's `snapshot` lines), the share `skipped_commit` of
all attempts and of those that began while a step was being trained (from its prepare's
start to its commit's end), the time the commit lock was held per step (the commit, or
the whole step) and the wall time. Goal (issue 28): skipped_commit <= 10% of the
interval attempts. All attempts are counted, the one forced at each step boundary (the
new checkpoint's cut) included: it is never skipped for the commit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from benchlib import machine_line, say, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "tests" / "slow_prepare_trainer.py"
VARIANTS = {"whole step under the lock": False, "staged (commit under the lock)": True}


def command(run_dir: Path, windows: Path, staged: bool, args) -> list[str]:
    options = f"{{prepare_s: {args.prepare_s}, staged: {str(staged).lower()}, windows: {windows}}}"
    return [sys.executable, "-m", "rolloutdb", "train", "--config", str(REPO / "examples" / "quickstart.yaml"),
            "--run-dir", str(run_dir), "run.seed=7", f"algorithm.total_steps={args.steps}",
            "algorithm.groups_per_step=3", "algorithm.group_size=4", "environment.dataset_size=64",
            "environment.n_digits=2", "generation.max_tokens=4", "generation.max_batch_size=12",
            "checkpointing.interval_steps=1", "rollout_checkpointing.enabled=true",
            f"rollout_checkpointing.interval_s={args.interval_s}", "trace.enabled=false",
            "logging.progress=false", "logging.plot=false",
            f"trainer.factory={TRAINER}:make_trainer", f"trainer.options={options}"]


def figures(run_dir: Path, windows: Path, staged: bool, wall_s: float) -> dict:
    records = [json.loads(line) for line in windows.read_text().splitlines()]
    prepares = {r["step"]: r for r in records if r["stage"] == "prepare"}
    commits = {r["step"]: r for r in records if r["stage"] == "commit"}
    steps = sorted(set(prepares) & set(commits))
    # The commit lock: around commit_step (staged), around prepare + commit (whole step).
    held = [commits[s]["t_end"] - (commits[s] if staged else prepares[s])["t_start"] for s in steps]
    training = [(prepares[s]["t_start"], commits[s]["t_end"]) for s in steps]
    events = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    attempts = [e for e in events if e.get("kind") == "snapshot"]
    during = []
    for e in attempts:
        total = (e.get("timings") or {}).get("total")
        start = e["t"] - total if total is not None else e["t"]  # a skip is recorded as it is decided
        if any(a <= start <= b for a, b in training):
            during.append(e)
    outcomes, outcomes_during = Counter(e["outcome"] for e in attempts), Counter(e["outcome"] for e in during)
    return {
        "steps": len(steps),
        "attempts": len(attempts),
        "outcomes": dict(outcomes),
        "skipped_commit_share": outcomes["skipped_commit"] / max(len(attempts), 1),
        "attempts_during_steps": len(during),
        "outcomes_during_steps": dict(outcomes_during),
        "skipped_commit_share_during_steps": outcomes_during["skipped_commit"] / max(len(during), 1),
        "lock_held_per_step_s": {"median": statistics.median(held), "max": max(held)} if held else {},
        "wall_s": wall_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prepare-s", type=float, default=2.0)
    ap.add_argument("--interval-s", type=float, default=0.5)
    ap.add_argument("--quick", action="store_true", help="3 steps of 0.5 s, snapshots every 0.2 s")
    ap.add_argument("--dir", help="where the runs go (removed after); default: a temporary directory")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.prepare_s, args.interval_s = 3, 0.5, 0.2
    base = Path(tempfile.mkdtemp(prefix="bench_commit_window_", dir=args.dir))
    say(machine_line())
    say(f"{args.steps} steps, each {args.prepare_s} s before its commit; snapshots every {args.interval_s} s")
    result: dict = {"args": vars(args), "machine": machine_line(), "runs": {}}
    try:
        procs = {}
        for i, (name, staged) in enumerate(VARIANTS.items()):
            run_dir, windows = base / f"run{i}", base / f"windows{i}.jsonl"
            procs[name] = (run_dir, windows, staged, time.monotonic(),
                           subprocess.Popen(command(run_dir, windows, staged, args), stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True))
        for name, (run_dir, windows, staged, t0, proc) in procs.items():
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"{name}: rolloutdb train exited {proc.returncode}: {err[-2000:]}")
            result["runs"][name] = figures(run_dir, windows, staged, time.monotonic() - t0)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for name, r in result["runs"].items():
        held = r["lock_held_per_step_s"]
        say(f"{name}: {r['outcomes'].get('skipped_commit', 0)} of {r['attempts']} attempts skipped_commit "
            f"({100 * r['skipped_commit_share']:.0f}%); while a step trained "
            f"{r['outcomes_during_steps'].get('skipped_commit', 0)} of {r['attempts_during_steps']} "
            f"({100 * r['skipped_commit_share_during_steps']:.0f}%); outcomes {r['outcomes']}; commit lock held "
            f"{held.get('median', 0) * 1000:.1f} ms median, {held.get('max', 0) * 1000:.1f} ms max per step; "
            f"wall {r['wall_s']:.1f} s")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
