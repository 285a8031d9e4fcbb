"""How long a snapshot's environment phase holds an agent server's dispatch, at 16 and
256 running episodes, side by side in one run.

The parts are the production ones: a real agent server process (`python -m
rolloutdb.controller.agent_server.env_server`, mode export_restore, started by the
controller's `AgentPool`), the controller's real policy endpoint (aiohttp, on the
`rolloutdb-http` loop) over an engine, and the checkpoint backend the snapshot pump
calls (`HttpEnvironmentCheckpoint`: prepare, commit, drain, export, resume). What is not
here is the rest of a snapshot attempt (the store's cut between export and resume,
measured by bench_snapshot_latency.py / bench_pump_latency.py): the hold figure is the
environment's own share, `prepare -> resume` as `HttpEnvironmentCheckpoint.holds`
records it with nothing in between but the four calls.

Episodes are *running* during every phase: a refill thread keeps exactly N episodes
registered on the server (a finished one is replaced at once), and every turn's policy
call is slow (the flat-step engine, `bench/flat_engine.py`: a reply of `--reply-tokens`
tokens takes that many `--step-ms` steps, whatever the batch), so at the cut nearly every
agent has a call in flight and a transcript of some turns. `--engine reference` runs the
CPU reference engine instead (the tiny Llama decoding on this machine's cores, competing
with the server and the controller for them).

Rounds alternate the order of the sizes. Per size: median and p90 of the hold and of
each call, the export's size (the episodes as JSON, what `GET /checkpoint/export`
sends less its envelope), and the ratio 256 / 16 of the medians.

    python bench/bench_env_phase.py                 # 16 and 256, 3 rounds x 10 phases
    python bench/bench_env_phase.py --quick         # smoke: 2 and 8 episodes, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import yaml
from benchlib import machine_line, percentile, say, write_json
from flat_engine import FlatStepEngine

from rolloutdb.config import load_config
from rolloutdb.controller.job import build
from rolloutdb.controller.tasks import registry
from rolloutdb.gpu_capture.protocol import SamplingParams

CALLS = ("prepare", "commit", "drain", "export", "resume")


class CountingEngine:
    """The engine the policy endpoint serves, counting the calls in flight (how many
    agents are mid-turn when a phase begins)."""

    def __init__(self, engine):
        self.engine = engine
        self.in_flight = 0
        self.submitted = 0
        self._lock = threading.Lock()

    @property
    def policy_version(self) -> int:
        return int(getattr(self.engine, "policy_version", 0))

    def submit(self, request) -> Future:
        future = self.engine.submit(request)
        with self._lock:
            self.in_flight += 1
            self.submitted += 1
        future.add_done_callback(self._done)
        return future

    def _done(self, _f) -> None:
        with self._lock:
            self.in_flight -= 1

    def abort(self, request_ids) -> None:
        self.engine.abort(request_ids)


class Refill:
    """Keeps `target` episodes registered on the server: each finished one is replaced by
    a new attempt at once; above the target, finished ones are not replaced."""

    def __init__(self, pool, params: SamplingParams, prompts: int):
        self.pool, self.params, self.prompts = pool, params, prompts
        self.target = 0
        self.live = 0
        self.finished = 0
        self.finished_keys: set[str] = set()  # outcome arrived (the pump would commit these)
        self.failed: list[str] = []
        self._futures: dict[str, Future] = {}
        self._next = 0
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="bench-refill", daemon=True)
        self._thread.start()

    def finished_among(self, keys: set[str]) -> set[str]:
        with self._cv:
            return keys & self.finished_keys

    def set_target(self, n: int) -> None:
        with self._cv:
            self.target = n
            self._cv.notify()

    def _done(self, key: str, future: Future) -> None:
        outcome = None if future.cancelled() or future.exception() else future.result()
        with self._cv:
            self.live -= 1
            self._futures.pop(key, None)
            if outcome is not None and outcome.status == "finished":
                self.finished += 1
                self.finished_keys.add(key)
            elif not self._stop:
                self.failed.append(getattr(outcome, "error", None) or repr(future))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and self.live >= self.target:
                    self._cv.wait()
                if self._stop:
                    return
                i = self._next
                self._next += 1
                self.live += 1
            key = f"{i}.0-a1"
            future = self.pool.run(object(), key=key, prompt_id=i % self.prompts, seed=i, params=self.params)
            with self._cv:
                self._futures[key] = future
            future.add_done_callback(lambda f, key=key: self._done(key, f))

    def stop(self) -> None:
        """Stop refilling and cancel the episodes still running (their client tasks end
        before the pool closes its session; the server is stopped with the pool)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
            futures = list(self._futures.values())
        self._thread.join(10)
        for f in futures:
            f.cancel()
        deadline = time.monotonic() + 10
        while self.live > 0 and time.monotonic() < deadline:
            time.sleep(0.01)


def settle(client, refill: Refill, n: int, timeout: float = 120.0) -> None:
    """Wait until the server has acknowledged exactly n running episodes."""
    refill.set_target(n)
    deadline = time.monotonic() + timeout
    while len(client.acknowledged) != n or refill.live != n:
        if time.monotonic() > deadline:
            raise SystemExit(f"the server did not reach {n} running episodes in {timeout:g} s "
                             f"(acknowledged {len(client.acknowledged)}, live {refill.live}); see its log")
        if refill.failed:
            raise SystemExit(f"an episode failed: {refill.failed[0]}")
        time.sleep(0.01)


def one_phase(ck, client, engine: CountingEngine, refill: Refill) -> dict:
    """One environment phase, as the snapshot pump runs it (snapshot_pump.py), timed per call."""
    row: dict = {"acknowledged": len(client.acknowledged), "calls_in_flight": engine.in_flight}
    try:
        return _timed_phase(ck, row, refill)
    except Exception as e:  # noqa: BLE001 - the pump fails the attempt and resumes; so do we, and count it
        ck.resume()
        row["error"] = f"{type(e).__name__}: {e}"
        return row


def _timed_phase(ck, row: dict, refill: Refill) -> dict:
    t = time.perf_counter()
    ck.prepare()
    row["prepare"] = time.perf_counter() - t
    t = time.perf_counter()
    ck.commit()
    row["commit"] = time.perf_counter() - t
    t = time.perf_counter()
    ck.drain()
    row["drain"] = time.perf_counter() - t
    t = time.perf_counter()
    export = ck.export()
    row["export"] = time.perf_counter() - t
    t = time.perf_counter()
    ck.resume()
    row["resume"] = time.perf_counter() - t
    row["hold"] = ck.holds[-1]  # what the production backend records: prepare -> resume
    row["expected"] = len(ck.expected_keys())
    row["exported"] = len(export)
    # An acknowledged attempt missing from the export: the server lost it, unless its
    # outcome had arrived by now (it finished, and the client's DELETE reached the server
    # before its commit: see the report in BENCHMARKS.md). The pump's check
    # (`CutContents.checked_export`) refuses the snapshot for such a key if the ledger still runs it
    # at the cut, i.e. if the finish is not committed by then.
    missing = ck.expected_keys() - set(export)
    finished = refill.finished_among(missing)
    if missing - finished:
        raise SystemExit(f"the export misses {len(missing - finished)} acknowledged running episodes, "
                         f"e.g. {sorted(missing - finished)[:3]}")
    row["missing_finished"] = len(finished)
    # aiohttp's json_response writes json.dumps with its default separators.
    row["export_bytes"] = len(json.dumps(export).encode())
    row["turns_exported"] = sum(int(s["turn"]) for s in export.values())
    row["tokens_exported"] = sum(len(s.get("token_ids") or ()) for s in export.values())
    return row


def summary(all_rows: list[dict]) -> dict:
    rows = [r for r in all_rows if "error" not in r]
    out: dict = {"phases": len(rows), "failed_phases": len(all_rows) - len(rows),
                 "errors": sorted({r["error"] for r in all_rows if "error" in r})[:5],
                 "phases_with_finished_missing": sum(1 for r in rows if r["missing_finished"]),
                 "finished_missing": sum(r["missing_finished"] for r in rows)}
    if not rows:
        raise SystemExit(f"every phase failed: {out['errors']}")
    for key in (*CALLS, "hold"):
        s = sorted(r[key] for r in rows)
        out[key] = {"median_ms": statistics.median(s) * 1e3, "p90_ms": percentile(s, 90) * 1e3,
                    "max_ms": s[-1] * 1e3}
    for key in ("export_bytes", "exported", "expected", "calls_in_flight", "turns_exported", "tokens_exported"):
        out[key] = statistics.median(r[key] for r in rows)
    return out


def write_config(tmp: Path, args) -> Path:
    cfg = {
        "run": {"seed": 0},
        "algorithm": {"total_steps": 1, "groups_per_step": 1, "group_size": 2},
        "generation": {"max_tokens": args.reply_tokens, "max_batch_size": max(args.sizes) * 2},
        "environment": {"task": "digits", "kind": "copy", "n_digits": args.digits, "turns": args.turns,
                        "servers": [{"name": "agents", "mode": "export_restore", "lease_s": 60,
                                     "episode_timeout_s": 3600}]},
        "rollout_recovery": {"target_level": "turn"},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,256", help="running episodes, comma-separated (the ratio is last / first)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every size, the order alternating")
    ap.add_argument("--phases", type=int, default=10, help="phases per size per round")
    ap.add_argument("--gap-s", type=float, default=0.25, help="time between phases (episodes run on)")
    ap.add_argument("--engine", choices=("flat", "reference"), default="flat")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the flat engine's step time")
    ap.add_argument("--reply-tokens", type=int, default=32, help="tokens per reply (min = max)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--digits", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="2 and 8 episodes, 1 round x 3 phases, short replies")
    ap.add_argument("--dir", default=None, help="where the temporary policy, config and logs go")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.rounds, args.phases, args.gap_s = "2,8", 1, 3, 0.05
        args.step_ms, args.reply_tokens, args.turns = 2.0, 8, 3
    args.sizes = [int(s) for s in args.sizes.split(",")]
    say(machine_line())
    engine_line = (f"flat-step engine, {args.step_ms:g} ms a step" if args.engine == "flat"
                   else "reference engine (1 torch thread), the tiny Llama")
    say(f"episodes: task digits copy, {args.turns} turns of {args.digits} digits, replies of {args.reply_tokens} "
        f"tokens; {engine_line}; one agent server (export_restore); {args.rounds} round(s) x {args.phases} phases "
        f"per size, {args.gap_s:g} s apart")
    rows: dict[int, list[dict]] = {n: [] for n in args.sizes}
    calls_per_s: dict[int, list[float]] = {n: [] for n in args.sizes}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp_name:
        tmp = Path(tmp_name)
        config_path = write_config(tmp, args)
        config = load_config(config_path)
        policy_dir = build.build_policy(config, tmp / "policy")
        dataset, _env = registry.build_task(config, policy_dir)
        if args.engine == "flat":
            from transformers import AutoTokenizer

            digit_ids = AutoTokenizer.from_pretrained(policy_dir).convert_tokens_to_ids(list("0123456789"))
            inner = FlatStepEngine(digit_ids, max_batch_size=config.generation.max_batch_size,
                                   step_s=args.step_ms / 1000)
        else:
            inner = build.build_engine(config, policy_dir)
        engine = CountingEngine(inner)
        pool = build.build_agents(config, engine, config_path=config_path, policy_dir=policy_dir, log_dir=tmp / "logs",
                                  token_path=tmp / "agent_server.token")
        refill = None
        try:
            t0 = time.perf_counter()
            pool.start()
            say(f"server up in {time.perf_counter() - t0:.2f} s at {pool.clients[0].url}; policy at {pool.policy_url}")
            (client,) = pool.clients
            ck = pool.checkpoint()
            params = SamplingParams(max_tokens=args.reply_tokens, min_tokens=args.reply_tokens, temperature=1.0)
            refill = Refill(pool, params, len(dataset))
            for r in range(args.rounds):
                for n in (args.sizes if r % 2 == 0 else args.sizes[::-1]):
                    settle(client, refill, n)
                    time.sleep(args.gap_s * 2)  # let the new episodes reach their first calls
                    calls0, t0 = engine.submitted, time.perf_counter()
                    for _ in range(args.phases):
                        rows[n].append(one_phase(ck, client, engine, refill))
                        time.sleep(args.gap_s)
                    rate = (engine.submitted - calls0) / (time.perf_counter() - t0)
                    calls_per_s[n].append(rate)
                    x = summary(rows[n][-args.phases:])
                    say(f"  round {r} {n:4d} running: hold median {x['hold']['median_ms']:7.2f} ms  "
                        f"p90 {x['hold']['p90_ms']:7.2f} ms  export {x['export_bytes'] / 1024:8.1f} KiB "
                        f"({x['exported']:.0f} agents, {x['calls_in_flight']:.0f} calls in flight, {rate:.0f} policy calls/s, "
                        f"load {os.getloadavg()[0]:.2f})")
            finished = refill.finished
        finally:
            if refill is not None:
                refill.stop()
            pool.close()
            inner.close()
    sums = {n: summary(rows[n]) for n in args.sizes}
    for n in args.sizes:
        sums[n]["policy_calls_per_s"] = statistics.median(calls_per_s[n])
    lo, hi = args.sizes[0], args.sizes[-1]
    ratios = {key: sums[hi][key]["median_ms"] / sums[lo][key]["median_ms"] for key in (*CALLS, "hold")}
    ratios["export_bytes"] = sums[hi]["export_bytes"] / sums[lo]["export_bytes"]
    say(f"\n{finished} episodes finished during the run; medians over {args.rounds * args.phases} phases per size")
    head = f"{'':22s}" + "".join(f"{n:>10d} run  p90" for n in args.sizes) + f"   ratio {hi}/{lo}"
    say(head)
    for key in (*CALLS, "hold"):
        cells = "".join(f"{sums[n][key]['median_ms']:9.2f} ms {sums[n][key]['p90_ms']:5.1f}" for n in args.sizes)
        say(f"  {key + (' (prepare->resume)' if key == 'hold' else ''):20s}{cells}   {ratios[key]:8.2f}x")
    cells = "".join(f"{sums[n]['export_bytes'] / 1024:12.1f} KiB " for n in args.sizes)
    say(f"  {'export size':20s}{cells}   {ratios['export_bytes']:8.2f}x")
    for n in args.sizes:
        s = sums[n]
        say(f"  {n} running: {s['exported']:.0f} agents exported ({s['expected']:.0f} expected), "
            f"{s['calls_in_flight']:.0f} policy calls in flight at prepare ({s['policy_calls_per_s']:.0f}/s), {s['tokens_exported']:.0f} transcript "
            f"tokens, {s['export_bytes'] / max(1, s['exported']):.0f} bytes per agent; "
            f"{s['phases_with_finished_missing']} of {s['phases']} phases had {s['finished_missing']} acknowledged "
            f"attempts missing that had finished meanwhile; {s['failed_phases']} phases failed {s['errors']}")
    write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k not in ("json", "dir")},
                           "machine": machine_line(), "sizes": {str(n): sums[n] for n in args.sizes},
                           "ratios": ratios, "episodes_finished": finished,
                           "phases": {str(n): rows[n] for n in args.sizes}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
