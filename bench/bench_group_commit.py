"""Group commit: how many finished calls per second the streaming rollout pump commits on
these cores, and what a commit window costs, side by side with one transaction per call.

The pump is the production `RolloutPump` over a real store file, with ledger dispatch,
the digit environment and real sealing and replay entry. Only generation is taken away:
`InstantEngine` implements the engine protocol by completing every call at once with a
few tokens (no model), so the pump's own work (episode bookkeeping, the environment step,
building the batch, the store transaction) is all there is, and calls/s is the ceiling
the pump and the store put on any engine. Measured in one process, the two modes
alternated every round with the order alternating too (AB, BA, AB, ...):

  batched    the configured window (commit_window_ms, commit_max_events), the pump as it runs
  per call   commit_max_events=1: one BEGIN IMMEDIATE transaction per finished call

Printed per mode: committed calls/s, commits, calls per commit, the p99 of a commit
transaction and of the window (first event of a batch -> its commit), and the share of the
pump thread's wall time spent inside store transactions (`Store.tx_time`); each the MEDIAN
over rounds (a best-of would report the luckiest round). The ratio batched / per call is
the median of the rounds' side-by-side ratios: the figure that survives a noisy machine.

Like the controller, which calls gc.freeze() after setup before its pumps start
(controller/job/controller.py), each run freezes the collector by default;
`--no-gc-freeze` measures without it.

Goals: batched >= 20,000 committed calls/s, window p99 <= 20 ms; printed as
met/missed against the medians.

    python bench/bench_group_commit.py            # 2,048 groups x 8 calls per run, 3 rounds
    python bench/bench_group_commit.py --quick    # a few seconds
    python bench/bench_group_commit.py --turns 3  # multi-turn, turn level: every turn saved
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from benchlib import machine_line, write_json

from rolloutdb.config import Config
from rolloutdb.controller.run.dispatch import LedgerDispatch
from rolloutdb.controller.rollout.pump import RolloutPump
from rolloutdb.controller.run.runtime import Progress, RolloutParts, RuntimeState
from rolloutdb.controller.run.sampler import PromptOrder, StalenessBound
from rolloutdb.controller.tasks.digits import DigitPromptDataset, MultiTurnDigitEnv, SingleTurnDigitEnv
from rolloutdb.gpu_capture.protocol import GenerationRequest, GenerationResult
from rolloutdb.store import Store


class DigitCodec:
    """The task's characters as token ids (what the tiny policy's tokenizer does)."""

    alphabet = "0123456789: \nokn"

    def encode(self, text: str) -> list[int]:
        return [3 + self.alphabet.index(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(self.alphabet[i - 3] for i in ids if 3 <= i < 3 + len(self.alphabet))


class InstantEngine:
    """The engine protocol with no model: each call completes at once with `tokens`
    tokens derived from its seed. A workload generator for this benchmark only."""

    def __init__(self, tokens: int = 4):
        self.tokens = tokens
        self.policy_version = 0

    def submit(self, request: GenerationRequest) -> Future:
        seed = request.params.seed or 0
        ids = [3 + (seed >> (2 * k)) % 10 for k in range(min(self.tokens, request.params.max_tokens))]
        future: Future = Future()
        future.set_result(GenerationResult(request.request_id, ids, [-1.0] * len(ids), [0] * len(ids), "length"))
        return future

    def load_weights(self, state_dict, version: int) -> None:
        self.policy_version = version

    def running_tokens(self) -> dict:
        return {}

    def abort(self, request_ids) -> None:
        pass


def _gc_clock(pauses: list[float]):
    """A gc callback that records how long each full (generation 2) collection took:
    a full collection walks every tracked object of the process, torch's and
    transformers' included, and stops every thread meanwhile."""
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    return callback


def _profiled(target, path: Path | None):
    """`target` under cProfile, its top costs written to `path` (the pump thread only)."""
    if path is None:
        return target

    def run():
        prof = cProfile.Profile()
        prof.runcall(target)
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(50)
        path.write_text(out.getvalue())

    return run


def _thread_cpu(target, out: list[float]):
    """`target`, with the CPU time its thread used appended to `out`."""
    def run():
        t0 = time.thread_time()
        try:
            target()
        finally:
            out.append(time.thread_time() - t0)

    return run


def run_once(groups: int, group_size: int, turns: int, window_ms: float, max_events: int,
             tmp_dir: str | None = None, profile: Path | None = None, gc_freeze: bool = True) -> dict:
    cfg = Config.model_validate({
        "algorithm": {"total_steps": 1, "groups_per_step": groups, "group_size": group_size, "max_staleness": 0,
                      "replay_capacity": groups, "discard_zero_variance": False},
        "generation": {"max_tokens": 4, "max_inflight_calls": 256},
        "environment": {"turns": turns},
        "rollout_recovery": {"target_level": "turn" if turns > 1 else "group", "commit_window_ms": window_ms,
                             "commit_max_events": max_events},
    })
    dataset = DigitPromptDataset(size=max(groups, 64), n_digits=3)
    env = MultiTurnDigitEnv(dataset, DigitCodec(), turns=turns) if turns > 1 else SingleTurnDigitEnv(dataset, DigitCodec())
    with tempfile.TemporaryDirectory(dir=tmp_dir) as tmp:
        store = Store.create(Path(tmp) / "store.sqlite", replay_capacity=groups)
        events: list[dict] = []
        parts = RolloutParts(
            config=cfg, store=store, order=PromptOrder(len(dataset), seed=0),
            bound=StalenessBound(0, 1), engine=InstantEngine(), env=env, trainer=None,
            dispatcher=LedgerDispatch(), runtime=RuntimeState(),
            read_progress=lambda: Progress(step=0, policy_version=0), log_event=events.append,
        )
        pump = RolloutPump(parts)
        gc_pauses: list[float] = []
        if gc_freeze:
            # Everything alive now (torch, transformers, SQLAlchemy, Alembic: ~450k objects)
            # leaves the collector's view, so a full collection no longer walks it.
            gc.collect()
            gc.freeze()
        gc.callbacks.append(_gc_clock(gc_pauses))
        cpu: list[float] = []
        thread = threading.Thread(target=_thread_cpu(_profiled(pump.run, profile), cpu), name="rollout-pump")
        t0 = time.perf_counter()
        thread.start()
        thread.join()
        wall = time.perf_counter() - t0
        gc.callbacks.pop()
        if gc_freeze:
            gc.unfreeze()
        if parts.runtime.error is not None:
            raise parts.runtime.error
        n, store_s, _cpu = store.tx_time.totals.get("rollout-pump", [0, 0.0, 0.0])
        commits = store.mutation_counter
        store.close()
    windows = [e for e in events if e["kind"] == "rollout"]
    return {
        "calls": pump.meter.calls,
        "wall_s": wall,
        "calls_per_s": pump.meter.calls / wall,
        "commits": commits,
        "commit_p99_ms": max((w["commit_p99_ms"] or 0.0) for w in windows),
        "window_p99_ms": max((w["window_p99_ms"] or 0.0) for w in windows),
        "store_share": store_s / wall,
        "gc_full_max_ms": 1000 * max(gc_pauses, default=0.0),
        # CPU time of the pump thread per committed call: what a call costs the pump
        # whatever else the machine runs (calls/s divides the wall time, which a loaded
        # machine stretches: ~2k/s at load 10+, 20k/s idle, for the same code).
        "pump_cpu_us_per_call": 1e6 * cpu[0] / max(pump.meter.calls, 1),
    }


CALLS_PER_S_GOAL = 20_000
WINDOW_P99_GOAL_MS = 20.0


def _median_run(runs: list[dict]) -> dict:
    """Each figure's median over the rounds (figure by figure)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=2048)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--window-ms", type=float, default=15.0)
    ap.add_argument("--max-events", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="256 groups, 1 round")
    ap.add_argument("--profile", default=None, help="write cProfile of the pump thread to PROFILE.<mode>.txt")
    ap.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                    help="gc.freeze() before the pump starts, as the controller does (default; see _gc_clock)")
    ap.add_argument("--dir", default=None, help="where the temporary stores go")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.rounds = 256, 1
    print(machine_line())
    print(f"{args.groups} groups x {args.group_size} generations x {args.turns} turn(s); window "
          f"{args.window_ms} ms / {args.max_events} events vs one transaction per call")
    results: dict[str, list[dict]] = {"batched": [], "per call": []}
    for r in range(args.rounds):
        order = ["batched", "per call"] if r % 2 == 0 else ["per call", "batched"]
        for mode in order:
            max_events = args.max_events if mode == "batched" else 1
            prof = Path(f"{args.profile}.{mode.replace(' ', '_')}.txt") if args.profile and r == 0 else None
            results[mode].append(run_once(args.groups, args.group_size, args.turns, args.window_ms, max_events,
                                          args.dir, prof, args.gc_freeze))
    medians = {mode: _median_run(runs) for mode, runs in results.items()}
    for mode, m in medians.items():
        print(f"{mode:9s} {m['calls_per_s']:9.0f} calls/s  {m['commits']:8.0f} commits "
              f"({m['calls'] / max(m['commits'], 1):6.1f} calls each)  commit p99 {m['commit_p99_ms']:.2f} ms  "
              f"window p99 {m['window_p99_ms']:.2f} ms  store share {100 * m['store_share']:.0f}%  "
              f"longest full gc {m['gc_full_max_ms']:.0f} ms  pump CPU {m['pump_cpu_us_per_call']:.0f} us/call")
    # Each round ran both modes back to back: the ratio within a round shares that
    # round's load, so the median of those ratios is the figure to trust.
    ratios = [b["calls_per_s"] / p["calls_per_s"] for b, p in zip(results["batched"], results["per call"])]
    ratio = statistics.median(ratios)
    b = medians["batched"]
    goals = {"calls_per_s_met": b["calls_per_s"] >= CALLS_PER_S_GOAL, "window_p99_met": b["window_p99_ms"] <= WINDOW_P99_GOAL_MS}
    print(f"ratio batched / per call: {ratio:.2f}x calls/s (median of {args.rounds} rounds: "
          f"{', '.join(f'{x:.2f}' for x in ratios)}); gc.freeze {'on' if args.gc_freeze else 'off'}")
    print(f"goals (batched, medians): >= {CALLS_PER_S_GOAL:,} calls/s {'met' if goals['calls_per_s_met'] else 'missed'}, "
          f"window p99 <= {WINDOW_P99_GOAL_MS:.0f} ms {'met' if goals['window_p99_met'] else 'missed'}; pump CPU "
          f"{b['pump_cpu_us_per_call']:.0f} us per call (the calls/s goal needs <= {1e6 / CALLS_PER_S_GOAL:.0f} us "
          f"of a free core)")
    write_json(args.json, {"args": vars(args), "runs": results, "median": medians,
                           "ratio_calls_per_s": ratio, "ratios_by_round": ratios, "goals": goals})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
