"""What a graceful stop keeps against a kill at the same moment: the multi-turn long-tail
example (`examples/multiturn.yaml`) at prefix level, stopped with SIGTERM in one run and
SIGKILL in its copy, each resumed with `--resume auto` and measured by
`rolloutdb trace RUN --baseline TWIN --json` against a never-stopped twin.

Per stop: a step K and a fraction u are drawn (seeded); both runs are signalled once they
logged step K, u x the twin's median step time later. SIGTERM ends in the final snapshot
(`run.shutdown_grace_s`); SIGKILL keeps what the last interval or step-boundary snapshot
held. Printed side by side: decoded, kept and redone tokens of the attempts running at the
restored cut, kept / decoded, and the lost progress (groups running at the stop, not
sealed by the restored cut: the work handed out after it, which a kill throws away whole;
seconds lost against the twin), verify.

    python bench/bench_graceful_stop.py --stops 3 --steps 30
    python bench/bench_graceful_stop.py --quick            # 16 steps, 1 stop (a few minutes)
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from bench_turns_kept import REPO, cli, finish, trace, train_steps, verify
from benchlib import machine_line, say, write_json

EXAMPLE = REPO / "examples" / "multiturn.yaml"
SIGNALS = {"sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}


def train(run: Path, steps: int, level: str, *, resume: bool = False) -> subprocess.Popen:
    args = ["train", "--config", str(EXAMPLE), "--run-dir", str(run), *(["--resume", "auto"] if resume else []),
            f"algorithm.total_steps={steps}", f"rollout_recovery.target_level={level}", "trace.enabled=true",
            "logging.progress=false", "logging.plot=false"]
    log = open(run.parent / f"{run.name}{'.resume' if resume else ''}.log", "w")  # noqa: SIM115 - the child holds it
    try:
        return subprocess.Popen(cli(*args), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        log.close()


def stop_once(run: Path, how: str, k: int, delay_s: float, args) -> bool:
    """Signal the run `delay_s` after it logged step `k`; False if it ended first."""
    proc = train(run, args.steps, args.level)
    deadline = time.monotonic() + args.timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if len(train_steps(run)) >= k:
            time.sleep(delay_s)
            proc.send_signal(SIGNALS[how])
            code = proc.wait(args.timeout)
            return code in (-signal.SIGKILL, 128 + signal.SIGTERM)
        time.sleep(0.02)
    finish(proc, run, args.timeout)
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--stops", type=int, default=3)
    ap.add_argument("--level", default="prefix", choices=["turn", "prefix"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--quick", action="store_true", help="16 steps, 1 stop")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.stops = 16, 1
    say(machine_line())
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="graceful_stop_"))
    figures: dict[str, dict] = {how: {"stops": 0, "decoded_tokens": 0, "kept_tokens": 0, "redone_tokens": 0,
                                      "groups_lost": 0, "lost_s": 0.0, "verify": []} for how in SIGNALS}
    try:
        twin = root / "twin"
        t0 = time.monotonic()
        finish(train(twin, args.steps, args.level), twin, args.timeout)
        step_s = (time.monotonic() - t0) / args.steps
        for i in range(args.stops):
            k, u = rng.randrange(2, max(3, args.steps // 2)), rng.random()  # well before the end
            for how, f in figures.items():
                run = root / f"{how}{i}"
                if not stop_once(run, how, k, u * step_s, args):
                    say(f"{how} run {i}: ended before the signal; not counted")
                    continue
                finish(train(run, args.steps, args.level, resume=True), run, args.timeout)
                f["verify"].append(verify(run))
                report = trace(run, twin)
                for stop in report["kept_per_stop"]:
                    f["stops"] += 1
                    for key in ("decoded_tokens", "kept_tokens", "redone_tokens"):
                        f[key] += int(stop[key])
                for stop in report["lost_progress_per_stop"]:
                    f["groups_lost"] += int(stop["groups_running"])
                    f["lost_s"] += float(stop["lost_s_total"] or 0.0)
    finally:
        if args.keep:
            say(f"runs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    for how, f in figures.items():
        share = f"{100 * f['kept_tokens'] / f['decoded_tokens']:.1f}%" if f["decoded_tokens"] else "-"
        say(f"{how}: {f['stops']} stops at {args.level} level; decoded {f['decoded_tokens']}, kept {f['kept_tokens']} "
            f"({share}), redone {f['redone_tokens']}; lost progress: {f['groups_lost']} groups, {f['lost_s']:.1f} s; "
            f"verify {f['verify']}")
    write_json(args.json, {"args": vars(args), "figures": figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
