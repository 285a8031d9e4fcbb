"""Turns kept per stop: `examples/agent_server.yaml` SIGKILLed at a random moment, resumed,
and measured by `rolloutdb trace` against its twin (the same config, never stopped).

Each run is the real CLI (`python -m rolloutdb train`), its two agent server processes
started by the controller, as README and the example's comments tell a user to run it.

1. The twin runs to the end; its first published snapshot that holds work (anchor past
   `bootstrap`, or a bootstrap snapshot with a mutation counter above 0) and its median
   step time define where the kills are drawn from.
2. Per kill: a fresh run; a step K drawn uniformly (seeded) from the steps after that
   snapshot's anchor (the last excluded) and a fraction u in [0, 1); once the run has
   logged such a snapshot and step K, wait u x the twin's median step time, SIGKILL the controller
   (its servers stop by themselves when their parent is gone), `--resume latest` to the
   end, `rolloutdb verify` (duplicated / lost) and `rolloutdb trace RUN --baseline TWIN
   --json`: what the stop kept (turns_kept, kept_tokens, redone_tokens), the thrown-away
   time and the lost progress.

    python bench/bench_turns_kept.py --kills 4 --steps 30
    python bench/bench_turns_kept.py --quick               # 6 steps, 1 kill (about a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import machine_line, say, write_json

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "agent_server.yaml"
KEPT = ("attempts_running", "decoded_tokens", "kept_tokens", "redone_tokens", "turns_kept", "thrown_away_s")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rolloutdb", *args]


def snapshots(run: Path) -> list[dict]:
    """The published snapshot events in the run's metrics log, in order."""
    path = run / "logs" / "metrics.jsonl"
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        if '"kind":"snapshot"' not in line.replace(" ", ""):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue  # the last line, half written
        if event.get("outcome") == "published":
            out.append(event)
    return out


def train_steps(run: Path) -> list[dict]:
    """The train_step events in the run's metrics log, in order."""
    out = []
    try:
        text = (run / "logs" / "metrics.jsonl").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        if '"kind":"train_step"' in line.replace(" ", ""):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # the last line, half written
    return out


def anchor_step(event: dict) -> int:
    anchor = str(event.get("anchor"))
    return int(anchor.split("_", 1)[1]) if anchor.startswith("step_") else 0


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def holds_work(event: dict) -> bool:
    return event.get("anchor") != "bootstrap" or int(event.get("mutation_counter") or 0) > 0


def train(run: Path, overrides: list[str], *, resume: bool = False) -> subprocess.Popen:
    args = ["train", "--config", str(EXAMPLE), "--run-dir", str(run), *(["--resume", "latest"] if resume else []),
            *overrides]
    log = open(run.parent / f"{run.name}{'.resume' if resume else ''}.log", "w")  # noqa: SIM115 - the child holds it
    try:
        return subprocess.Popen(cli(*args), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        log.close()


def finish(proc: subprocess.Popen, run: Path, timeout: float) -> None:
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SystemExit(f"{run} did not finish within {timeout:g} s") from None
    if code != 0:
        tail = "".join((run.parent / f"{run.name}{'.resume' if '--resume' in proc.args else ''}.log")
                       .read_text().splitlines(keepends=True)[-5:])
        raise SystemExit(f"{run}: train exited with {code}:\n{tail}")


def verify(run: Path) -> dict[str, int]:
    out = subprocess.run(cli("verify", str(run)), cwd=REPO, capture_output=True, text=True, timeout=300)
    found = dict(re.findall(r"\b(trained|discarded|duplicated|lost)=(\d+)", out.stdout))
    if "duplicated" not in found:
        raise SystemExit(f"rolloutdb verify {run} printed no counts: {out.stdout[-500:]} {out.stderr[-500:]}")
    return {k: int(v) for k, v in found.items()}


def trace(run: Path, twin: Path) -> dict:
    out = subprocess.run(cli("trace", str(run), "--baseline", str(twin), "--json", "--out", str(run / "plots")),
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"rolloutdb trace {run} failed: {out.stderr[-1000:]}")
    return json.loads(out.stdout)


def by_server(attempts: list[dict], servers: list[str]) -> dict[str, dict[str, int]]:
    """kept_by_attempt summed per agent server; a prompt meets servers[prompt_id % n]
    (`AgentPool.server_for`)."""
    out = {name: {"attempts": 0, "turns_kept": 0, "decoded_tokens": 0, "kept_tokens": 0} for name in servers}
    for a in attempts:
        x = out[servers[int(a["prompt_id"]) % len(servers)]]
        x["attempts"] += 1
        for c in ("turns_kept", "decoded_tokens", "kept_tokens"):
            x[c] += int(a[c] or 0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="algorithm.total_steps of every run")
    ap.add_argument("--kills", type=int, default=3, help="killed runs (each resumed once), all against one twin")
    ap.add_argument("--seed", type=int, default=0, help="seeds the kill moments")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds any one train command may take")
    ap.add_argument("--quick", action="store_true", help="6 steps (a checkpoint every 2), 1 kill")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    ap.add_argument("--dir", default=None, help="where the run directories go")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    overrides = [f"algorithm.total_steps={args.steps}"]
    if args.quick:
        args.steps, args.kills = 6, 1
        overrides = ["algorithm.total_steps=6", "checkpointing.interval_steps=2"]
    rng = random.Random(args.seed)
    from rolloutdb.config import load_config

    servers = [spec.name for spec in load_config(EXAMPLE).environment.servers]
    say(machine_line())
    say(f"{EXAMPLE.relative_to(REPO)} with {' '.join(overrides)}; {args.kills} kill(s), seed {args.seed}")
    tmp = Path(tempfile.mkdtemp(prefix="turns_kept_", dir=args.dir))
    results: list[dict] = []
    try:
        twin = tmp / "twin"
        t0 = time.time()
        finish(train(twin, overrides), twin, args.timeout)
        twin_wall = time.time() - t0
        first = next((e for e in snapshots(twin) if holds_work(e)), None)
        if first is None:
            raise SystemExit(f"the twin published no snapshot that holds work: {snapshots(twin)}")
        steps = train_steps(twin)
        gaps = sorted(b["t_end"] - a["t_end"] for a, b in zip(steps, steps[1:]) if a["step"] >= anchor_step(first))
        gap = gaps[len(gaps) // 2] if gaps else 0.5
        say(f"twin: {twin_wall:.1f} s, first snapshot with work at {first['t'] - t0:.1f} s (sequence "
            f"{first['sequence']}, {first['anchor']}), {len(steps)} train steps, median {gap:.2f} s apart after it")
        for k in range(args.kills):
            run = tmp / f"killed_{k}"
            # A random moment while the run trains, after its first snapshot with work: a
            # step K drawn uniformly from the steps after that snapshot's anchor (the last
            # one excluded), and a fraction of the twin's median step time after it. Drawn
            # by step, not by seconds: how fast a run trains varies by 2x between runs on
            # this loaded machine, so a drawn delay in seconds often lands after the end.
            after = rng.randint(anchor_step(first) + 1, max(anchor_step(first) + 1, args.steps - 1))
            fraction = rng.random()
            proc = train(run, overrides)
            t_start = time.time()
            while not any(holds_work(e) for e in snapshots(run)) or not any(
                    e["step"] >= after for e in train_steps(run)):
                if proc.poll() is not None:
                    raise SystemExit(f"{run} ended (exit {proc.returncode}) before step {after}")
                if time.time() - t_start > args.timeout:
                    proc.kill()
                    raise SystemExit(f"{run}: step {after} not reached within {args.timeout:g} s")
                time.sleep(0.02)
            seen = time.time()
            while proc.poll() is None and time.time() - seen < fraction * gap:
                time.sleep(0.01)
            if proc.poll() is not None:
                say(f"  kill {k}: the run finished before the kill (step {after} + {fraction:.2f} of a step); "
                    "not counted")
                continue
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            killed_at = time.time() - t_start
            published = snapshots(run)
            first_run = next(e for e in published if holds_work(e))
            delay = killed_at + t_start - first_run["t"]
            resume = train(run, overrides, resume=True)
            finish(resume, run, args.timeout)
            counts = verify(run)
            report = trace(run, twin)
            kept = report["kept_per_stop"]
            lost = report["lost_progress_per_stop"]
            if len(kept) != 1:
                raise SystemExit(f"{run}: the trace shows {len(kept)} stops, expected the one kill: {kept}")
            row = {"kill": k, "after_step": after, "step_fraction": fraction,
                   "delay_after_first_snapshot_s": delay, "killed_at_s": killed_at,
                   "snapshots_before_kill": len(published),
                   "restored_sequence": published[-1]["sequence"], "restored_anchor": published[-1]["anchor"],
                   **{c: kept[0][c] for c in KEPT},
                   "downtime_s": report["thrown_away_per_stop"][0]["downtime"],
                   **{c: lost[0][c] for c in ("groups_running", "groups_matched", "lost_s_total", "lost_s_mean",
                                              "lost_s_max")},
                   **counts, "by_server": by_server(report["kept_by_attempt"], servers),
                   "by_attempt": report["kept_by_attempt"]}
            results.append(row)
            say(f"  kill {k}: step {after} + {fraction:.2f} of a step, {killed_at:5.1f} s into the run ({delay:.1f} s "
                f"after its first snapshot with work), "
                f"restored snapshot {row['restored_sequence']} ({row['restored_anchor']}): "
                f"{row['attempts_running']} attempts running, turns_kept {row['turns_kept']}, "
                f"kept_tokens {row['kept_tokens']} of {row['decoded_tokens']} decoded, redone_tokens "
                f"{row['redone_tokens']}; lost progress {fmt(row['lost_s_total'])} s over {row['groups_matched']} "
                f"groups (max {fmt(row['lost_s_max'])} s); duplicated={row['duplicated']} lost={row['lost']}")
            say("    by server: " + "; ".join(f"{name}: {x['attempts']} attempts, {x['turns_kept']} turns kept, "
                                               f"{x['kept_tokens']} of {x['decoded_tokens']} tokens"
                                               for name, x in row["by_server"].items()))
    finally:
        if args.keep:
            say(f"run directories kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if not results:
        raise SystemExit("no kill landed before its run finished; raise --steps")
    totals = {c: sum(r[c] for r in results) for c in ("attempts_running", "decoded_tokens", "kept_tokens",
                                                      "redone_tokens", "turns_kept")}
    say(f"\n{len(results)} stop(s): turns_kept {totals['turns_kept']}, kept_tokens {totals['kept_tokens']} of "
        f"{totals['decoded_tokens']} decoded by {totals['attempts_running']} attempts running at the restored cuts, "
        f"redone_tokens {totals['redone_tokens']}; every run duplicated=0 lost=0: "
        f"{all(r['duplicated'] == 0 and r['lost'] == 0 for r in results)}")
    write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k not in ("json", "dir")},
                           "machine": machine_line(), "twin_wall_s": twin_wall, "stops": results, "totals": totals})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
