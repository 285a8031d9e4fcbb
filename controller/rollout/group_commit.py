"""Group commit for the streaming rollout pump: what finished since the last commit waits
here, and goes to the store in one `BEGIN IMMEDIATE` transaction (one cut) when the batch
is due: `window_s` after its first event, or once it holds `max_events` events, whichever
comes first.

Why batches: calls finish one by one, thousands a second on a real engine, and one
transaction per call would make the store's write rate follow the call rate (every
transaction bumps the mutation counter, takes the write lock and writes WAL frames). A
batch makes the rate one per window whatever the call rate, and a snapshot, being a
read transaction, sees a batch entirely or not at all. What a batch costs durability is
bounded by the window: a stop loses at most the calls finished in its last window, which
turn-level recovery redoes from their episode's last committed turn.

`CommitBatch` holds the pending events and knows when they are due; `RolloutMeter` sums
what the batches did into one `rollout` metrics record per second (docs/config.md,
README: metrics.jsonl).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rolloutdb.controller.rollout.live_episode import LiveEpisode
from rolloutdb.controller.run.dispatch import GroupHandle
from rolloutdb.store import FinishedGeneration

# An attempt in a batch: (group id, generation index)
AttemptKey = tuple[int, int]


@dataclass
class Pending:
    """What one commit writes. `finished`: (live episode, FinishedGeneration) pairs;
    `progress`: per attempt, its episode, whose progress the commit saves (turn-level
    recovery); `completed`: groups whose every generation finished."""

    finished: list[tuple[LiveEpisode, FinishedGeneration]] = field(default_factory=list)
    progress: dict[AttemptKey, LiveEpisode] = field(default_factory=dict)
    completed: list[GroupHandle] = field(default_factory=list)
    # (live episode, abandon reason): attempts an agent server lost, to abandon and start again
    retries: list[tuple[LiveEpisode, str]] = field(default_factory=list)
    events: int = 0
    first_event_at: float | None = None


class CommitBatch:
    def __init__(self, window_s: float, max_events: int, clock: Callable[[], float] = time.perf_counter):
        if window_s <= 0 or max_events < 1:
            raise ValueError("a commit batch needs window_s > 0 and max_events >= 1")
        self.window_s = window_s
        self.max_events = max_events
        self.clock = clock
        self._pending = Pending()

    @property
    def empty(self) -> bool:
        return self._pending.events == 0

    def _event(self) -> None:
        if self._pending.first_event_at is None:
            self._pending.first_event_at = self.clock()
        self._pending.events += 1

    def add_finished(self, live: LiveEpisode, generation: FinishedGeneration) -> None:
        self._pending.finished.append((live, generation))
        self._event()

    def add_progress(self, attempt_key: AttemptKey, progress: LiveEpisode) -> None:
        """A finished turn's state; a later turn of the same attempt in the same batch
        replaces it (only the latest is worth writing)."""
        self._pending.progress[attempt_key] = progress
        self._event()

    def drop_progress(self, attempt_key: AttemptKey) -> None:
        """The attempt finished in this batch: its sample replaces its saved progress."""
        self._pending.progress.pop(attempt_key, None)

    def add_retry(self, live: LiveEpisode, reason: str) -> None:
        self._pending.retries.append((live, reason))
        self._event()

    def add_completed(self, group: GroupHandle) -> None:
        self._pending.completed.append(group)
        self._event()

    def due(self) -> bool:
        p = self._pending
        if p.first_event_at is None:
            return False
        return p.events >= self.max_events or self.clock() - p.first_event_at >= self.window_s

    def time_left(self) -> float | None:
        """Seconds until the batch is due; None when it is empty."""
        p = self._pending
        if p.first_event_at is None:
            return None
        if p.events >= self.max_events:
            return 0.0
        return max(0.0, self.window_s - (self.clock() - p.first_event_at))

    def take(self) -> Pending:
        taken, self._pending = self._pending, Pending()
        return taken


@dataclass
class _Window:
    started: float = 0.0
    batches: int = 0
    calls: int = 0
    attempts: int = 0
    turns: int = 0
    sealed: int = 0
    discarded: int = 0
    dispatched: int = 0
    tokens: int = 0
    policy_tokens: int = 0
    rewards: list[float] = field(default_factory=list)
    steps: set[int] = field(default_factory=set)
    commit_s: list[float] = field(default_factory=list)  # the transaction, lock wait included
    wait_s: list[float] = field(default_factory=list)  # first event of a batch -> its commit
    versions: set[int] = field(default_factory=set)


class RolloutMeter:
    """Sums batches into one metrics record every `every_s` seconds (and at `flush`)."""

    def __init__(self, log_event: Callable[[dict], None], every_s: float = 1.0):
        self.log_event = log_event
        self.every_s = every_s
        self._w = _Window(started=time.time())
        self.calls = 0  # finished model calls, over the pump's life

    def call(self) -> None:
        self._w.calls += 1
        self.calls += 1

    def batch(self, *, commit_s: float, wait_s: float | None, attempts: int, turns: int, sealed: int,
              discarded: int, dispatched: int, tokens: int, policy_tokens: int, rewards: list[float],
              steps: set[int], policy_version: int) -> None:
        w = self._w
        w.batches += 1
        w.attempts += attempts
        w.turns += turns
        w.sealed += sealed
        w.discarded += discarded
        w.dispatched += dispatched
        w.tokens += tokens
        w.policy_tokens += policy_tokens
        w.rewards += rewards
        w.steps |= steps
        w.commit_s.append(commit_s)
        if wait_s is not None:
            w.wait_s.append(wait_s)
        w.versions.add(policy_version)
        if time.time() - w.started >= self.every_s:
            self.flush()

    def flush(self) -> None:
        w, now = self._w, time.time()
        self._w = _Window(started=now)
        if not w.batches and not w.calls:
            return

        def ms(values: list[float], q: float) -> float | None:
            return round(float(np.percentile(values, q)) * 1000, 3) if values else None

        self.log_event({
            "kind": "rollout",
            "t_start": w.started,
            "t_end": now,
            "policy_version": max(w.versions) if w.versions else None,
            "steps": sorted(w.steps),
            "batches": w.batches,
            "calls": w.calls,
            "attempts_finished": w.attempts,
            "turns_committed": w.turns,
            "groups_sealed": w.sealed,
            "groups_discarded": w.discarded,
            "groups_dispatched": w.dispatched,
            "tokens": w.tokens,
            "policy_tokens": w.policy_tokens,
            "reward_mean": float(np.mean(w.rewards)) if w.rewards else None,
            "commit_p50_ms": ms(w.commit_s, 50),
            "commit_p99_ms": ms(w.commit_s, 99),
            "window_p99_ms": ms(w.wait_s, 99),
        })
