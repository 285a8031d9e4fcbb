"""The crash harness: run the main job as a real subprocess, SIGKILL it (at a named fault
point or at a random moment), resume, and repeat until the run ends; then check the
whole chain of stops.

Used by tests/test_crash_resume.py (a quick tier in CI, a long tier behind `slow`) and
runnable by hand:  python tests/crash_harness.py RUN_DIR --kills 20 --seed 1
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "quickstart.yaml"
STEPS, GROUPS, GROUP_SIZE, DATASET, SEED = 5, 3, 4, 64, 7
OVERRIDES = [
    f"run.seed={SEED}",
    f"algorithm.total_steps={STEPS}",
    f"algorithm.groups_per_step={GROUPS}",
    f"algorithm.group_size={GROUP_SIZE}",
    "generation.max_tokens=4",
    "generation.max_batch_size=12",
    f"environment.dataset_size={DATASET}",
    "environment.n_digits=2",
    "checkpointing.interval_steps=1",
    "rollout_checkpointing.enabled=true",
    "rollout_checkpointing.interval_s=0.1",
    "rollout_checkpointing.trace=true",
    "logging.progress=false",
    "logging.plot=false",
]


@dataclass
class ChainResult:
    kills: int = 0
    runs: int = 0
    finished: bool = False
    killed_at: list[str] = field(default_factory=list)
    restores: list[tuple[str | None, str | None]] = field(default_factory=list)  # (expected, used)
    problems: list[str] = field(default_factory=list)


def _command(run_dir: Path, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "rolloutdb", "train", "--config", str(EXAMPLE), "--run-dir", str(run_dir)]
    return cmd + (["--resume"] if resume else []) + OVERRIDES


def _env(fault: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUTDB_FAULT"}
    env["RAY_AUTH_MODE"] = "disabled"
    if fault:
        env["ROLLOUTDB_FAULT"] = fault
    return env


def _expected_snapshot(run_dir: Path) -> str | None:
    from rolloutdb.store.selection import select_for_restore

    sel = select_for_restore(run_dir / "checkpoints", verify=False)
    return None if sel is None else str(sel.snapshot.path)


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "logs" / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a kill
    return out


def check_after_kill(run_dir: Path, result: ChainResult) -> None:
    """What must hold at any moment a kill can leave behind."""
    from rolloutdb.store.invariants import check_invariants
    from rolloutdb.store.layout import scan
    from rolloutdb.store.verification import verify_path

    ckpt = run_dir / "checkpoints"
    if ckpt.exists():
        for entry in scan(ckpt).entries:
            if entry.complete:
                report = verify_path(entry.path)
                if not report.ok:
                    result.problems.append(f"published {entry.path.name} fails verification: {report.problems[:2]}")
    store = run_dir / "rollout_state.sqlite"
    if store.exists():
        conn = sqlite3.connect(store)
        try:
            if conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'run_meta'").fetchone()[0]:
                if conn.execute("SELECT count(*) FROM run_meta").fetchone()[0]:
                    report = check_invariants(conn)
                    if not report.ok:
                        result.problems.append(f"live store after a kill: {report.problems[:2]}")
        finally:
            conn.close()


def run_once(run_dir: Path, result: ChainResult, *, fault: str | None = None, kill_after: float | None = None,
             timeout: float = 300) -> int:
    """One process of the chain; returns its exit code (-9 when killed)."""
    resume = (run_dir / "rollout_state.sqlite").exists()
    expected = _expected_snapshot(run_dir) if resume else None
    seen = len(_metrics(run_dir))
    proc = subprocess.Popen(_command(run_dir, resume), env=_env(fault), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if kill_after is not None:
        deadline = time.time() + timeout
        # A random moment of *this* process's work: count from when it touches the run.
        while proc.poll() is None and time.time() < deadline and len(_metrics(run_dir)) <= seen and not _touched(run_dir, resume):
            time.sleep(0.05)
        time.sleep(kill_after)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    try:
        _out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _out, err = proc.communicate()
        result.problems.append(f"a run hung for {timeout} s")
    result.runs += 1
    if proc.returncode == -signal.SIGKILL:
        result.kills += 1
        result.killed_at.append(fault or f"random+{kill_after:.2f}s")
    elif proc.returncode != 0:
        result.problems.append(f"run exited {proc.returncode}: {err.strip().splitlines()[-1:] if err else ''}")
    if resume:
        restores = [e for e in _metrics(run_dir)[seen:] if e.get("kind") == "restore"]
        if restores:
            result.restores.append((expected, restores[0].get("snapshot")))
    check_after_kill(run_dir, result)
    return proc.returncode


def _touched(run_dir: Path, resume: bool) -> bool:
    return resume or (run_dir / "rollout_state.sqlite").exists()


def finish(run_dir: Path, result: ChainResult, attempts: int = 3) -> None:
    for _ in range(attempts):
        if run_once(run_dir, result) == 0:
            result.finished = True
            return


def check_chain(run_dir: Path, result: ChainResult) -> None:
    """Exactly-once and the other promises, over the whole chain of stops."""
    from rolloutdb.controller.sampler import PromptOrder
    from rolloutdb.store.resume import verify_run

    verdict = verify_run(run_dir)
    if not verdict.ok:
        result.problems.append(f"verify_run: {verdict.line()} {verdict.problems[:3]}")
    if verdict.trained != STEPS * GROUPS:
        result.problems.append(f"trained {verdict.trained} groups, expected {STEPS * GROUPS}")
    conn = sqlite3.connect(run_dir / "rollout_state.sqlite")
    try:
        order = PromptOrder(DATASET, SEED)
        rows = conn.execute("SELECT sample_seq, epoch, prompt_id FROM prompt_groups UNION ALL "
                            "SELECT sample_seq, epoch, prompt_id FROM spare_prompts ORDER BY 1").fetchall()
        cursor = conn.execute("SELECT next_seq FROM sampler_state").fetchone()[0]
        if [r[0] for r in rows] != list(range(cursor)):
            result.problems.append("the prompts handed out are not the dataloader's order without a gap")
        wrong = [r for r in rows if (order.at(r[0]).epoch, order.at(r[0]).prompt_id) != (r[1], r[2])]
        if wrong:
            result.problems.append(f"{len(wrong)} prompts differ from the dataloader's order, e.g. {wrong[0]}")
        per_step = dict(conn.execute("SELECT trained_step, count(*) FROM prompt_groups WHERE state = 'trained' GROUP BY 1"))
        if per_step != {s: GROUPS for s in range(1, STEPS + 1)}:
            result.problems.append(f"groups per trained step {per_step}")
    finally:
        conn.close()
    for expected, used in result.restores:
        if expected != used:
            result.problems.append(f"restore used {used}, the newest complete snapshot was {expected}")


def run_chain(run_dir: Path, plan: list[tuple[str | None, float | None]], *, seed: int = 0) -> ChainResult:
    """`plan`: (fault point spec, None) or (None, seconds after start) per kill."""
    result = ChainResult()
    for fault, delay in plan:
        run_once(run_dir, result, fault=fault, kill_after=delay)
    finish(run_dir, result)
    if result.finished:
        check_chain(run_dir, result)
    else:
        result.problems.append("the run never finished")
    return result


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    res = run_chain(a.run_dir, [(None, rng.uniform(0.0, 3.0)) for _ in range(a.kills)])
    print(json.dumps({"kills": res.kills, "runs": res.runs, "finished": res.finished, "problems": res.problems}, indent=1))
