"""Fill a live store with a run's worth of ledger rows and sample payload, through the
store API (`ledger`, `pools` inside `Store.atomic()`), for the snapshot and restore
benchmarks. Set-up, not what is measured: batched transactions on a store opened with
``synchronous=OFF``.

The groups, in sampler order (lowest `sample_seq` first):

* `trained`: every generation finished (a tiny sample each), sealed, published and
  trained, `groups_per_step` per step from step 1 on; their rollout rows stay in the
  ledger (as in a long run) and their samples are gone;
* `published` and `sealed`: every generation finished with a full-size sample, in the
  replay buffer or waiting to enter it;
* `in_flight`: dispatched, `finished_per_group` generations finished with full-size
  samples while the payload lasts, the other generations running;
* `reserved`: reserved, no attempt started; then `spare` prompts in the spare pool.

Full-size samples carry `sample_tokens` token ids and as many logprobs (8 bytes a token)
until `payload_bytes` is reached; the payload goes to published and sealed groups
first, then to the in-flight groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rolloutdb.store import FinishedGeneration, Reservation, Store, ledger, pools

BATCH_GROUPS = 1000  # ledger rows per transaction
BATCH_PAYLOAD_BYTES = 16 * 2**20  # sample payload per transaction
DISTINCT_SAMPLES = 16  # a few different random samples, reused (SQLite stores every copy)


@dataclass
class Layout:
    in_flight: int
    num_generations: int
    payload_bytes: int
    sample_tokens: int = 16384
    finished_per_group: int = 4
    trained: int = 0
    published: int = 0
    sealed: int = 0
    reserved: int = 0
    spare: int = 0
    groups_per_step: int = 8
    in_flight_step: int | None = None  # target step of the groups not yet trained

    @property
    def total_groups(self) -> int:
        return self.trained + self.published + self.sealed + self.in_flight + self.reserved

    @property
    def trained_steps(self) -> int:
        return -(-self.trained // self.groups_per_step) if self.trained else 0


def _samples(tokens: int) -> list[FinishedGeneration]:
    rng = np.random.default_rng(0)
    return [
        FinishedGeneration(
            rng.integers(0, 50_000, tokens, dtype=np.int32),
            -rng.random(tokens, dtype=np.float32),
            float(k % 2),
            [(0, tokens)],
        )
        for k in range(DISTINCT_SAMPLES)
    ]


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def populate(store: Store, layout: Layout, order: Callable[[int], Reservation]) -> dict:
    """Write `layout` into `store` (created empty, cursor at 0). `order(seq)` gives the
    sampler's reservation at position `seq`. Returns counts of what was written."""
    n = layout.num_generations
    full = _samples(layout.sample_tokens)
    tiny = FinishedGeneration([1, 2, 3, 4], [-0.1] * 4, 1.0, [(0, 4)])
    per_sample = layout.sample_tokens * 8
    payload_left = layout.payload_bytes // per_sample  # full-size samples still to write
    seq = 0
    written = {"samples": 0, "payload_bytes": 0}

    def take(count: int) -> list[Reservation]:
        nonlocal seq
        out = [order(s) for s in range(seq, seq + count)]
        seq += count
        return out

    def reserve_dispatch(tx, prompts: list[Reservation], step: int | None) -> list[int]:
        ids = ledger.reserve_groups(tx, prompts, num_generations=n, target_step=step)
        ledger.dispatch_groups(tx, ids, policy_version=0)
        return ids

    def attempts_of(tx, ids: list[int]) -> dict[int, list[int]]:
        rows = tx.exec_driver_sql(
            f"SELECT group_id, attempt_id FROM rollouts WHERE state = 'running' AND group_id IN "
            f"({','.join(map(str, ids))}) ORDER BY group_id, generation_index"
        ).all()
        out: dict[int, list[int]] = {}
        for g, a in rows:
            out.setdefault(g, []).append(a)
        return out

    # trained: whole life cycle, tiny samples, then dropped by mark_trained
    capacity = store.run_meta()["replay_capacity"]
    step_batch = max(1, min(BATCH_GROUPS, capacity) // layout.groups_per_step)
    for first_step in range(1, layout.trained_steps + 1, step_batch):
        with store.atomic() as tx:
            by_step = {}
            for step in range(first_step, min(first_step + step_batch, layout.trained_steps + 1)):
                count = min(layout.groups_per_step, layout.trained - (step - 1) * layout.groups_per_step)
                by_step[step] = ledger.reserve_groups(tx, take(count), num_generations=n, target_step=step)
            ids = [g for step_ids in by_step.values() for g in step_ids]
            # The cursor covers what is reserved in the same commit, as the rollout pump's
            # does (invariant 4 at every commit; the settle's fold reads it: v1_12_a).
            pools.cover_cursor(tx, seq, order(seq - 1).epoch)
            ledger.dispatch_groups(tx, ids, policy_version=0)
            att = attempts_of(tx, ids)
            ledger.finish_attempts(tx, [(a, tiny) for g in ids for a in att[g]])
            # One seal and one replay entry per batch, not per step: each replay entry reads
            # every permit already taken (`ledger.enter_replay`), so per-step calls would make
            # the set-up quadratic.
            ledger.seal_groups(tx, ids)
            ledger.enter_replay(tx, ids)
            for step, step_ids in by_step.items():
                ledger.mark_trained(tx, step_ids, step=step)

    # published / sealed / in flight: full-size payload
    per_tx = max(1, BATCH_PAYLOAD_BYTES // per_sample)
    k = 0

    def finish_full(ids_and_gens: list[tuple[int, list[int]]], att: dict[int, list[int]]) -> None:
        nonlocal k, payload_left
        todo = []
        for g, gens in ids_and_gens:
            for i in gens:
                if payload_left <= 0:
                    break
                todo.append((att[g][i], full[k % DISTINCT_SAMPLES]))
                k += 1
                payload_left -= 1
        for part in _chunks(todo, per_tx):
            with store.atomic() as tx:
                ledger.finish_attempts(tx, part)
        written["samples"] += len(todo)
        written["payload_bytes"] += len(todo) * per_sample

    for state, count in (("published", layout.published), ("sealed", layout.sealed)):
        for part in _chunks(list(range(count)), BATCH_GROUPS):
            with store.atomic() as tx:
                ids = reserve_dispatch(tx, take(len(part)), layout.in_flight_step)
                att = attempts_of(tx, ids)
            finish_full([(g, list(range(n))) for g in ids], att)
            with store.atomic() as tx:
                left = attempts_of(tx, ids)  # generations the payload did not cover
                ledger.finish_attempts(tx, [(a, tiny) for g in ids for a in left.get(g, [])])
                ledger.seal_groups(tx, ids)
                if state == "published":
                    ledger.enter_replay(tx, ids)

    for part in _chunks(list(range(layout.in_flight)), BATCH_GROUPS):
        with store.atomic() as tx:
            ids = reserve_dispatch(tx, take(len(part)), layout.in_flight_step)
            att = attempts_of(tx, ids) if payload_left > 0 else {}
        if payload_left > 0:
            finish_full([(g, list(range(min(layout.finished_per_group, n - 1)))) for g in ids], att)

    with store.atomic() as tx:
        if layout.reserved:
            ledger.reserve_groups(tx, take(layout.reserved), num_generations=n, target_step=layout.in_flight_step)
        if layout.spare:
            pools.push_spare(tx, take(layout.spare))
        pools.advance_cursor(tx, seq, order(seq - 1).epoch if seq else 0)
    if payload_left > 0:
        raise ValueError(
            f"the layout holds too few finished generations for the payload ({payload_left} samples of "
            f"{per_sample} bytes left over): raise the in-flight groups or finished_per_group"
        )
    return {"groups": layout.total_groups, "cursor": seq, **written}
