"""Ledger transitions per second through the store API, next to raw sqlite3 in the same run.

Two ways a pump changes the ledger:

* batched: B groups per transaction, one transaction per step of the life cycle
  (reserve -> dispatch -> finish every attempt -> seal -> publish -> trained), each step
  one `Store.atomic()` around the ledger function (executemany inside);
* single: one transition per `Store.atomic()` transaction (the one-call `Store` methods),
  with the latency of every transaction recorded.

The floor is the store's own statements replayed on raw sqlite3 (bench/statement_replay.py):
a shadow store on a copy of the file runs the same calls untimed, its SQL (text and
parameters) is captured and replayed, one BEGIN IMMEDIATE ... COMMIT per store
transaction, on a third copy with the store's pragmas. Same schema, same indexes, same
rows: store / replay is what our Python costs over SQLite's own work. The older floor,
single-row UPDATEs of a ledger row touching no index (B per transaction batched, one per
transaction single), is kept as a second, labelled line: it is what SQLite's commit alone
costs. Store and floors run in alternating blocks so that load from other users of a
shared machine falls on all; the figures that matter are the ratios.

Goals: batched >= 20,000 group transitions/s; single p99 <= 1 ms (by the maximum when
fewer than 100 transactions ran); printed met/missed.

A *group transition* is one group changing state (reserve counts as entering
`reserved`); attempt starts and finishes are counted separately, so the batched figure
in group transitions is the conservative one.

    python bench/bench_transitions.py            # full size (about a minute)
    python bench/bench_transitions.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import contextlib
import random
import tempfile
import time
from pathlib import Path

import benchlib
from benchlib import fmt_latency, latency_summary, say, tail_ms

from statement_replay import ShadowStore, replay, replay_floor

from rolloutdb.store import FinishedGeneration, Reservation, Store, ledger, pools

BATCH_STEPS = ("reserve", "dispatch", "finish", "seal", "enter_replay", "trained")
GROUP_GOAL_PER_S = 20_000
SINGLE_P99_GOAL_MS = 1.0


class Sequencer:
    """Hands out fresh sampler positions (prompt id = position, one epoch)."""

    def __init__(self, start: int):
        self.next = start

    def take(self, n: int) -> list[Reservation]:
        out = [Reservation(s, 0, s) for s in range(self.next, self.next + n)]
        self.next += n
        return out


def prefill_ledger(store: Store, rows: int, seq: Sequencer) -> list[int]:
    """`rows` trained groups, so indexes and pages have a realistic size; returns their
    ids (the raw floor updates these rows)."""
    now = time.time()
    chunk = 50_000
    ids: list[int] = []
    while rows > 0:
        n = min(chunk, rows)
        res = seq.take(n)
        with store.atomic() as tx:
            tx.exec_driver_sql(
                "INSERT INTO prompt_groups (sample_seq, epoch, prompt_id, num_generations, target_step, state,"
                " policy_version, trained_step, created_at, updated_at) VALUES (?, ?, ?, 4, 0, 'trained', 0, 0, ?, ?)",
                [(r.sample_seq, r.epoch, r.prompt_id, now, now) for r in res],
            )
            pools.advance_cursor(tx, seq.next, 0)
            first = res[0].sample_seq
            ids += [
                g
                for (g,) in tx.exec_driver_sql(
                    "SELECT group_id FROM prompt_groups WHERE sample_seq >= ? ORDER BY sample_seq", (first,)
                )
            ]
        rows -= n
    return ids


def generation(tokens: int) -> FinishedGeneration:
    return FinishedGeneration(list(range(tokens)), [-0.25] * tokens, 1.0, [(0, tokens)])


# ---------------------------------------------------------------------- batched


def store_batched_round(store: Store, seq: Sequencer, batch: int, gens: int, gen: FinishedGeneration, times: dict,
                        shadow: ShadowStore | None = None, txs: list | None = None) -> None:
    """One batch of groups through the whole life cycle: six transactions. With a shadow
    store, the same round runs there (untimed) and each transaction's SQL goes to `txs`."""
    res = seq.take(batch)

    def timed(step, fn):
        if shadow is not None:
            box: list = []
            txs.append(shadow.capture(lambda s: box.append(_in_tx(s, fn))))
            return box[0]
        t0 = time.perf_counter()
        with store.atomic() as tx:
            out = fn(tx)
        times[step] += time.perf_counter() - t0
        return out

    def reserve(tx):
        ids = ledger.reserve_groups(tx, res, num_generations=gens, target_step=1)
        pools.advance_cursor(tx, seq.next, 0)
        return ids

    ids = timed("reserve", reserve)
    attempts = timed("dispatch", lambda tx: ledger.dispatch_groups(tx, ids, policy_version=0))
    timed("finish", lambda tx: ledger.finish_attempts(tx, [(a, gen) for a in attempts]))
    timed("seal", lambda tx: ledger.seal_groups(tx, ids))
    timed("enter_replay", lambda tx: ledger.enter_replay(tx, ids))
    timed("trained", lambda tx: ledger.mark_trained(tx, ids, step=1))


def _in_tx(store: Store, fn):
    with store.atomic() as tx:
        return fn(tx)


def replay_batched_round(shadow: ShadowStore, raw, seq: Sequencer, batch: int, gens: int, gen: FinishedGeneration) -> float:
    """The store's six transactions of one batched round, replayed on `raw`; seconds."""
    txs: list = []
    store_batched_round(shadow.store, seq, batch, gens, gen, {}, shadow, txs)
    return sum(replay(raw, stmts) for stmts in txs)


def raw_batched_round(raw, ids: list[int], batch: int) -> float:
    """The floor for one store round: six transactions of `batch` single-row UPDATEs."""
    t0 = time.perf_counter()
    for _ in BATCH_STEPS:
        pick = random.sample(ids, batch)
        now = time.time()
        raw.execute("BEGIN IMMEDIATE")
        raw.executemany("UPDATE prompt_groups SET updated_at = ? WHERE group_id = ?", [(now, g) for g in pick])
        raw.execute("COMMIT")
    return time.perf_counter() - t0


# ---------------------------------------------------------------------- single


def store_single_group(store: Store, seq: Sequencer, gen: FinishedGeneration, lat: dict, runq, waits: list) -> None:
    """One group, one generation, one transition per transaction (six transactions)."""

    def timed(step, fn):
        q0, t0 = runq(), time.perf_counter()
        out = fn()
        t1, q1 = time.perf_counter(), runq()
        lat[step].append(t1 - t0)
        waits.append(q1 - q0)
        return out

    (gid,) = timed("reserve", lambda: store.reserve(seq.take(1), num_generations=1, target_step=1))
    (aid,) = timed("dispatch", lambda: store.dispatch([gid], policy_version=0))
    timed("finish", lambda: store.finish(aid, gen))
    timed("seal", lambda: store.seal([gid]))
    timed("enter_replay", lambda: store.enter_replay([gid]))
    timed("trained", lambda: store.mark_trained([gid], step=1))


def replay_single_group(shadow: ShadowStore, raw, seq: Sequencer, gen: FinishedGeneration, lat: list, runq, waits: list) -> None:
    """`store_single_group`'s six transactions, their SQL replayed on `raw`, each timed."""
    ids: dict = {}
    calls = [
        lambda s: ids.update(g=s.reserve(seq.take(1), num_generations=1, target_step=1)[0]),
        lambda s: ids.update(a=s.dispatch([ids["g"]], policy_version=0)[0]),
        lambda s: s.finish(ids["a"], gen),
        lambda s: s.seal([ids["g"]]),
        lambda s: s.enter_replay([ids["g"]]),
        lambda s: s.mark_trained([ids["g"]], step=1),
    ]
    for call in calls:
        stmts = shadow.capture(call)
        q0 = runq()
        lat.append(replay(raw, stmts))
        waits.append(runq() - q0)


def raw_single(raw, ids: list[int], n: int, lat: list[float], runq, waits: list) -> None:
    for _ in range(n):
        g = random.choice(ids)
        q0, t0 = runq(), time.perf_counter()
        raw.execute("BEGIN IMMEDIATE")
        raw.execute("UPDATE prompt_groups SET updated_at = ? WHERE group_id = ?", (time.time(), g))
        raw.execute("COMMIT")
        t1, q1 = time.perf_counter(), runq()
        lat.append(t1 - t0)
        waits.append(q1 - q0)


# ---------------------------------------------------------------------- driver


def run(args) -> dict:
    random.seed(0)
    with tempfile.TemporaryDirectory(prefix="bench-transitions-", dir=args.dir) as tmp:
        store = Store.create(Path(tmp) / "live.sqlite", replay_capacity=max(64, 2 * args.batch))
        raw = benchlib.raw_connection(store.path)
        floors = contextlib.ExitStack()
        try:
            seq = Sequencer(0)
            prefilled = prefill_ledger(store, args.ledger_rows, seq)
            gen = generation(args.tokens)
            # Warm both paths (statement caches, pages) before measuring.
            store_batched_round(store, seq, min(args.batch, 50), args.generations, gen, dict.fromkeys(BATCH_STEPS, 0.0))
            raw_batched_round(raw, prefilled, min(args.batch, 50))
            shadow, replay_raw = floors.enter_context(replay_floor(store, Path(tmp), benchlib.raw_connection))
            shadow_seq = Sequencer(seq.next)  # the shadow store's sampler, in step with `seq`
            # Warm the shadow and the replay connection (its statement cache) with the same
            # warm-up round the store had, so all three files stay identical.
            replay_batched_round(shadow, replay_raw, shadow_seq, min(args.batch, 50), args.generations, gen)
            store_batched_round(store, seq, min(args.batch, 50), args.generations, gen, dict.fromkeys(BATCH_STEPS, 0.0))

            step_time = dict.fromkeys(BATCH_STEPS, 0.0)
            store_batched_s = raw_batched_s = store_wait_s = raw_wait_s = 0.0
            single_lat = {k: [] for k in BATCH_STEPS}
            raw_lat: list[float] = []
            replay_lat: list[float] = []
            replay_waits: list[float] = []
            replay_batched_s = 0.0
            runq = benchlib.RunQueueClock()
            store_waits: list[float] = []
            raw_waits: list[float] = []
            for _ in range(args.blocks):
                for _ in range(args.batched_rounds):
                    q0, t0 = runq(), time.perf_counter()
                    store_batched_round(store, seq, args.batch, args.generations, gen, step_time)
                    q1, t1 = runq(), time.perf_counter()
                    raw_batched_s += raw_batched_round(raw, prefilled, args.batch)
                    store_batched_s += t1 - t0
                    store_wait_s += q1 - q0
                    raw_wait_s += runq() - q1
                    replay_batched_s += replay_batched_round(shadow, replay_raw, shadow_seq, args.batch,
                                                             args.generations, gen)
                for _ in range(args.single_groups):
                    store_single_group(store, seq, gen, single_lat, runq, store_waits)
                for _ in range(args.single_groups):
                    replay_single_group(shadow, replay_raw, shadow_seq, gen, replay_lat, runq, replay_waits)
                raw_single(raw, prefilled, args.single_groups * len(BATCH_STEPS), raw_lat, runq, raw_waits)
            report = store.check_invariants()
            # The replay did the store's work: the same groups, in the same states.
            states = ("SELECT state, count(*), max(group_id), (SELECT count(*) FROM rollouts) FROM prompt_groups"
                      " GROUP BY state ORDER BY state")
            with store.read() as conn:
                store_states = [tuple(r) for r in conn.exec_driver_sql(states)]
            replay_same = store_states == [tuple(r) for r in replay_raw.execute(states)]
        finally:
            runq.close()
            raw.close()
            floors.close()
            store.close()

    rounds = args.blocks * args.batched_rounds
    group_transitions = rounds * args.batch * 5  # reserve, dispatch, seal, publish, trained
    attempt_transitions = rounds * args.batch * args.generations * 2  # start, finish
    store_group_rate = group_transitions / store_batched_s
    store_all_rate = (group_transitions + attempt_transitions) / store_batched_s
    raw_rate = rounds * args.batch * len(BATCH_STEPS) / raw_batched_s
    store_free_rate = group_transitions / (store_batched_s - store_wait_s)
    raw_free_rate = rounds * args.batch * len(BATCH_STEPS) / (raw_batched_s - raw_wait_s)
    # Transactions in the order they ran, each with its run-queue wait.
    order = [x for block in zip(*single_lat.values()) for x in block]
    all_single = [x for v in single_lat.values() for x in v]
    single = latency_summary(all_single)
    raw_single_summary = latency_summary(raw_lat)
    replay_summary = latency_summary(replay_lat)
    result = {
        "machine": benchlib.machine_line(),
        "args": vars(args),
        "invariants_ok": report.ok if hasattr(report, "ok") else None,
        "replay_matches_store": replay_same,
        "batched": {
            "groups_per_tx": args.batch,
            "generations": args.generations,
            "group_transitions_per_s": store_group_rate,
            "all_state_changes_per_s": store_all_rate,
            "raw_single_row_updates_per_s": raw_rate,
            "ratio_store_group_vs_raw": store_group_rate / raw_rate,
            "replay_group_transitions_per_s": group_transitions / replay_batched_s,
            "ratio_store_vs_replay_time": store_batched_s / replay_batched_s,
            "cpu_free_group_transitions_per_s": store_free_rate,
            "cpu_free_raw_single_row_updates_per_s": raw_free_rate,
            "run_queue_wait_share": store_wait_s / store_batched_s,
            "ms_per_tx_by_step": {k: v / rounds * 1e3 for k, v in step_time.items()},
            "goal_group_transitions_per_s": GROUP_GOAL_PER_S,
        },
        "single": {
            "store": single,
            "store_by_step": {k: latency_summary(v) for k, v in single_lat.items()},
            "store_tx_per_s": len(all_single) / sum(all_single),
            "store_cpu_free": latency_summary([max(0.0, t - q) for t, q in zip(order, store_waits)]),
            "raw": raw_single_summary,
            "replay": replay_summary,
            "replay_cpu_free": latency_summary([max(0.0, t - q) for t, q in zip(replay_lat, replay_waits)]),
            "ratio_p50_vs_replay": single["p50_ms"] / replay_summary["p50_ms"],
            "raw_cpu_free": latency_summary([max(0.0, t - q) for t, q in zip(raw_lat, raw_waits)]),
            "raw_tx_per_s": len(raw_lat) / sum(raw_lat),
            "ratio_p50": single["p50_ms"] / raw_single_summary["p50_ms"],
            # The p99 where both have 100+ samples, else the maximum (tail_ms says which).
            "ratio_p99": tail_ms(single)[1] / tail_ms(raw_single_summary)[1],
            "ratio_tail": tail_ms(single)[0],
            "goal_p99_ms": SINGLE_P99_GOAL_MS,
        },
    }
    return result


def print_report(r: dict) -> None:
    b, s = r["batched"], r["single"]
    say(f"machine: {r['machine']}")
    say(f"\nbatched: {b['groups_per_tx']} groups per transaction, {b['generations']} generations each")
    say(f"  store  {b['group_transitions_per_s']:>10,.0f} group transitions/s"
        f"   ({b['all_state_changes_per_s']:,.0f}/s counting attempt starts and finishes)")
    say(f"  replay {b['replay_group_transitions_per_s']:>10,.0f} group transitions/s: the store's own SQL on raw sqlite3"
        f" (floor; store time / replay time = {b['ratio_store_vs_replay_time']:.2f}x)")
    say(f"  raw    {b['raw_single_row_updates_per_s']:>10,.0f} single-row UPDATEs/s (executemany; a one-row floor touching no index)")
    say(f"  ratio  store/raw = {b['ratio_store_group_vs_raw']:.3f}   goal >= {b['goal_group_transitions_per_s']:,}/s: "
        f"{'met' if b['group_transitions_per_s'] >= b['goal_group_transitions_per_s'] else 'MISSED'}")
    say(f"  less the time spent waiting for a CPU ({b['run_queue_wait_share']:.0%} of the store's time): "
        f"store {b['cpu_free_group_transitions_per_s']:,.0f}/s, raw {b['cpu_free_raw_single_row_updates_per_s']:,.0f}/s")
    say("  ms per transaction: " + ", ".join(f"{k} {v:.2f}" for k, v in b["ms_per_tx_by_step"].items()))
    say("\nsingle: one transition per Store.atomic() transaction")
    say(f"  store  {fmt_latency(s['store'])}   {s['store_tx_per_s']:,.0f} tx/s")
    for k, v in s["store_by_step"].items():
        say(f"    {k:<9}{fmt_latency(v)}")
    say(f"  replay {fmt_latency(s['replay'])}   (the store's own SQL on raw sqlite3; store/replay p50 "
        f"{s['ratio_p50_vs_replay']:.1f}x)")
    say(f"  raw    {fmt_latency(s['raw'])}   {s['raw_tx_per_s']:,.0f} tx/s (one-row UPDATE floor)")
    say(f"  less the time spent waiting for a CPU (other users' load):")
    say(f"    store  {fmt_latency(s['store_cpu_free'])}")
    say(f"    replay {fmt_latency(s['replay_cpu_free'])}")
    say(f"    raw    {fmt_latency(s['raw_cpu_free'])}")
    tail, tail_value = tail_ms(s["store"])
    say(f"  store / one-row floor: p50 {s['ratio_p50']:.1f}x  {tail} {s['ratio_p99']:.1f}x   goal p99 <= {s['goal_p99_ms']} ms: "
        f"{'met' if tail_value <= s['goal_p99_ms'] else 'MISSED'}{'' if tail == 'p99' else ' (by the max: n < 100)'}")
    say(f"\ninvariants after the run: {'ok' if r['invariants_ok'] else r['invariants_ok']}; replay file's group states "
        f"{'match' if r['replay_matches_store'] else 'DIFFER FROM'} the store's")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=500, help="groups per transaction in the batched case")
    p.add_argument("--generations", type=int, default=4, help="generations (attempts) per group, batched case")
    p.add_argument("--tokens", type=int, default=64, help="tokens per finished generation (sample payload)")
    p.add_argument("--ledger-rows", type=int, default=100_000, help="trained groups already in the ledger")
    p.add_argument("--blocks", type=int, default=5, help="alternating store/raw blocks")
    p.add_argument("--batched-rounds", type=int, default=4, help="batched rounds per block")
    p.add_argument("--single-groups", type=int, default=400, help="groups taken through one at a time per block")
    p.add_argument("--dir", default=None, help="where the temporary store goes (default: system temp)")
    p.add_argument("--json", default=None, help="also write the figures as JSON here")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.ledger_rows, args.blocks, args.batched_rounds, args.single_groups = 50, 1000, 1, 1, 10
    r = run(args)
    print_report(r)
    benchlib.write_json(args.json, r)


if __name__ == "__main__":
    main()
