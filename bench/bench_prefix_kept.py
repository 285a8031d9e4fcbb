"""What a stop keeps at turn level vs prefix level, side by side in one run: the
multi-turn long-tail example SIGKILLed at seeded random moments, resumed, and measured by
`rolloutdb trace` against its never-stopped twin (same config and level).

Per level: a twin to the end, then `--kills` runs, each killed once at a step drawn after
its first snapshot past bootstrap plus a fraction of the twin's median step, resumed with
`--resume latest`, checked with `rolloutdb verify` and reported by `rolloutdb trace RUN
--baseline TWIN --json` (kept_per_stop, kept_by_attempt). Printed per level: decoded,
kept and redone tokens, kept / decoded, the thrown-away time per abandoned attempt, and
the tokens decoded by the cut and not kept: per traced reason, and without a reason (prefix
level; it must be 0).

    python bench/bench_prefix_kept.py --kills 4 --steps 20
    python bench/bench_prefix_kept.py --quick          # 8 steps, 1 kill per level
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from bench_turns_kept import REPO, cli, finish, snapshots, train_steps, trace, verify
from benchlib import machine_line, say, write_json

import subprocess
import os

EXAMPLE = REPO / "examples" / "multiturn.yaml"


def train(run: Path, level: str, steps: int, *, resume: bool = False) -> subprocess.Popen:
    args = ["train", "--config", str(EXAMPLE), "--run-dir", str(run), *(["--resume", "latest"] if resume else []),
            f"algorithm.total_steps={steps}", f"rollout_recovery.target_level={level}",
            "checkpointing.interval_steps=1", "rollout_checkpointing.interval_s=0.5", "trace.enabled=true",
            "logging.progress=false", "logging.plot=false"]
    log = open(run.parent / f"{run.name}{'.resume' if resume else ''}.log", "w")  # noqa: SIM115 - the child holds it
    try:
        return subprocess.Popen(cli(*args), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        log.close()


def kill_once(run: Path, level: str, steps: int, rng: random.Random, step_s: float, timeout: float) -> bool:
    proc = train(run, level, steps)
    k = rng.randrange(2, max(3, steps - 1))
    u = rng.random()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if len(train_steps(run)) >= k and any(s.get("anchor") != "bootstrap" for s in snapshots(run)):
            time.sleep(u * step_s)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.02)
    finish(proc, run, timeout)
    return False


def level_figures(root: Path, level: str, args, rng: random.Random) -> dict:
    twin = root / f"{level}_twin"
    t0 = time.monotonic()
    finish(train(twin, level, args.steps), twin, args.timeout)
    step_s = (time.monotonic() - t0) / max(1, args.steps)
    stops, attempts, checks, fell = [], [], [], {}
    for i in range(args.kills):
        run = root / f"{level}_run{i}"
        if not kill_once(run, level, args.steps, rng, step_s, args.timeout):
            say(f"{level} run {i}: ended before the kill; not counted")
            continue
        finish(train(run, level, args.steps, resume=True), run, args.timeout)
        checks.append(verify(run))
        report = trace(run, twin)
        stops += report["kept_per_stop"]
        attempts += report["kept_by_attempt"]
        for f in report["fallbacks_per_stop"]:
            fell[f["reason"]] = fell.get(f["reason"], 0) + int(f["tokens"])
        if not args.keep:
            shutil.rmtree(run, ignore_errors=True)
    decoded = sum(int(s["decoded_tokens"]) for s in stops)
    by_cut = sum(int(s["decoded_by_cut"]) for s in stops)
    kept = sum(int(s["kept_tokens"]) for s in stops)
    thrown = [float(a["thrown_away_s"]) for a in attempts]
    return {"stops": len(stops), "attempts": len(attempts), "decoded_tokens": decoded, "kept_tokens": kept,
            "redone_tokens": sum(int(s["redone_tokens"]) for s in stops),
            "turns_kept": sum(int(s["turns_kept"]) for s in stops),
            "decoded_by_cut": by_cut, "kept_share": kept / decoded if decoded else None,
            # Tokens decoded by the cut and not kept: with a traced reason (per reason),
            # and without one (None at turn level, where no cut reads the running calls).
            "fallback_tokens": fell,
            "unexplained_tokens": sum(int(s["unexplained_tokens"]) for s in stops
                                      if s["unexplained_tokens"] is not None) if level == "prefix" else None,
            "kept_of_by_cut": kept / by_cut if by_cut else None,
            "thrown_away_s_mean": statistics.mean(thrown) if thrown else None,
            "thrown_away_s_max": max(thrown) if thrown else None,
            "verify": checks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--quick", action="store_true", help="8 steps, 1 kill per level")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--levels", default="turn,prefix", help="comma-separated: turn, prefix")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.kills = 8, 1
    say(machine_line())
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="prefix_kept_", dir=args.dir))
    try:
        figures = {level: level_figures(root, level, args, random.Random(args.seed)) for level in args.levels.split(",")}
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            say(f"runs kept in {root}")
    for level, f in figures.items():
        share = "-" if f["kept_share"] is None else f"{100 * f['kept_share']:.1f}%"
        of_cut = "-" if f["kept_of_by_cut"] is None else f"{100 * f['kept_of_by_cut']:.1f}%"
        thrown = "-" if f["thrown_away_s_mean"] is None else f"{f['thrown_away_s_mean']:.3f} s mean, {f['thrown_away_s_max']:.3f} s max"
        say(f"{level:6s}: {f['stops']} stops, {f['attempts']} attempts running; decoded {f['decoded_tokens']}, kept "
            f"{f['kept_tokens']} ({share}; {of_cut} of the {f['decoded_by_cut']} decoded by the cut), redone {f['redone_tokens']}, turns kept {f['turns_kept']}; thrown away "
            f"{thrown} per attempt; not kept with a reason {f['fallback_tokens'] or 0}, without one "
            f"{'-' if f['unexplained_tokens'] is None else f['unexplained_tokens']}; verify {f['verify']}")
    if args.json:
        write_json(args.json, {"args": vars(args), "levels": figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
