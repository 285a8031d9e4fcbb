"""Ledger and no-ledger dispatch: the only place the two modes differ.

The rollout pump has one loop for both. It calls these few methods, each inside a store
transaction the pump opens:

- with ledger dispatch every prompt group is a `prompt_groups` row moving through its
  states and every attempt a `rollouts` row, so a restore knows what was in flight;
- without it, nothing is recorded in the ledger: group ids are minted here, finished
  samples and replay entries are still written (the data plane), and a restore can only
  bring back the replay buffer and the pools.

Neither mode ever waits on a snapshot: a snapshot cut is a read transaction (WAL), so
there is no exclusive data-plane lock to wait for.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sqlalchemy import Connection

from rolloutdb.store import KEEP_STEPS, FinishedGeneration, Reservation, ledger, queries


@dataclass
class GroupHandle:
    """A group the rollout pump is working on."""

    group_id: int
    reservation: Reservation
    target_step: int
    num_generations: int
    policy_version: int = -1
    # attempt id per generation index (ledger dispatch); None without the ledger
    attempts: dict[int, int | None] | None = None
    # attempt number (0, 1, ...) per generation index: what the trace matches runs by
    attempt_numbers: dict[int, int] = field(default_factory=dict)


class Dispatcher(Protocol):
    """What both pumps call, each method inside a store transaction the pump opens; the
    two implementations below are the two modes (see the module docstring)."""

    def reserve(self, tx: Connection, prompts: Sequence[Reservation], *, step: int,
                num_generations: int) -> list[GroupHandle]: ...

    def dispatch(self, tx: Connection, groups: Sequence[GroupHandle], *, policy_version: int) -> None: ...

    def redispatch(self, tx: Connection, group: GroupHandle, generations: Sequence[int], *,
                   policy_version: int) -> None: ...

    def restart(self, tx: Connection, groups: Sequence[tuple[GroupHandle, Sequence[int]]], *,
                policy_version: int) -> list[tuple]: ...

    def retry(self, tx: Connection, lost: Sequence[tuple[GroupHandle, int, str]], *, policy_version: int) -> None: ...

    def finish(self, tx: Connection, wave: Sequence[tuple[GroupHandle, dict[int, FinishedGeneration]]]) -> None: ...

    def enter_replay(self, tx: Connection, groups: Sequence[GroupHandle]) -> None: ...

    def discard(self, tx: Connection, groups: Sequence[GroupHandle], *, reason: str) -> None: ...

    def trained(self, tx: Connection, group_ids: Sequence[int], *, step: int) -> None: ...


class LedgerDispatch:
    records_groups = True

    def __init__(self, keep_steps: int = KEEP_STEPS):
        # the settled record keeps a row per step for this many steps (compaction.keep_steps_for)
        self.keep_steps = keep_steps

    def reserve(self, tx: Connection, prompts: Sequence[Reservation], *, step: int, num_generations: int) -> list[GroupHandle]:
        ids = ledger.reserve_groups(tx, prompts, num_generations=num_generations, target_step=step)
        return [GroupHandle(g, p, step, num_generations) for g, p in zip(ids, prompts)]

    def dispatch(self, tx: Connection, groups: Sequence[GroupHandle], *, policy_version: int) -> None:
        attempt_ids = iter(ledger.dispatch_groups(tx, [g.group_id for g in groups], policy_version=policy_version))
        for g in groups:
            g.policy_version = policy_version
            g.attempts = {i: next(attempt_ids) for i in range(g.num_generations)}
            g.attempt_numbers = {i: 0 for i in range(g.num_generations)}

    def redispatch(self, tx: Connection, group: GroupHandle, generations: Sequence[int], *, policy_version: int) -> None:
        """New attempts for these generations of a group, none of them running."""
        ids = ledger.start_attempts(tx, [(group.group_id, i) for i in generations], policy_version=policy_version)
        self._started(group, generations, ids, queries.attempt_numbers(tx, ids), policy_version)

    def restart(self, tx: Connection, groups: Sequence[tuple[GroupHandle, Sequence[int]]], *,
                policy_version: int) -> list[tuple]:
        """New attempts for the generations of restored groups that did not finish, (group,
        generations) each; the attempts the stopped run left running for them are
        abandoned (reason `restart`) in the same transaction, one set of statements for
        them all. Returns those as the trace's rows (group id, prompt id, generation index,
        attempt, step, policy version)."""
        ids, left = ledger.restart_attempts(tx, [(g.group_id, i) for g, generations in groups for i in generations],
                                            policy_version=policy_version)
        numbers = queries.attempt_numbers(tx, ids)
        started = iter(ids)
        for group, generations in groups:
            self._started(group, generations, [next(started) for _ in generations], numbers, policy_version)
        handles = {g.group_id: g for g, _ in groups}
        return [(g, handles[g].reservation.prompt_id, i, attempt, handles[g].target_step, version)
                for g, i, attempt, version in left]

    @staticmethod
    def _started(group: GroupHandle, generations: Sequence[int], ids: Sequence[int], numbers: dict[int, int],
                 policy_version: int) -> None:
        group.attempts = {**(group.attempts or {}), **dict(zip(generations, ids))}
        # Merged, not replaced: an agent server's lost episodes are retried one generation
        # at a time, and the other generations keep the numbers their keys were made from.
        group.attempt_numbers = {**group.attempt_numbers, **{i: numbers[a] for i, a in zip(generations, ids)}}
        group.policy_version = policy_version

    def retry(self, tx: Connection, lost: Sequence[tuple[GroupHandle, int, str]], *, policy_version: int) -> None:
        """Abandon the running attempts of these (group, generation)s with their reason
        (an agent server lost them) and start new ones."""
        for reason in sorted({r for _, _, r in lost}):
            ledger.abandon_attempts(tx, [g.attempts[i] for g, i, r in lost if r == reason], reason)
        for group, index, _ in lost:
            self.redispatch(tx, group, [index], policy_version=policy_version)

    def finish(self, tx: Connection, wave: Sequence[tuple[GroupHandle, dict[int, FinishedGeneration]]]) -> None:
        ledger.finish_attempts(tx, [(g.attempts[i], gen) for g, finished in wave for i, gen in finished.items()])

    def enter_replay(self, tx: Connection, groups: Sequence[GroupHandle]) -> None:
        ids = [g.group_id for g in groups]
        ledger.seal_groups(tx, ids)
        ledger.enter_replay(tx, ids)

    def discard(self, tx: Connection, groups: Sequence[GroupHandle], *, reason: str) -> None:
        ids = [g.group_id for g in groups]
        if reason in ledger.ALGORITHM_DISCARD_REASONS:
            # The algorithm judges a whole group: a restored group dropped for zero variance
            # before its generations ran again would pass for the algorithm's choice.
            ledger.require_every_generation_finished(tx, ids, f"be discarded for {reason}")
        ledger.discard_groups(tx, ids, reason=reason)

    def trained(self, tx: Connection, group_ids: Sequence[int], *, step: int) -> None:
        ledger.mark_trained(tx, group_ids, step=step, keep_steps=self.keep_steps)


class NoLedgerDispatch:
    records_groups = False

    def __init__(self, first_group_id: int = 1):
        self._ids = itertools.count(first_group_id)

    @classmethod
    def resuming(cls, tx: Connection) -> NoLedgerDispatch:
        """Mint ids above any group id still in the replay buffer or the samples."""
        return cls(queries.highest_group_id(tx) + 1)

    def reserve(self, tx: Connection, prompts: Sequence[Reservation], *, step: int, num_generations: int) -> list[GroupHandle]:
        return [GroupHandle(next(self._ids), p, step, num_generations) for p in prompts]

    def dispatch(self, tx: Connection, groups: Sequence[GroupHandle], *, policy_version: int) -> None:
        for g in groups:
            g.policy_version = policy_version
            g.attempts = {i: None for i in range(g.num_generations)}

    def redispatch(self, tx: Connection, group: GroupHandle, generations: Sequence[int], *, policy_version: int) -> None:
        raise RuntimeError("no-ledger dispatch has no restored in-flight groups to redispatch")

    def restart(self, tx: Connection, groups: Sequence[tuple[GroupHandle, Sequence[int]]], *,
                policy_version: int) -> list[tuple]:
        raise RuntimeError("no-ledger dispatch has no restored in-flight groups to restart")

    def retry(self, tx: Connection, lost: Sequence[tuple[GroupHandle, int, str]], *, policy_version: int) -> None:
        raise RuntimeError("no-ledger dispatch runs no agent servers (the config refuses them)")

    def finish(self, tx: Connection, wave: Sequence[tuple[GroupHandle, dict[int, FinishedGeneration]]]) -> None:
        ledger.write_samples(
            tx, [(g.group_id, i, g.reservation.prompt_id, gen) for g, finished in wave for i, gen in finished.items()]
        )

    def enter_replay(self, tx: Connection, groups: Sequence[GroupHandle]) -> None:
        tokens = queries.sample_tokens(tx, [g.group_id for g in groups])
        ledger.insert_replay(
            tx,
            [(g.group_id, g.reservation.epoch, g.reservation.prompt_id, g.target_step, tokens.get(g.group_id, 0)) for g in groups],
        )

    def discard(self, tx: Connection, groups: Sequence[GroupHandle], *, reason: str) -> None:
        ledger.release_replay(tx, [g.group_id for g in groups])

    def trained(self, tx: Connection, group_ids: Sequence[int], *, step: int) -> None:
        ledger.release_replay(tx, group_ids)
