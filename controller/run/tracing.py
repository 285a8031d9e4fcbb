"""What the pumps tell the trace (docs/trace.md lists every event and field).

One small adapter so the pumps say *what happened* in one line each and the field names
live in one place. Tracing off is a `NullTracer`, never None; every method returns at
once when the tracer is not `enabled`, so the pumps pay nothing for what nobody records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rolloutdb.controller.run.dispatch import GroupHandle
from rolloutdb.store import NullTracer, Tracer, ledger


# How long a pump waits for the trace to commit what it emitted (a snapshot's cut calls
# before the snapshot is published; a train step's event before its metrics line); past
# it, the pump goes on all the same.
TRACE_WAIT_S = 2.0


class _AtTime:
    """A tracer whose events all carry one given time."""

    def __init__(self, tracer: Tracer | NullTracer | _AtTime, t: float):
        self._tracer, self._t = tracer, t
        self.enabled: bool = bool(tracer.enabled)

    def emit(self, event: str, **fields) -> None:
        self._tracer.emit(event, t=self._t, **fields)

    def flush(self, timeout: float | None = None) -> bool:
        return self._tracer.flush(timeout)


class RolloutTrace:
    def __init__(self, tracer: Tracer | NullTracer | _AtTime):
        self.tracer = tracer

    def at(self, t: float) -> RolloutTrace:
        """The same events stamped `t` instead of the time of the call. The pumps stamp
        what a transaction did with a time read inside it, before its commit: a snapshot
        cut that sees the transaction then has a later cut time than its events, which is
        what the trace's figures join on (an event stamped after the commit could fall
        after a cut that already holds its change)."""
        return RolloutTrace(_AtTime(self.tracer, t))

    @property
    def enabled(self) -> bool:
        """Whether events are recorded: callers skip work done only for the trace."""
        return self.tracer.enabled

    def flush(self, timeout: float) -> bool:
        """Wait until every event emitted before this is committed (True), at most `timeout` s."""
        return self.tracer.flush(timeout)

    def reserved(self, groups: Sequence[GroupHandle], group_size: int) -> None:
        """Groups reserved and dispatched in one commit batch: `policy_version` is the
        version they were dispatched under, the engine's at their reservation."""
        if not self.tracer.enabled:
            return
        for g in groups:
            self.tracer.emit("group_reserved", group_id=g.group_id, prompt_id=g.reservation.prompt_id, step=g.target_step,
                        policy_version=g.policy_version, epoch=g.reservation.epoch, group_size=group_size)

    def dispatched(self, groups: Sequence[GroupHandle], prefix_tokens: Mapping[tuple[int, int], int] | None = None) -> None:
        """`prefix_tokens`: (group id, generation index) -> the prefix a restored call
        continues from (prefix level); absent: it starts from its turn's prompt."""
        if not self.tracer.enabled:
            return
        for g in groups:
            for i in sorted(g.attempts or {}):
                extra = {}
                if prefix_tokens and (g.group_id, i) in prefix_tokens:
                    extra["prefix_tokens"] = prefix_tokens[(g.group_id, i)]
                self.tracer.emit("attempt_dispatched", group_id=g.group_id, prompt_id=g.reservation.prompt_id,
                            generation_index=i, attempt=g.attempt_numbers.get(i, 0), step=g.target_step,
                            policy_version=g.policy_version, **extra)

    def cut(self, calls: Sequence[dict], cut_time: float) -> None:
        """A published snapshot froze these running calls (prefix level): each dict has
        group_id, prompt_id, generation_index, attempt, step, policy_version, tokens."""
        if not self.tracer.enabled:
            return
        for c in calls:
            self.tracer.emit("call_cut", t=cut_time, **c)

    def fallback(self, calls: Sequence[dict], cut_time: float) -> None:
        """A published snapshot did not keep these tokens of running calls (prefix level):
        each dict has attempt_id, turn, reason, tokens and the attempt's group_id,
        prompt_id, generation_index, attempt, step, policy_version. The call restarts its
        turn after a stop (reason `newer_policy_version`: it continues without its tail)."""
        if not self.tracer.enabled:
            return
        for c in calls:
            self.tracer.emit("call_fallback", t=cut_time, **c)

    def dispatched_generations(self, owners: Sequence[tuple[GroupHandle, int]]) -> None:
        """New attempts of single generations (an agent server's lost episodes, retried)."""
        if not self.tracer.enabled:
            return
        for g, i in owners:
            self.tracer.emit("attempt_dispatched", **self._attempt(g, i))

    def finished(self, owners: Sequence[tuple[GroupHandle, int]], results) -> None:
        if not self.tracer.enabled:
            return
        for (g, i), res in zip(owners, results):
            counts: dict[int, int] = {}
            for v in res.token_versions:
                counts[v] = counts.get(v, 0) + 1
            self.tracer.emit("rollout_finished", group_id=g.group_id, prompt_id=g.reservation.prompt_id,
                        generation_index=i, attempt=g.attempt_numbers.get(i, 0), step=g.target_step,
                        policy_version=g.policy_version, tokens=len(res.token_ids), reward=res.reward,
                        finish_reason=res.finish_reasons[-1] if res.finish_reasons else None,
                        version_token_counts=counts)

    def entered_replay(self, groups: Sequence[GroupHandle], version_counts: dict[int, dict[int, int]]) -> None:
        """The groups were sealed and entered the replay buffer. The trace's event keeps
        its old name, `group_published`: it is a table of every trace file."""
        if not self.tracer.enabled:
            return
        for g in groups:
            counts = version_counts.get(g.group_id, {})
            common = dict(group_id=g.group_id, prompt_id=g.reservation.prompt_id, step=g.target_step,
                          policy_version=g.policy_version)
            self.tracer.emit("group_sealed", generations=g.num_generations, **common)
            self.tracer.emit("group_published", version_token_counts=counts,
                        tokens=sum(n for v, n in counts.items() if v >= 0), **common)

    def discarded(self, groups: Sequence[GroupHandle], reason: str) -> None:
        if not self.tracer.enabled:
            return
        for g in groups:
            self.tracer.emit("group_discarded", group_id=g.group_id, prompt_id=g.reservation.prompt_id,
                        step=g.target_step, policy_version=g.policy_version, reason=reason)

    def withdrawn(self, rows: Sequence[tuple]) -> None:
        """A rewinding resume's withdrawn groups, (group_id, prompt_id, step,
        policy_version) each (`Rewound.withdrawn_groups`): each left the ledger untrained,
        a `group_discarded` with reason `rewind`, so the trace's figures no longer count
        it as running at a later stop (its prompt's next group is a new one)."""
        if not self.tracer.enabled:
            return
        for group_id, prompt_id, step, policy_version in rows:
            self.tracer.emit("group_discarded", group_id=group_id, prompt_id=prompt_id, step=step,
                             policy_version=policy_version, reason=ledger.REWIND_WITHDRAWAL)

    def abandoned(self, rows: Sequence[tuple], reason: str, tokens: Sequence[int] | None = None) -> None:
        """rows: (group_id, prompt_id, generation_index, attempt, step, policy_version);
        `tokens`: per row, the policy tokens the attempt's episode had decoded, where this
        process knows them (not at a restore: the stopped run decoded them)."""
        if not self.tracer.enabled:
            return
        for k, (group_id, prompt_id, generation_index, attempt, step, policy_version) in enumerate(rows):
            extra = {} if tokens is None else {"tokens": tokens[k]}
            self.tracer.emit("attempt_abandoned", group_id=group_id, prompt_id=prompt_id,
                        generation_index=generation_index, attempt=attempt, step=step,
                        policy_version=policy_version, reason=reason, **extra)

    def snapshot_cut(self, *, cut_time: float, snapshot_seq: int | None, anchor: str, step: int, snapshot: str,
                     group_states: Mapping[str, int], decoded_at: float | None = None) -> None:
        """A snapshot was published. `group_states`: the ledger's groups per state at the
        cut (`Capture.group_states`); `step`: the anchor's step, whose weights (version
        `step`) a run restoring the snapshot generates with."""
        if self.tracer.enabled:
            self.tracer.emit("snapshot_cut", cut_time=cut_time, snapshot_seq=snapshot_seq, anchor=anchor, step=step,
                             policy_version=step, snapshot=snapshot, decoded_at=decoded_at,
                             groups_in_flight=group_states.get("reserved", 0) + group_states.get("dispatched", 0))

    def restore_done(self, *, step: int, policy_version: int, cut_time: float | None, snapshot_seq: int | None,
                     anchor: str | None, snapshot: str, groups_restored: int, replay_restored: int,
                     decoded_at: float | None = None) -> None:
        if self.tracer.enabled:
            self.tracer.emit("restore_done", step=step, policy_version=policy_version, cut_time=cut_time,
                             decoded_at=decoded_at,
                             snapshot_seq=snapshot_seq, anchor=anchor, snapshot=snapshot,
                             groups_restored=groups_restored, replay_restored=replay_restored)

    def _attempt(self, g: GroupHandle, generation_index: int) -> dict:
        return dict(group_id=g.group_id, prompt_id=g.reservation.prompt_id, generation_index=generation_index,
                    attempt=g.attempt_numbers.get(generation_index, 0), step=g.target_step,
                    policy_version=g.policy_version)

    def call_finished(self, g: GroupHandle, generation_index: int, *, turn: int, tokens: int,
                      finish_reason: str | None, prefix_exactness: str | None = None) -> None:
        """The engine returned one call (turn `turn`, 0-based) of the generation's current
        attempt; `tokens`: what this call decoded, a continued call's prefix not counted;
        `prefix_exactness`: how its engine continued it from a cut prefix (None: it did not).
        Emitted before the commit batch that writes it."""
        if self.tracer.enabled:
            self.tracer.emit("call_finished", turn=turn, tokens=tokens, finish_reason=finish_reason,
                             prefix_exactness=prefix_exactness, **self._attempt(g, generation_index))

    def turn_committed(self, g: GroupHandle, generation_index: int, *, turn: int, tokens: int,
                       total_tokens: int) -> None:
        """The episode's state after turn `turn` is durable (emitted after its commit
        batch; turn level only). tokens / total_tokens: policy / policy + environment
        tokens of the episode so far."""
        if self.tracer.enabled:
            self.tracer.emit("turn_committed", turn=turn, tokens=tokens, total_tokens=total_tokens,
                             **self._attempt(g, generation_index))

    def episode_restored(self, g: GroupHandle, generation_index: int, *, from_attempt: int, turn: int,
                         tokens: int, total_tokens: int) -> None:
        """The generation's new attempt (its number in g.attempt_numbers) continues
        `from_attempt`'s episode at turn `turn` (turns kept) with `tokens` policy tokens
        kept (`total_tokens` with the environment's). Emitted when it is dispatched."""
        if self.tracer.enabled:
            self.tracer.emit("episode_restored", from_attempt=from_attempt, turn=turn, tokens=tokens,
                             total_tokens=total_tokens, **self._attempt(g, generation_index))

    def refit(self, old_version: int, new_version: int, running: dict[str, int]) -> None:
        if self.tracer.enabled:
            self.tracer.emit("refit", step=new_version, policy_version=new_version, old_version=old_version,
                             new_version=new_version, running=running)

    def train_step(self, step: int, group_ids: Sequence[int], batch_age: float, tokens: int) -> None:
        if self.tracer.enabled:
            self.tracer.emit("train_step", step=step, policy_version=step - 1, group_ids=list(group_ids),
                        batch_age=batch_age, tokens=tokens)
