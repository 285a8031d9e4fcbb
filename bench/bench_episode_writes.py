"""What turn-level recovery adds to a group-commit transaction, side by side in one run.

The rollout pump commits finished calls in batches, one `BEGIN IMMEDIATE` transaction
per batch. With `rollout_recovery.target_level: turn` every call that finishes a turn
also saves its episode (`pools.put_episodes`: the JSON state and the whole transcript
so far, upserted by episode key). Two transactions, alternating on one store so that
other users' load falls on both:

* plain: a batch of N finished calls (`ledger.finish_attempts`, one sample row each);
* turn: the same batch plus `put_episodes` of one episode per call, each with a
  transcript of T tokens as Python lists (replies and observations; the transcript grows
  every turn and is rewritten whole, so T is the episode's length so far, not one
  reply's);
* turn_arrays: the same with the transcript held as numpy arrays (what a pump that keeps
  its transcripts in arrays pays: no list conversion).

The figure that matters is the ratio turn/plain, and the µs each saved episode costs
against the pump's per-call budget (50 µs a call at the issue's 20k calls/s).

    python bench/bench_episode_writes.py            # full size (about a minute)
    python bench/bench_episode_writes.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import benchlib
import numpy as np
from benchlib import latency_summary, say

from rolloutdb.store import EpisodeProgress, FinishedGeneration, Reservation, Store, ledger, pools

CALL_BUDGET_US = 1e6 / 20_000  # the goal: 20k committed calls/s


def transcript(tokens: int, version: int) -> tuple[list[int], list[float], list[int]]:
    """Turns of a 24-token reply and an 8-token observation, cut to `tokens`."""
    ids, logprobs, versions = [], [], []
    while len(ids) < tokens:
        ids += [random.randint(3, 50_000) for _ in range(32)]
        logprobs += [-random.random() for _ in range(24)] + [0.0] * 8
        versions += [version] * 24 + [-1] * 8
    return ids[:tokens], logprobs[:tokens], versions[:tokens]


class Pool:
    """Running attempts: groups reserved and dispatched ahead, outside the timed part."""

    def __init__(self, store: Store):
        self.store = store
        self.next_seq = 0

    def running(self, groups: int, generations: int) -> list[tuple[int, int, int]]:
        """(attempt id, group id, generation index) of fresh running attempts."""
        res = [Reservation(s, 0, s) for s in range(self.next_seq, self.next_seq + groups)]
        self.next_seq += groups
        with self.store.atomic() as tx:
            ids = ledger.reserve_groups(tx, res, num_generations=generations, target_step=1)
            pools.advance_cursor(tx, self.next_seq, 0)
            attempts = ledger.dispatch_groups(tx, ids, policy_version=0)
            where = {a: (g, i) for a, g, i in tx.exec_driver_sql(
                f"SELECT attempt_id, group_id, generation_index FROM rollouts "
                f"WHERE attempt_id IN ({','.join(map(str, attempts))})").all()}
        return [(a, where[a][0], where[a][1]) for a in attempts]


def run(args) -> dict:
    random.seed(0)
    gens = 4
    sample = FinishedGeneration(list(range(args.reply_tokens)), [-0.25] * args.reply_tokens, 1.0,
                                [(0, args.reply_tokens)])
    out: dict = {"machine": benchlib.machine_line(), "args": vars(args), "lengths": {}}
    with tempfile.TemporaryDirectory(prefix="bench-episodes-", dir=args.dir) as tmp:
        store = Store.create(Path(tmp) / "live.sqlite", replay_capacity=64)
        try:
            pool = Pool(store)
            # The episodes being played: one per running attempt, upserted every turn.
            playing = pool.running(args.calls // gens + 1, gens)[: args.calls]
            for tokens in args.transcript_tokens:
                ids, logprobs, versions = transcript(tokens, 0)
                state = {"history": ["obs"] * 3, "budget": 5}
                progress = [EpisodeProgress(a, g, i, 0, 3, state, ids, logprobs, versions) for a, g, i in playing]
                arrays = (np.asarray(ids, np.int32), np.asarray(logprobs, np.float32), np.asarray(versions, np.int64))
                as_arrays = [EpisodeProgress(a, g, i, 0, 3, state, *arrays) for a, g, i in playing]
                saved = {"plain": [], "turn": progress, "turn_arrays": as_arrays}
                runq = benchlib.RunQueueClock()
                times: dict[str, list[float]] = {k: [] for k in saved}
                waits: dict[str, float] = dict.fromkeys(saved, 0.0)
                try:
                    for _ in range(args.warmup + args.reps):
                        for kind in saved:
                            ending = pool.running(args.calls // gens, gens)
                            batch = [(a, sample) for a, _, _ in ending]
                            q0, t0 = runq(), time.perf_counter()
                            with store.atomic() as tx:
                                pools.put_episodes(tx, saved[kind])
                                ledger.finish_attempts(tx, batch)
                            t1, q1 = time.perf_counter(), runq()
                            times[kind].append(t1 - t0)
                            waits[kind] += q1 - q0
                finally:
                    runq.close()
                plain, turn, turn_arrays = (times[k][args.warmup:] for k in saved)
                n_calls = len(batch)

                def added_us(with_episodes: list[float]) -> float:
                    return (sum(with_episodes) - sum(plain)) / len(with_episodes) / len(progress) * 1e6
                out["lengths"][tokens] = {
                    "calls_per_tx": n_calls,
                    "episodes_per_tx": len(progress),
                    "plain": latency_summary(plain),
                    "turn": latency_summary(turn),
                    "turn_arrays": latency_summary(turn_arrays),
                    "ratio_mean": sum(turn) / sum(plain),
                    "ratio_arrays_mean": sum(turn_arrays) / sum(plain),
                    "ratio_p50": latency_summary(turn)["p50_ms"] / latency_summary(plain)["p50_ms"],
                    "plain_calls_per_s": n_calls * len(plain) / sum(plain),
                    "turn_calls_per_s": n_calls * len(turn) / sum(turn),
                    "turn_arrays_calls_per_s": n_calls * len(turn_arrays) / sum(turn_arrays),
                    "added_us_per_episode": added_us(turn),
                    "added_us_per_episode_arrays": added_us(turn_arrays),
                    "added_share_of_call_budget": added_us(turn) / CALL_BUDGET_US,
                    "run_queue_wait_share": sum(waits.values()) / sum(sum(v) for v in times.values()),
                }
            out["invariants_ok"] = store.check_invariants().ok
        finally:
            store.close()
    return out


def print_report(r: dict) -> None:
    say(f"machine: {r['machine']}")
    a = r["args"]
    say(f"\none group-commit transaction of {a['calls']} finished calls ({a['reply_tokens']}-token samples), "
        f"without and with put_episodes of {a['calls']} episodes; {a['reps']} transactions each, alternating")
    say("turn: transcripts as lists; arrays: as numpy arrays. ratio: mean transaction time over plain's; "
        "µs/episode: what each saved episode adds, against a 50 µs per-call budget (20k calls/s)")
    say(f"{'transcript':>10} {'plain p50':>10} {'turn p50':>10} {'ratio':>6} {'arrays':>6} {'plain calls/s':>14} "
        f"{'turn calls/s':>13} {'µs/episode':>11} {'arrays':>7} {'of 50 µs':>9}")
    for tokens, f in r["lengths"].items():
        say(f"{tokens:>10} {f['plain']['p50_ms']:>8.2f}ms {f['turn']['p50_ms']:>8.2f}ms {f['ratio_mean']:>6.2f} "
            f"{f['ratio_arrays_mean']:>6.2f} {f['plain_calls_per_s']:>14,.0f} {f['turn_calls_per_s']:>13,.0f} "
            f"{f['added_us_per_episode']:>11.1f} {f['added_us_per_episode_arrays']:>7.1f} "
            f"{f['added_share_of_call_budget']:>9.0%}")
    say(f"run-queue wait (other users' load): {max(f['run_queue_wait_share'] for f in r['lengths'].values()):.0%} "
        "of the timed transactions at most")
    say(f"\ninvariants after the run: {'ok' if r['invariants_ok'] else 'BROKEN'}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200, help="finished calls (and saved episodes) per transaction")
    p.add_argument("--reply-tokens", type=int, default=64, help="tokens per finished call's sample")
    p.add_argument("--transcript-tokens", type=int, nargs="+", default=[64, 512, 2048],
                   help="tokens in each saved episode's transcript so far")
    p.add_argument("--reps", type=int, default=60, help="timed transactions of each kind per transcript length")
    p.add_argument("--warmup", type=int, default=5, help="untimed transactions of each kind first")
    p.add_argument("--dir", default=None, help="where the temporary store goes (default: system temp)")
    p.add_argument("--json", default=None, help="also write the figures as JSON here")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.reps, args.warmup, args.transcript_tokens = 20, 3, 1, [64]
    r = run(args)
    print_report(r)
    benchlib.write_json(args.json, r)


if __name__ == "__main__":
    main()
