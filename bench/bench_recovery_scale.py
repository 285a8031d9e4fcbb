"""Recovery at scale: hundreds of running calls thousands of tokens long, snapshots every
second at prefix level, train steps of seconds, random SIGKILLs, through the real
controller, store, snapshot pump and trace, with a simulated engine and trainer.

    python bench/bench_recovery_scale.py                 # 256 calls of 1k-16k, 1024 of 4k-12k
    python bench/bench_recovery_scale.py --quick         # 32 calls of 1k, 2 s steps, 1 kill
    python bench/bench_ab.py --rev a2d4c0e^ --reps 1 bench_recovery_scale.py   # before / after

What runs: `rolloutdb train` child processes (bench/scale_launcher.py: the CLI's main with
bench/flat_capture_engine.py as the engine, decode steps of `--step-ms`, and the commit
lock timed) on the digit task with `trainer.factory` bench/scale_trainer.py (a step
sleeps `--train-step-s` before a commit of 5 ms, nothing trained). Rollout snapshots
every `--interval-s` (1 s) at target_level prefix; asynchronous trainer checkpoints
every step. Per case, one run is SIGKILLed `--kills` times at seeded random moments (after
its first steps, a fraction of a train step into one), each time resumed with
`--resume latest`; at the end `rolloutdb verify` (duplicated / lost) and `rolloutdb trace
RUN --json` (kept_per_stop).

Reported per case:
* per cut (the metrics log's `snapshot` lines, the snapshot manifests polled while the run
  runs, the engine's decode log, the timed commit lock): the engine hold (`prefix_hold`)
  p50 / p99; the commit lock held by the snapshot pump p50 / p99; bytes written per
  published cut (its store file, config and the segments no earlier manifest named)
  against the tokens the engine decoded since the previous published cut (8 bytes a
  token: int32 id + float32 logprob), and the prefix chunk segment alone against the new
  prefix tokens it holds (`prefix_segment_bytes` / `prefix_new_tokens`, code with
  incremental cuts only); the running calls' mean prefix at the cut's engine read;
* per train step: snapshot attempts by outcome, and the share `skipped_commit`;
* per stop: tokens lost, in two parts: decoded after the restored cut's engine read
  (the decode log: rows decoded from that read to the kill, in every process in
  between) and decoded by the cut but not kept (the trace's decoded_by_cut -
  kept_tokens); lost generation-seconds = lost tokens / the measured decode rate (tokens
  per second of the whole engine), and the nominal call-seconds (lost tokens x step_s);
  kept / decoded_by_cut and the trace's unexplained tokens (when the code reports them).

Goals (issue 28): skipped_commit <= 10% of the interval attempts; hold <= 5 ms p99 at
1024 calls, independent of prefix length; bytes per cut <= 2x the new tokens' bytes +
metadata; lost generation-seconds per crash <= the interval (at most one interval of the
engine's decoding); kept / decoded_by_cut >= 99% with 0 unexplained.

Memory: the engine keeps each running call's tokens, logprobs and versions as Python
lists (3 list slots, 24 bytes, a token; logprobs are shared floats): 1024 calls of 12k
are ~300 MB, and a run's peak RSS (VmHWM) is reported per case.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import P99_MIN_SAMPLES, machine_line, percentile, say, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "bench" / "scale_launcher.py"
TRAINER = REPO / "bench" / "scale_trainer.py"
BYTES_PER_TOKEN = 8  # int32 token id + float32 logprob (store/live/codec.py)
GROUP_SIZE = 4  # GRPO's groups finish at their longest call: small groups keep the engine full
WARM_STEPS = 2  # steps trained before the first kill: the calls running then are long

# (calls, min_tokens, max_tokens)
FULL_CASES = [(256, 1024, 16384), (1024, 4096, 12288)]
QUICK_CASES = [(32, 1024, 1024)]


def _ms(values: list[float], q: float) -> float | None:
    """The q-th percentile in ms; None for a p99 of fewer than 100 values (it would be the
    maximum: the `_max` figures carry that)."""
    if not values or (q == 99 and len(values) < P99_MIN_SAMPLES):
        return None
    return percentile(sorted(values), q) * 1e3


def shape(calls: int, lo: int, hi: int, args) -> dict:
    """Batch and staleness so that the engine, not the trainer, sets the pace and the
    rollout pump keeps `calls` running: a train step takes what finishes in one step at
    the nominal decode rate (mean length x step_s a call), and the staleness bound admits
    twice the running calls' worth of steps (a slower engine makes the trainer wait for
    groups, outside the commit lock; a tight bound would starve the engine in waves)."""
    call_s = (lo + hi) / 2 * args.step_ms / 1000
    per_step = max(GROUP_SIZE, calls * args.train_step_s / call_s)
    groups = max(1, round(per_step / GROUP_SIZE))
    staleness = math.ceil(2 * calls / (groups * GROUP_SIZE)) + 1
    return {"groups_per_step": groups, "max_staleness": staleness, "replay_capacity": groups * (staleness + 2),
            "total_steps": WARM_STEPS + 2 * args.kills + 2, "call_s": call_s}


def command(run: Path, calls: int, lo: int, hi: int, s: dict, args, resume: bool) -> list[str]:
    return [sys.executable, str(LAUNCHER), "train", "--config", str(REPO / "examples" / "quickstart.yaml"),
            "--run-dir", str(run), *(["--resume", "latest"] if resume else []),
            f"run.seed={args.seed}", f"algorithm.total_steps={s['total_steps']}",
            f"algorithm.groups_per_step={s['groups_per_step']}", f"algorithm.group_size={GROUP_SIZE}",
            f"algorithm.max_staleness={s['max_staleness']}", f"algorithm.replay_capacity={s['replay_capacity']}",
            "algorithm.discard_zero_variance=false", "environment.dataset_size=100000", "environment.n_digits=3",
            f"generation.max_tokens={hi}", f"generation.min_tokens={lo}", f"generation.max_batch_size={calls}",
            f"generation.max_inflight_calls={calls}", "checkpointing.interval_steps=1", "checkpointing.async=true",
            "rollout_recovery.target_level=prefix", "rollout_checkpointing.enabled=true",
            f"rollout_checkpointing.interval_s={args.interval_s}", "trace.enabled=true", "logging.progress=false",
            "logging.plot=false", f"trainer.factory={TRAINER}:make_trainer",
            f"trainer.options={{step_s: {args.train_step_s}, commit_s: 0.005}}"]


def events(run: Path, kind: str) -> list[dict]:
    out = []
    try:
        text = (run / "logs" / "metrics.jsonl").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        if f'"kind":"{kind}"' in line.replace(" ", ""):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # the last line, half written
    return out


def read_log(path: Path, kind: str) -> list[list[float]]:
    """The decode log's lines of one kind: [wall time, values...]; a torn last line is skipped."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if parts and parts[0] == kind:
            try:
                rows.append([float(x) for x in parts[1:]])
            except ValueError:
                continue
    return rows


class Watch:
    """Polls the run's snapshot manifests (a pruned snapshot is gone within a few
    intervals) and the child's peak memory."""

    def __init__(self, run: Path):
        self.run = run
        self.manifests: dict[int, dict] = {}
        self.peak_rss_mb = 0.0

    def poll(self, pid: int) -> None:
        for path in glob.glob(str(self.run / "checkpoints" / "*" / "rollout_snapshots" / "*" / "manifest.json")):
            seq = int(re.sub(r"\D", "", Path(path).parent.name) or -1)
            if seq in self.manifests:
                continue
            try:
                m = json.loads(Path(path).read_text())
            except (OSError, ValueError):
                continue  # being published or pruned: the next poll
            self.manifests[seq] = {"cut_time": m.get("cut_time"), "files": {f["path"]: f["size"] for f in m["files"]},
                                   "segments": {s["path"]: s["size"] for s in m.get("segments", [])}}
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            self.peak_rss_mb = max(self.peak_rss_mb, int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 1024)
        except (OSError, AttributeError):
            pass


def run_segment(cmd: list[str], run: Path, seg: int, args, watch: Watch, kill_after_step: int | None,
                rng: random.Random) -> dict:
    """One process: to the end, or SIGKILLed a random fraction of a train step after
    `kill_after_step` steps (and a published snapshot of its own) were logged."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ROLLOUTDB_FLAT_STEP_S": str(args.step_ms / 1000),
           "ROLLOUTDB_FLAT_DECODE_LOG": str(run.parent / f"{run.name}.decode{seg}.log"),
           "ROLLOUTDB_COMMIT_LOCK_LOG": str(run.parent / f"{run.name}.lock.log")}
    start_t = time.time()
    log = open(run.parent / f"{run.name}.out{seg}.log", "w")  # noqa: SIM115 - the child holds it
    try:
        proc = subprocess.Popen(cmd, cwd=run.parent, stdout=log, stderr=subprocess.STDOUT, env=env)
    finally:
        log.close()
    fraction = rng.random()
    deadline = time.monotonic() + args.timeout
    killed_at = None
    while proc.poll() is None:
        watch.poll(proc.pid)
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise SystemExit(f"{run} segment {seg} did not finish within {args.timeout:g} s")
        if kill_after_step is not None and killed_at is None:
            steps = [e for e in events(run, "train_step") if e["t_end"] >= start_t]
            published = [e for e in events(run, "snapshot") if e["t"] >= start_t and e["outcome"] == "published"
                         and e["anchor"] != "bootstrap"]
            if len(steps) >= kill_after_step and published:
                time.sleep(fraction * args.train_step_s)
                killed_at = time.time()
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                break
        time.sleep(0.2)
    watch.poll(proc.pid)
    if killed_at is None and proc.returncode != 0:
        tail = (run.parent / f"{run.name}.out{seg}.log").read_text()[-2000:]
        raise SystemExit(f"{run} segment {seg}: train exited with {proc.returncode}:\n{tail}")
    return {"start": start_t, "killed_at": killed_at, "end": time.time()}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rolloutdb", *args]


def verify(run: Path) -> dict[str, int]:
    out = subprocess.run(cli("verify", str(run)), capture_output=True, text=True, timeout=600)
    found = dict(re.findall(r"\b(trained|discarded|duplicated|lost)=(\d+)", out.stdout))
    if "duplicated" not in found:
        raise SystemExit(f"rolloutdb verify {run} printed no counts: {out.stdout[-500:]} {out.stderr[-500:]}")
    return {k: int(v) for k, v in found.items()}


def trace(run: Path) -> dict:
    out = subprocess.run(cli("trace", str(run), "--json", "--out", str(run / "plots")), capture_output=True,
                         text=True, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"rolloutdb trace {run} failed: {out.stderr[-1000:]}")
    return json.loads(out.stdout)


def cut_figures(run: Path, segs: int, watch: Watch) -> dict:
    """Per published cut: bytes written against the tokens decoded since the previous one."""
    reads = [(seg, r) for seg in range(segs) for r in read_log(run.parent / f"{run.name}.decode{seg}.log", "R")]
    reads.sort(key=lambda x: x[1][0])

    def read_before(t: float):
        best = None
        for seg, r in reads:
            if r[0] <= t:
                best = (seg, r)
            else:
                break
        return best

    rows, seen_segments, previous = [], set(), None
    for seq in sorted(watch.manifests):
        m = watch.manifests[seq]
        new_segments = {p: s for p, s in m["segments"].items() if p not in seen_segments}
        seen_segments |= set(m["segments"])
        read = read_before(m["cut_time"]) if m["cut_time"] else None
        written = sum(m["files"].values()) + sum(new_segments.values())
        if read is not None and previous is not None and previous[0] == read[0] and read[1][1] > previous[1][1]:
            new_tokens = read[1][1] - previous[1][1]
            rows.append({"sequence": seq, "bytes": written, "new_tokens": new_tokens,
                         "ratio": written / (new_tokens * BYTES_PER_TOKEN),
                         "prefix_tokens_mean": read[1][3] / read[1][2] if read[1][2] else 0.0})
        previous = read
    return {"cuts": rows}


def lost_after_cut(run: Path, segs: int, seg_times: list[dict], cut_time: float, stop_no: int) -> dict:
    """Rows the engine decoded from the restored cut's engine read to the kill that ended
    stop `stop_no` (1-based: the process killed is segment stop_no - 1)."""
    killed = stop_no - 1
    best = None
    for seg in range(killed + 1):
        for r in read_log(run.parent / f"{run.name}.decode{seg}.log", "R"):
            if r[0] <= cut_time and (best is None or r[0] >= best[1][0]):
                best = (seg, r)
    if best is None:
        return {"tokens": None}
    seg, r = best
    tokens = 0.0
    for s in range(seg, killed + 1):
        steps = read_log(run.parent / f"{run.name}.decode{s}.log", "S")
        end = steps[-1][1] if steps else 0.0
        tokens += end - (r[1] if s == seg else 0.0)
    steps = read_log(run.parent / f"{run.name}.decode{killed}.log", "S")
    # The engine's decode rate over the killed process's steady part (its second half).
    half = steps[len(steps) // 2:]
    rate = (half[-1][1] - half[0][1]) / (half[-1][0] - half[0][0]) if len(half) > 1 and half[-1][0] > half[0][0] else None
    return {"tokens": tokens, "read_to_kill_s": seg_times[killed]["killed_at"] - r[0] if seg == killed else None,
            "decode_rate": rate, "calls_at_read": r[2], "prefix_mean_at_read": r[3] / r[2] if r[2] else 0.0}


def exact_cut_time(traced: str, watch: Watch) -> float:
    """The trace gives a cut's time to the millisecond; the manifest of that snapshot
    (polled while it existed) has it exactly, which places it after its engine read."""
    t = datetime.fromisoformat(traced.replace("Z", "+00:00")).timestamp()
    near = [m["cut_time"] for m in watch.manifests.values() if m["cut_time"] and abs(m["cut_time"] - t) < 0.002]
    return min(near, key=lambda c: abs(c - t)) if near else t + 0.0005


def run_case(root: Path, calls: int, lo: int, hi: int, args, rng: random.Random) -> dict:
    s = shape(calls, lo, hi, args)
    run = root / f"run_{calls}"
    watch = Watch(run)
    seg_times = []
    t0 = time.time()
    for seg in range(args.kills + 1):
        cmd = command(run, calls, lo, hi, s, args, resume=seg > 0)
        kill_after = (WARM_STEPS if seg == 0 else 1) if seg < args.kills else None
        seg_times.append(run_segment(cmd, run, seg, args, watch, kill_after, rng))
        say(f"  {calls} calls: segment {seg} {'killed' if seg_times[-1]['killed_at'] else 'ended'} after "
            f"{seg_times[-1]['end'] - seg_times[-1]['start']:.0f} s")
    wall = time.time() - t0
    checks = verify(run)
    report = trace(run)
    attempts = events(run, "snapshot")
    steps = events(run, "train_step")
    outcomes = Counter(e["outcome"] for e in attempts)
    shares = []
    for st in steps:
        inside = [e for e in attempts if st["t_start"] <= e["t"] <= st["t_end"]]
        if inside:
            shares.append(sum(e["outcome"] == "skipped_commit" for e in inside) / len(inside))
    holds = [e["timings"]["prefix_hold"] for e in attempts if (e.get("timings") or {}).get("prefix_hold") is not None]
    seg_bytes = [(e["timings"]["prefix_segment_bytes"], e["timings"]["prefix_new_tokens"]) for e in attempts
                 if e["outcome"] == "published" and (e.get("timings") or {}).get("prefix_new_tokens")]
    lock = [line.split() for line in (run.parent / f"{run.name}.lock.log").read_text().splitlines()]
    lock_cut = [float(x[2]) for x in lock if len(x) == 3 and x[0] == "snapshot-pump"]
    lock_train = [float(x[2]) for x in lock if len(x) == 3 and x[0] != "snapshot-pump"]
    cuts = cut_figures(run, args.kills + 1, watch)["cuts"]
    stops = []
    for st in report.get("kept_per_stop", []):
        after = lost_after_cut(run, args.kills + 1, seg_times, exact_cut_time(st["cut_time"], watch),
                               int(st["stop_no"]))
        by_cut, kept = int(st["decoded_by_cut"]), int(st["kept_tokens"])
        before = max(0, by_cut - kept)
        lost = (after["tokens"] or 0.0) + before
        rate = after.get("decode_rate")
        stops.append({"stop_no": st["stop_no"], "attempts_running": st["attempts_running"],
                      "decoded_by_cut": by_cut, "kept_tokens": kept,
                      "kept_of_by_cut": kept / by_cut if by_cut else None,
                      "unexplained_tokens": st.get("unexplained_tokens"),
                      "lost_after_cut_tokens": after["tokens"], "lost_before_cut_tokens": before,
                      "lost_tokens": lost, "decode_rate_tok_s": rate,
                      "lost_generation_s": lost / rate if rate else None,
                      "lost_call_s_nominal": lost * args.step_ms / 1000,
                      "read_to_kill_s": after.get("read_to_kill_s"),
                      "prefix_mean_at_read": after.get("prefix_mean_at_read")})
    by_cut = sum(x["decoded_by_cut"] for x in stops)
    kept = sum(x["kept_tokens"] for x in stops)
    gen_s = [x["lost_generation_s"] for x in stops if x["lost_generation_s"] is not None]
    late = [c for c in cuts if c["prefix_tokens_mean"] >= statistics.median([c["prefix_tokens_mean"] for c in cuts])] \
        if cuts else []
    return {
        "calls": calls, "min_tokens": lo, "max_tokens": hi, **s, "wall_s": wall, "peak_rss_mb": watch.peak_rss_mb,
        "verify": checks, "attempts": len(attempts), "outcomes": dict(outcomes),
        "skipped_commit_share": outcomes["skipped_commit"] / max(1, len(attempts)),
        "skipped_commit_share_per_step": {"median": statistics.median(shares) if shares else None,
                                          "max": max(shares) if shares else None, "steps": len(shares)},
        "hold_ms_p50": _ms(holds, 50), "hold_ms_p99": _ms(holds, 99), "holds": len(holds),
        "hold_ms_p99_late": _ms(holds[len(holds) // 2:], 99),
        "hold_ms_max": _ms(holds, 100),
        "commit_lock_cut_ms_p50": _ms(lock_cut, 50), "commit_lock_cut_ms_p99": _ms(lock_cut, 99),
        "commit_lock_cut_ms_max": _ms(lock_cut, 100), "commit_lock_cuts": len(lock_cut),
        "commit_lock_train_ms_p50": _ms(lock_train, 50), "commit_lock_train_ms_max": _ms(lock_train, 100),
        "cuts_measured": len(cuts),
        "bytes_per_cut_mean": statistics.mean(c["bytes"] for c in cuts) if cuts else None,
        "bytes_over_new_token_bytes_median": statistics.median(c["ratio"] for c in cuts) if cuts else None,
        "bytes_over_new_token_bytes_late": statistics.median(c["ratio"] for c in late) if late else None,
        "prefix_at_cut_mean": statistics.mean(c["prefix_tokens_mean"] for c in cuts) if cuts else None,
        "chunk_bytes_over_new_token_bytes": (sum(b for b, _ in seg_bytes) / (BYTES_PER_TOKEN * sum(n for _, n in seg_bytes))
                                             if seg_bytes else None),
        "stops": stops,
        "lost_generation_s_mean": statistics.mean(gen_s) if gen_s else None,
        "lost_generation_s_max": max(gen_s) if gen_s else None,
        "lost_tokens_mean": statistics.mean(x["lost_tokens"] for x in stops) if stops else None,
        "kept_of_by_cut": kept / by_cut if by_cut else None,
        "unexplained_tokens": (sum(int(x["unexplained_tokens"]) for x in stops)
                               if stops and all(x["unexplained_tokens"] is not None for x in stops) else None),
    }


def fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def tail(r: dict, key: str, n: int) -> str:
    """'p99 X ms', or 'max X ms (n=N)' when there were too few for a p99."""
    if r[f"{key}_p99"] is not None:
        return f"p99 {r[f'{key}_p99']:.3f} ms"
    return f"max {fmt(r[f'{key}_max'], '.3f')} ms (n={n})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, nargs="*", help="only these cases (by running calls)")
    ap.add_argument("--step-ms", type=float, default=5.0, help="the flat engine's decode step")
    ap.add_argument("--train-step-s", type=float, default=10.0, help="the trainer's step, before its 5 ms commit")
    ap.add_argument("--interval-s", type=float, default=1.0, help="rollout_checkpointing.interval_s")
    ap.add_argument("--kills", type=int, default=2, help="SIGKILLs per case (each resumed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds one train process may take")
    ap.add_argument("--quick", action="store_true", help="32 calls of 1k tokens, 2 s steps, 1 kill")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    ap.add_argument("--dir", default=None, help="where the runs go (removed after unless --keep)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    cases = FULL_CASES
    if args.quick:
        cases, args.train_step_s, args.kills = QUICK_CASES, 2.0, 1
    if args.calls:
        cases = [c for c in cases if c[0] in args.calls]
    rng = random.Random(args.seed)
    uptime = os.getloadavg()
    say(machine_line())
    say(f"decode step {args.step_ms} ms, train step {args.train_step_s} s, snapshots every {args.interval_s} s, "
        f"{args.kills} kill(s) per case")
    root = Path(tempfile.mkdtemp(prefix="recovery_scale_", dir=args.dir))
    result: dict = {"args": vars(args), "machine": machine_line(), "load_at_start": uptime, "by": {}}
    try:
        for calls, lo, hi in cases:
            result["by"][str(calls)] = r = run_case(root, calls, lo, hi, args, rng)
            say(f"{calls} calls of {lo}-{hi} tokens ({r['wall_s']:.0f} s, peak RSS {r['peak_rss_mb']:.0f} MB, "
                f"verify {r['verify']}):")
            say(f"  attempts {r['outcomes']}; skipped_commit {100 * r['skipped_commit_share']:.1f}% "
                f"(per step median {fmt(r['skipped_commit_share_per_step']['median'], '.2f')})")
            say(f"  hold p50 {fmt(r['hold_ms_p50'], '.3f')} ms {tail(r, 'hold_ms', r['holds'])}; commit lock per cut "
                f"p50 {fmt(r['commit_lock_cut_ms_p50'], '.3f')} {tail(r, 'commit_lock_cut_ms', r['commit_lock_cuts'])}, per "
                f"train step p50 {fmt(r['commit_lock_train_ms_p50'], '.1f')} ms")
            say(f"  bytes per cut {fmt(r['bytes_per_cut_mean'], '.0f')} = {fmt(r['bytes_over_new_token_bytes_median'])}x "
                f"the new tokens' bytes (late {fmt(r['bytes_over_new_token_bytes_late'])}x; chunks alone "
                f"{fmt(r['chunk_bytes_over_new_token_bytes'])}x); mean prefix at a cut {fmt(r['prefix_at_cut_mean'], '.0f')}")
            for x in r["stops"]:
                say(f"  stop {x['stop_no']}: lost {fmt(x['lost_after_cut_tokens'], '.0f')} tokens after the cut + "
                    f"{x['lost_before_cut_tokens']} by it not kept = {fmt(x['lost_generation_s'])} generation-s "
                    f"({fmt(x['lost_call_s_nominal'], '.0f')} call-s); kept {x['kept_tokens']} of {x['decoded_by_cut']} "
                    f"by the cut; unexplained {x['unexplained_tokens']}")
    finally:
        if args.keep:
            write_json(str(root / "figures.json"), result)  # beside the runs (bench_ab.py keeps no figures file)
            say(f"runs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    result["load_at_end"] = os.getloadavg()
    write_json(args.json, result)


if __name__ == "__main__":
    main()
