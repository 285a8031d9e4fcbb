"""Streaming rollouts against the wave pump: tokens/s and engine idle fraction, side by
side in one run on the same model, config, prompts and seeds.

  streaming  the production `RolloutPump` (controller/rollout/pump.py): each episode
             advances on its own, calls stream to the engine one by one (up to
             generation.max_inflight_calls in flight), finished calls, turns and seals
             reach a real store file through group commit, ledger dispatch
  wave       `bench/wave_pump.py`, the lockstep pump the project had before (the
             baseline, kept only here): every episode of a wave starts together, each
             turn is one blocking batch, one store transaction per wave

Both drive one `ReferenceEngine` (continuous batching, max_batch_size KV slots, one torch
thread) over a tiny Llama built here with `build_tiny_policy`, on the long-tail digit
task (`environment.task: digits_longtail`: reply lengths 1..max_digits from a power law,
set per call through the environment's reply limits), a fixed number of groups of one
train step (total_steps=1, no trainer), like bench/bench_group_commit.py. The engine is
batch-invariant and every call's seed is a function of (run seed, prompt, generation,
turn), so both pumps decode exactly the same tokens: the script checks it (policy
tokens and reward sum equal) and refuses to report otherwise. Rounds alternate the order.

Printed per mode (median over rounds, from the engine's own counters, deltas per run):
  tokens/s        policy tokens decoded / the pump's wall time
  engine idle     1 - busy_s / wall (busy_s: seconds inside decode steps)
  occupancy       decoded_rows / (steps x max_batch_size): how full the average step was
and the ratio streaming / wave per round (median and range). Goals (BENCHMARKS.md, "Streaming rollouts"):
streaming >= 1.5x the wave pump's tokens/s, streaming engine idle <= 10%.

    python bench/bench_streaming.py                 # single turn, 3 rounds
    python bench/bench_streaming.py --turns 3       # multi-turn, turn-level recovery
    python bench/bench_streaming.py --quick         # a few seconds
    python bench/bench_streaming.py --profile out   # cProfile of each pump thread -> out.<mode>.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchlib import machine_line, say, write_json
from flat_engine import FlatStepEngine
from wave_pump import WavePump

from rolloutdb.config import Config
from rolloutdb.controller.run.dispatch import LedgerDispatch
from rolloutdb.controller.rollout.pump import RolloutPump
from rolloutdb.controller.run.runtime import Progress, RolloutParts, RuntimeState
from rolloutdb.controller.run.sampler import PromptOrder, StalenessBound
from rolloutdb.controller.tasks.digits import LongTailDigitDataset
from rolloutdb.controller.tasks.registry import make_environment
from rolloutdb.gpu_capture.protocol import GenerationRequest, SamplingParams, generate_all
from rolloutdb.gpu_capture.reference_engine import ReferenceEngine
from rolloutdb.gpu_capture.tiny_policy import build_tiny_policy, load_policy
from rolloutdb.store import Store, remove_sqlite_file

MODES = ("streaming", "wave")


def make_config(args, policy_dir: Path) -> Config:
    return Config.model_validate({
        "run": {"seed": 0},
        "policy": {"model_dir": str(policy_dir)},
        "algorithm": {"total_steps": 1, "groups_per_step": args.groups, "group_size": args.group_size,
                      "max_staleness": 0, "replay_capacity": args.groups, "discard_zero_variance": False},
        "generation": {"max_tokens": args.max_digits + 1, "temperature": 1.0,
                       "max_batch_size": args.max_batch_size, "max_inflight_calls": args.max_inflight},
        "environment": {"task": "digits_longtail", "turns": args.turns, "max_digits": args.max_digits,
                        "tail_alpha": args.tail_alpha, "dataset_size": max(args.groups, 64)},
        "rollout_recovery": {"target_level": "turn" if args.turns > 1 else "group",
                             "commit_window_ms": args.window_ms},
    })


def _profiled(target, path: Path | None):
    if path is None:
        return target

    def run():
        prof = cProfile.Profile()
        prof.runcall(target)
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
        path.write_text(out.getvalue())

    return run


def run_once(mode: str, cfg: Config, engine, env, dataset, tmp: Path,
             profile: Path | None) -> dict:
    store_path = tmp / f"{mode}.sqlite"
    store = Store.create(store_path, replay_capacity=cfg.algorithm.groups_per_step)
    events: list[dict] = []
    parts = RolloutParts(
        config=cfg, store=store, order=PromptOrder(len(dataset), seed=cfg.run.seed),
        bound=StalenessBound(0, 1), engine=engine, env=env, trainer=None,
        dispatcher=LedgerDispatch(), runtime=RuntimeState(),
        read_progress=lambda: Progress(step=0, policy_version=0), log_event=events.append,
    )
    pump = RolloutPump(parts) if mode == "streaming" else WavePump(parts)
    before = (engine.busy_s, engine.steps, engine.decoded_rows)
    thread = threading.Thread(target=_profiled(pump.run, profile), name="rollout-pump")
    t0 = time.perf_counter()
    thread.start()
    thread.join()
    wall = time.perf_counter() - t0
    if parts.runtime.error is not None:
        raise parts.runtime.error
    busy, steps, rows = (now - then for now, then in zip((engine.busy_s, engine.steps, engine.decoded_rows), before))
    _n, store_s, _cpu = store.tx_time.totals.get("rollout-pump", [0, 0.0, 0.0])
    commits = store.mutation_counter
    store.close()
    remove_sqlite_file(store_path)
    kind = "rollout" if mode == "streaming" else "rollout_wave"
    records = [e for e in events if e["kind"] == kind]
    policy_tokens = sum(e["policy_tokens"] for e in records)
    reward_sum = sum((e["reward_mean"] or 0.0) * (e["attempts_finished"] if mode == "streaming" else
                                                  e["groups"] * cfg.algorithm.group_size) for e in records)
    return {
        "wall_s": wall,
        "policy_tokens": policy_tokens,
        "decoded_rows": rows,
        "reward_sum": reward_sum,
        "tokens_per_s": rows / wall,
        "engine_idle": 1.0 - busy / wall,
        "occupancy": rows / max(1, steps * cfg.generation.max_batch_size),
        "steps": steps,
        "step_ms": 1000 * busy / max(1, steps),
        "commits": commits,
        "store_share": store_s / wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=256, help="groups per run (one train step)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--max-digits", type=int, default=96)
    ap.add_argument("--tail-alpha", type=float, default=1.2)
    ap.add_argument("--max-batch-size", type=int, default=64, help="engine KV slots; the wave pump's wave size")
    ap.add_argument("--max-inflight", type=int, default=None,
                    help="generation.max_inflight_calls (default: 2 x max batch size, see the module docstring)")
    ap.add_argument("--hidden-size", type=int, default=192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--engine", choices=("reference", "flat"), default="reference",
                    help="reference: the CPU reference engine; flat: a step costs --step-ms whatever its rows "
                         "(bench/flat_engine.py, a GPU-like cost model)")
    ap.add_argument("--step-ms", type=float, default=5.0, help="step time of --engine flat")
    ap.add_argument("--window-ms", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="16 groups x 4, max_digits 24, hidden 128, batch 16, 1 round")
    ap.add_argument("--profile", default=None, help="write cProfile of each pump thread to PROFILE.<mode>.txt")
    ap.add_argument("--dir", default=None, help="where the temporary policy and stores go")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.groups, args.group_size, args.max_digits, args.hidden_size, args.rounds = 16, 4, 24, 128, 1
        args.max_batch_size = min(args.max_batch_size, 16)
    args.max_inflight = args.max_inflight or 2 * args.max_batch_size
    say(machine_line())
    engine_line = (f"flat-step engine, {args.step_ms} ms a step" if args.engine == "flat" else
                   f"reference engine (1 torch thread), tiny Llama hidden {args.hidden_size} x {args.layers} layers")
    say(f"{args.groups} groups x {args.group_size} x {args.turns} turn(s), long-tail replies 1..{args.max_digits} "
        f"(alpha {args.tail_alpha}); max_batch_size {args.max_batch_size}, max_inflight_calls {args.max_inflight}; "
        f"{engine_line}")
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp_name:
        tmp = Path(tmp_name)
        # A conversation of `turns` sub-problems of up to max_digits digits, each answered by
        # up to max_digits + 1 tokens (config.py's bound), must fit the policy's positions.
        longest = 1 + (args.max_digits + 1) + (args.turns - 1) * (2 * args.max_digits + 6)
        positions = max(256, 1 << (longest - 1).bit_length())
        policy_dir = build_tiny_policy(tmp / "policy", seed=0, hidden_size=args.hidden_size,
                                       num_layers=args.layers, num_heads=max(1, args.hidden_size // 32),
                                       intermediate_size=2 * args.hidden_size, max_position_embeddings=positions)
        cfg = make_config(args, policy_dir)
        model, tokenizer = load_policy(policy_dir)
        e = cfg.environment
        dataset = LongTailDigitDataset(size=e.dataset_size, max_digits=e.max_digits, tail_alpha=e.tail_alpha,
                                       seed=cfg.run.seed)
        env = make_environment("digits_longtail" if e.turns == 1 else "digits_longtail_multiturn", dataset,
                               tokenizer, kind=e.kind, turns=e.turns)
        if args.engine == "flat":
            digit_ids = tokenizer.convert_tokens_to_ids(list("0123456789"))
            engine_cm = FlatStepEngine(digit_ids, max_batch_size=args.max_batch_size, step_s=args.step_ms / 1000)
        else:
            engine_cm = ReferenceEngine((model, tokenizer), max_batch_size=args.max_batch_size, num_threads=1,
                                        max_model_len=positions)
        with engine_cm as engine:
            # Warm-up: the first steps of a fresh engine pay torch's one-time costs.
            generate_all(engine, [GenerationRequest(f"warm{i}", [1, 5, 6], SamplingParams(max_tokens=8, seed=i))
                                  for i in range(args.max_batch_size)])
            for r in range(args.rounds):
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    prof = Path(f"{args.profile}.{mode}.txt") if args.profile and r == 0 else None
                    results[mode].append(run_once(mode, cfg, engine, env, dataset, tmp, prof))
                    x = results[mode][-1]
                    say(f"  round {r} {mode:9s} {x['wall_s']:7.2f} s  {x['tokens_per_s']:8.0f} tok/s  "
                        f"idle {100 * x['engine_idle']:5.1f}%  occupancy {100 * x['occupancy']:5.1f}%  "
                        f"{x['steps']} steps, {x['step_ms']:.2f} ms each  {x['commits']} commits")
    work = [(x["policy_tokens"], x["decoded_rows"], x["reward_sum"]) for runs in results.values() for x in runs]
    rewards = [w[2] for w in work]
    # Reward sums are added up in a different order per mode: equal up to rounding.
    if len({w[:2] for w in work}) != 1 or max(rewards) - min(rewards) > 1e-6 * max(1.0, max(rewards)):
        raise SystemExit(f"the modes did not decode the same work: (policy tokens, rows, reward sum) {sorted(set(work))}")

    def med(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in results[mode])

    ratios = [s["tokens_per_s"] / w["tokens_per_s"] for s, w in zip(results["streaming"], results["wave"])]
    summary = {m: {k: med(m, k) for k in ("wall_s", "tokens_per_s", "engine_idle", "occupancy", "store_share")}
               for m in MODES}
    tokens = results["wave"][0]["policy_tokens"]
    say(f"same work in every run: {tokens} policy tokens decoded")
    for m in MODES:
        s = summary[m]
        say(f"{m:9s} {s['tokens_per_s']:8.0f} tokens/s  engine idle {100 * s['engine_idle']:5.1f}%  "
            f"occupancy {100 * s['occupancy']:5.1f}%  wall {s['wall_s']:.2f} s  "
            f"store share {100 * s['store_share']:.1f}%  (median of {args.rounds})")
    ratio = statistics.median(ratios)
    idle = summary["streaming"]["engine_idle"]
    say(f"ratio streaming / wave: {ratio:.2f}x tokens/s (per round {min(ratios):.2f}-{max(ratios):.2f}); "
        f"goal >= 1.5x: {'met' if ratio >= 1.5 else 'missed'}; streaming engine idle {100 * idle:.1f}%, "
        f"goal <= 10%: {'met' if idle <= 0.10 else 'missed'}")
    write_json(args.json, {"args": vars(args), "runs": results, "summary": summary, "policy_tokens": tokens,
                           "ratio_tokens_per_s": ratio, "ratios": ratios,
                           "goals": {"ratio_met": ratio >= 1.5, "idle_met": idle <= 0.10}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
