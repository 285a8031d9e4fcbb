"""The rollout pump: stamp prompts with a train step, run their groups' episodes, and put
finished groups in the replay buffer (or discard them with a reason).

It streams. Each episode advances on its own (start, turn, environment step, next turn,
score) with at most one model call in flight; up to `generation.max_inflight_calls`
calls are in flight at once, submitted one by one to an engine that batches
continuously, and a new group starts as soon as there is room for it, within the
staleness bound. No episode waits for another: a long reply holds only its own episode.

Store changes go through group commit (`group_commit.py`): finished calls, finished
turns (with `rollout_recovery.target_level: turn`), sealed groups and new dispatches
reach the store in one transaction per commit window, which is one cut. Order of work
inside a commit:
1. finished attempts become samples; finished turns save their episode's progress;
2. completed groups: those whose rewards carry no signal are discarded and their step's
   shortfall raised; the others enter the replay buffer, as many as it has permits (the
   rest wait, and no new group starts meanwhile);
3. restored groups first (a resumed run redoes what was in flight, each episode from its
   last committed turn at turn level), then steps with a shortfall, lowest first, as far
   ahead as the staleness bound admits; prompts come from the spare pool first, then the
   dataloader, whose leftovers go to the spare pool.
One loop for ledger and no-ledger dispatch; the difference is in `dispatch.py`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import numpy as np

from sqlalchemy import Connection

from rolloutdb.controller.rollout.agent_episodes import AgentEpisodes, AgentServerEpisodes
from rolloutdb.controller.rollout.calls import EngineCalls, EpisodesInFlight
from rolloutdb.controller.rollout.env_steps import EnvironmentStepper, LocalStepper
from rolloutdb.controller.rollout.episodes import call_seed
from rolloutdb.controller.rollout.group_commit import CommitBatch, Pending, RolloutMeter
from rolloutdb.controller.rollout.live_episode import GroupRun, LiveEpisode
from rolloutdb.controller.run.dispatch import GroupHandle
from rolloutdb.controller.run.runtime import RolloutParts
from rolloutdb.controller.run.tracing import RolloutTrace
from rolloutdb.gpu_capture.protocol import RunningCall, SamplingParams
from rolloutdb.store import (
    CallPrefix,
    Chunk,
    FinishedGeneration,
    Reservation,
    SavedEpisode,
    faults,
    ledger,
    pools,
    queries,
)

_WAKE: Future = Future()  # put in the completion queue to wake the loop (a flush request)
ZERO_VARIANCE = ledger.ZERO_REWARD_VARIANCE  # the store owns the names of the reasons the algorithm owns
IDLE_WAIT_S = 0.5


class RolloutPump:
    """`stepper`: where the environment steps (controller/rollout/env_steps.py; None: `parts.env`
    in the driver). `agents`: the run's agent servers (`environment.servers`), where whole
    episodes run instead of on `parts.env`; None: episodes run in the controller."""

    def __init__(self, parts: RolloutParts, restored: Sequence[tuple[GroupHandle, list[int]]] = (),
                 saved_episodes: Mapping[tuple[int, int], SavedEpisode] | None = None,
                 saved_prefixes: Mapping[tuple[int, int], Sequence[Chunk]] | None = None,
                 restored_cut: float | None = None, *, stepper: EnvironmentStepper | None = None,
                 agents: AgentEpisodes | None = None):
        self.p = parts
        cfg = parts.config
        self.group_size = cfg.algorithm.group_size
        self.groups_per_step = cfg.algorithm.groups_per_step
        self.max_inflight = cfg.generation.max_inflight_calls
        self.turn_level = cfg.rollout_recovery.keeps_turns
        # Turn level in the controller (not on agent servers, whose export holds their
        # agents): the pump writes each episode's saved turns to the store itself.
        self._writes_episodes = self.turn_level and agents is None
        # Prefix level: a call a restore hands back continues from its saved prefix
        self.prefix_level = cfg.rollout_recovery.target_level == "prefix"
        g = cfg.generation  # every call's settings, in process or on an agent server (each episode seeds its calls)
        self.params = SamplingParams(g.max_tokens, g.min_tokens, g.temperature, g.top_p, stop=tuple(g.stop),
                                     presence_penalty=g.presence_penalty, frequency_penalty=g.frequency_penalty)
        rec = cfg.rollout_recovery
        self.batch = CommitBatch(rec.commit_window_ms / 1000.0, rec.commit_max_events)
        self.meter = RolloutMeter(parts.log_event)
        # (group, generation indices still to run) for groups a restore handed back
        self._restored = list(restored)
        # Whether every restored group was started in a committed transaction (that writes
        # the turns each continues from under its new attempt). Until then a cut holds none
        # of them: a graceful stop waits for this before its final snapshot (controller.py).
        self.restored_started = not self._restored
        # What the attempts running at the restored cut had saved (turn level only uses it)
        self._saved = dict(saved_episodes or {}) if self.turn_level else {}
        # What the calls running at the restored cut had decoded (prefix level only)
        self._prefixes = {k: p for k, chunks in (saved_prefixes or {}).items()
                          if (p := CallPrefix.of(list(chunks))) is not None} if self.prefix_level else {}
        # Finished futures (calls, steps, agent servers' episodes), in the order they
        # finished: each puts itself here when it completes, so waiting costs O(1) per call
        # (concurrent.futures.wait over every running call costs O(calls in flight) per wake-up).
        self._done: queue.SimpleQueue[Future] = queue.SimpleQueue()
        self._flushes: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()  # `flush` requests
        self._groups: dict[int, GroupRun] = {}
        self._waiting_replay: list[GroupHandle] = []  # completed, kept, no permit yet
        self._flat_streak = 0  # zero-variance groups discarded in a row
        self._restored_cut = restored_cut
        if self._prefixes:
            parts.log_event({"kind": "prefix_restore", "calls": len(self._prefixes),
                             "tokens": sum(len(p.token_ids) for p in self._prefixes.values()), "t": time.time()})
        self.trace = RolloutTrace(parts.tracer)
        self.calls: EpisodesInFlight
        if agents is not None:  # each future is one whole episode, not one call
            self.calls = AgentServerEpisodes(agents=agents, params=self.params, batch=self.batch, meter=self.meter,
                                             trace=self.trace, stop=parts.runtime.stop, groups=self._groups,
                                             done=self._done)
        else:
            self.calls = EngineCalls(
                engine=parts.engine, env=parts.env, stepper=stepper if stepper is not None else LocalStepper(parts.env),
                params=self.params, batch=self.batch, meter=self.meter, trace=self.trace, stop=parts.runtime.stop,
                groups=self._groups, done=self._done, prefix_level=self.prefix_level, turn_level=self.turn_level)
        self._last_opened = self._derive_last_opened()
        with self.p.store.read() as conn:
            self._open_shortfall = bool(pools.get_shortfall(conn))

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        rt = self.p.runtime
        try:
            while not rt.stop.is_set():
                if self._flushes.qsize():
                    self._answer_flushes()
                    continue
                # Due, or nothing in flight that could add to it: waiting longer buys nothing.
                if self.batch.due() or (not self.calls.in_flight() and not self.batch.empty) \
                        or (self.batch.empty and self._may_start()):
                    self._commit()
                    continue
                if self.calls.in_flight():
                    left = self.batch.time_left()
                    try:
                        future: Future | None = self._done.get(timeout=IDLE_WAIT_S if left is None else left)
                    except queue.Empty:
                        continue
                    while future is not None:
                        if future is not _WAKE:
                            self.calls.on_done(future)
                        if self.batch.due():  # a batch never outgrows max_events
                            self._commit()
                        try:
                            future = self._done.get_nowait()
                        except queue.Empty:
                            future = None
                elif self._finished_everything():
                    return
                else:
                    rt.wait(IDLE_WAIT_S)  # until a refit admits the next step or permits free up
                    if self._waiting_replay and self._replay_has_room():
                        self._commit()
        except BaseException as e:  # noqa: BLE001 - handed to the controller
            rt.fail(e)
        finally:
            self.calls.abort_running()
            self.meter.flush()

    def flush(self, timeout: float) -> bool:
        """Commit what finished so far now, not at the end of its window (from another
        thread; True once committed). The snapshot pump calls it just before a cut at turn
        and prefix level: a call that finished before the cut is then in the cut, not lost
        with the window (measured: at prefix level 17% of what was decoded by the cut was
        lost that way without it, bench_prefix_kept.py)."""
        done = threading.Event()
        self._flushes.put(done)
        self._done.put(_WAKE)
        return done.wait(timeout)

    def uncommitted_calls(self) -> dict[str, RunningCall]:
        """Prefix level, read by a snapshot's cut: `EngineCalls.uncommitted_calls`."""
        return self.calls.uncommitted_calls()

    def _answer_flushes(self) -> None:
        if not self.batch.empty:
            self._commit()
        while True:
            try:
                self._flushes.get_nowait().set()
            except queue.Empty:
                return

    def _finished_everything(self) -> bool:
        return (self._last_opened >= self.p.bound.total_steps and not self._open_shortfall and not self._groups
                and not self._restored and not self._waiting_replay)

    def _replay_has_room(self) -> bool:
        with self.p.store.read() as conn:
            return queries.replay_room(conn) > 0

    # ------------------------------------------------------------------ admission

    def _derive_last_opened(self) -> int:
        """Highest step already stamped: from the store, so a resumed run continues."""
        with self.p.store.read() as conn:
            top = queries.highest_stamped_step(conn)
        done = self.p.read_progress().step
        return done if top is None else max(top, done)

    def _room(self) -> int:
        """Episodes that may start now without passing max_inflight_calls (one group
        always may when nothing runs, whatever its size)."""
        in_flight = self.calls.in_flight()
        return max(self.max_inflight - in_flight, self.group_size if not in_flight else 0)

    def _may_start(self) -> bool:
        """Whether a commit now would start something (in memory, no store read: the
        loop asks this on every turn)."""
        if self._restored:  # the next restored group, once there is room for all of it
            return self._room() >= len(self._restored[0][1])
        if self._waiting_replay or self._room() < self.group_size or self.p.runtime.shutdown is not None:
            return False
        last_step = self.p.bound.last_admissible_step(self.p.read_progress().policy_version)
        return self._open_shortfall or self._last_opened < last_step

    # ------------------------------------------------------------------ the commit

    def _commit(self) -> None:
        pending = self.batch.take()
        committing = self.calls.take_batch_calls()
        t_first = pending.first_event_at
        progress = self.p.read_progress()
        last_step = self.p.bound.last_admissible_step(progress.policy_version)
        started: list[LiveEpisode] = []
        completed = list(pending.completed)
        t0 = time.perf_counter()
        with self.p.store.atomic() as tx:
            saves = [(live, live.progress()) for live in pending.progress.values()]  # running attempts only
            rows = [row for _, row in saves]
            if rows:
                pools.put_episodes(tx, rows)
            by_group: dict[int, tuple[GroupHandle, dict[int, FinishedGeneration]]] = {}
            for live, gen in pending.finished:
                by_group.setdefault(live.group.group_id, (live.group, {}))[1][live.index] = gen
            if by_group:
                self.p.dispatcher.finish(tx, list(by_group.values()))
            retried = self._retry_lost(tx, pending.retries, progress.policy_version)
            restored_started, finalize, restarted = self._dispatch_restored(tx, progress.policy_version)
            if self._writes_episodes:
                # The turns a restored episode continues from, under its new attempt, in the
                # transaction that starts it: until its next turn commits they were only in
                # this pump, and a snapshot cut meanwhile (a stop soon after a resume, as on a
                # preemptible cluster) lost them for good.
                resumed = [(live, live.progress()) for live in restored_started if live.from_attempt is not None]
                if resumed:
                    pools.put_episodes(tx, [row for _, row in resumed])
                saves += resumed
            completed += finalize
            keep, drop = self._split_by_variance(tx, completed)
            if drop:
                self.p.dispatcher.discard(tx, drop, reason=ZERO_VARIANCE)
                for g in drop:
                    pools.add_shortfall(tx, g.target_step, 1)
                self._open_shortfall = True  # their steps need replacements, even if nothing starts now
            ready, self._waiting_replay = self._waiting_replay + keep, []
            room = queries.replay_room(tx) if ready else 0
            entered, self._waiting_replay = ready[:room], ready[room:]
            if entered:
                self.p.dispatcher.enter_replay(tx, entered)
            counts = (queries.version_token_counts(tx, [g.group_id for g in entered])
                      if entered and self.trace.enabled else {})
            new_groups: list[GroupHandle] = []
            # A graceful stop hands out nothing new: what runs finishes or is saved at the cut.
            if not self._waiting_replay and self.p.runtime.shutdown is None:
                new_groups = self._dispatch_new(tx, last_step, progress.policy_version,
                                                self._room() - len(restored_started))
            t_commit = time.time()  # before the commit: the trace stamps this batch's events with it
        t1 = time.perf_counter()
        for live, row in saves:  # committed: their next saves append
            live.saved_by(row)
        if not self._restored:
            self.restored_started = True
        self.calls.committed(committing)
        started = retried + restored_started + self._episodes_for(new_groups)  # env.start outside the transaction
        self._after_commit(pending, new_groups, restored_started, restarted, entered, drop, counts, t_commit)
        for live in started:
            self.calls.submit(live)
        episodes = [live.episode for live, _ in pending.finished]
        self.meter.batch(
            commit_s=t1 - t0, wait_s=None if t_first is None else t1 - t_first,
            attempts=len(pending.finished), turns=len(rows), sealed=len(entered), discarded=len(drop),
            dispatched=len(new_groups), tokens=sum(len(e.token_ids) for e in episodes),
            policy_tokens=sum(e.policy_tokens for e in episodes), rewards=[e.reward for e in episodes],
            steps={live.group.target_step for live, _ in pending.finished}, policy_version=progress.policy_version)
        if pending.finished or entered or drop:
            self.p.runtime.notify()

    def _after_commit(self, pending: Pending, new_groups: list[GroupHandle], restored: list[LiveEpisode],
                      restarted: list[tuple], entered: list[GroupHandle], drop: list[GroupHandle],
                      counts: dict[int, dict[int, int]], t_commit: float) -> None:
        """Fault points and trace events of a committed batch (the trace records only
        what is durable, except `call_finished`), stamped with the batch's time.
        `restarted`: the stopped run's attempts this batch abandoned for the restored
        groups it started (`Dispatcher.restart`)."""
        if pending.retries and self.trace.enabled:
            for why in sorted({reason for _, reason in pending.retries}):  # as the ledger records them
                lost = [live for live, reason in pending.retries if reason == why]
                self.trace.at(t_commit).abandoned(
                    [(live.group.group_id, live.group.reservation.prompt_id, live.index, live.attempt,
                      live.group.target_step, live.group.policy_version) for live in lost],
                    why, tokens=[live.episode.policy_tokens for live in lost])
            # Their new attempts (_retry_lost), one generation each.
            self.trace.at(t_commit).dispatched_generations([(live.group, live.index) for live, _ in pending.retries])
        if new_groups or restored:
            faults.point("pump.after_dispatch")
        if pending.progress:
            faults.point("pump.after_turn_commit")
        if pending.finished:
            faults.point("pump.after_finish")
        if entered:
            faults.point("pump.after_enter_replay")
        if not self.trace.enabled:
            return
        trace = self.trace.at(t_commit)
        if new_groups:
            trace.reserved(new_groups, self.group_size)
            trace.dispatched(new_groups)
        if restarted:
            trace.abandoned(restarted, "restart")
        if restored:
            prefixes = {(live.group.group_id, live.index): len(live.prefix.token_ids)
                        for live in restored if live.prefix is not None}
            trace.dispatched(list({id(live.group): live.group for live in restored}.values()), prefixes)
            if prefixes and self._restored_cut is not None:
                # The stopped run recorded these cuts only once its snapshot was published,
                # and a SIGKILL right after can lose that record: the restore says it again,
                # at the cut's own time, for the attempts this batch restarted (the same values).
                self.trace.cut([{"group_id": live.group.group_id, "prompt_id": live.group.reservation.prompt_id,
                                 "generation_index": live.index, "attempt": live.attempt - 1,
                                 "step": live.group.target_step, "policy_version": live.prefix.token_versions[-1],
                                 "tokens": len(live.prefix.token_ids)}
                                for live in restored if live.prefix is not None and live.prefix.token_versions],
                               self._restored_cut)
            for live in restored:
                if live.from_attempt is not None:
                    e = live.episode
                    trace.episode_restored(live.group, live.index, from_attempt=live.from_attempt,
                                           turn=e.turn, tokens=e.policy_tokens, total_tokens=len(e.token_ids))
        for live in pending.progress.values():
            e = live.episode
            trace.turn_committed(live.group, live.index, turn=e.turn - 1, tokens=e.policy_tokens,
                                 total_tokens=len(e.token_ids))
        trace.finished([(live.group, live.index) for live, _ in pending.finished],
                       [live.episode for live, _ in pending.finished])
        trace.discarded(drop, ZERO_VARIANCE)
        trace.entered_replay(entered, counts)

    # ------------------------------------------------------------------ dispatch

    def _retry_lost(self, tx: Connection, lost: list[tuple[LiveEpisode, str]], policy_version: int) -> list[LiveEpisode]:
        """New attempts for the episodes an agent server lost, from their start (the
        server's agent is gone with it)."""
        if not lost:
            return []
        self.p.dispatcher.retry(tx, [(live.group, live.index, reason) for live, reason in lost],
                                policy_version=policy_version)
        return [self._live(live.group, live.index) for live, _ in lost]

    def _dispatch_restored(self, tx: Connection,
                           policy_version: int) -> tuple[list[LiveEpisode], list[GroupHandle], list[tuple]]:
        """New attempts for the restored groups' unfinished generations, whole groups
        in their order, as many as there is room for (`_room`: calls still in flight
        count, so a commit of a batch while others run never passes
        max_inflight_calls); groups with every generation finished go straight to
        completion (they only wait to be sealed). Also returns the stopped run's
        attempts abandoned for them, as the trace's rows."""
        finalize: list[GroupHandle] = []
        taken: list[tuple[GroupHandle, list[int]]] = []
        room, n = self._room(), 0
        while self._restored:
            group, generations = self._restored[0]
            if n + len(generations) > room:
                break
            self._restored.pop(0)
            if generations:
                taken.append((group, generations))
                n += len(generations)
            else:
                finalize.append(group)
        if not taken:
            return [], finalize, []
        # One restart for the batch: a call per group, ~7 statements each, took 1.67 s for
        # 10k restored groups (78k attempts) against 0.93 s in batches of 64
        # (bench/bench_restore.py's restart, BENCHMARKS.md).
        restarted = self.p.dispatcher.restart(tx, taken, policy_version=policy_version)
        started: list[LiveEpisode] = []
        for group, generations in taken:
            run = self._groups.setdefault(group.group_id, GroupRun(group))
            run.outstanding.update(generations)
            started += [self._live(group, i) for i in generations]
        return started, finalize, restarted

    def _dispatch_new(self, tx: Connection, last_step: int, policy_version: int, room: int) -> list[GroupHandle]:
        """Stamp and dispatch new groups, as many as `room` episodes hold, within the
        staleness bound (the ledger records both states in this one cut)."""
        handles: list[GroupHandle] = []
        room_groups = max(0, room) // self.group_size
        while self._last_opened < last_step:
            self._last_opened += 1
            pools.set_shortfall(tx, self._last_opened, self.groups_per_step)
        shortfall = pools.get_shortfall(tx)
        for step, needed in sorted(shortfall.items()):
            free = room_groups - len(handles)
            if step > last_step or free <= 0:
                break
            n = min(needed, free)
            prompts = self._take_prompts(tx, n)
            handles += self.p.dispatcher.reserve(tx, prompts, step=step, num_generations=self.group_size)
            shortfall[step] = needed - n
            pools.set_shortfall(tx, step, needed - n)
        if handles:
            self.p.dispatcher.dispatch(tx, handles, policy_version=policy_version)
            for g in handles:
                self._groups[g.group_id] = GroupRun(g, set(range(g.num_generations)))
        self._open_shortfall = any(n > 0 for n in shortfall.values())
        return handles

    def _take_prompts(self, tx: Connection, n: int) -> list[Reservation]:
        """Spare pool first, then whole dataloader batches; leftovers become spares."""
        prompts = pools.pop_spare(tx, n)
        while len(prompts) < n:
            cursor = pools.read_cursor(tx)
            batch = self.p.order.take(cursor.next_seq, self.groups_per_step)
            pools.advance_cursor(tx, cursor.next_seq + len(batch), batch[-1].epoch)
            use = n - len(prompts)
            prompts += batch[:use]
            pools.push_spare(tx, batch[use:])
        return prompts

    def _episodes_for(self, groups: list[GroupHandle]) -> list[LiveEpisode]:
        return [self._live(g, i) for g in groups for i in sorted(g.attempts or {})]

    def _live(self, group: GroupHandle, index: int) -> LiveEpisode:
        """The episode of one generation's new attempt, with what the attempt it replaces
        saved at the restored cut (`EpisodesInFlight.episode`)."""
        r = group.reservation
        seed = call_seed(self.p.config.run.seed, r.epoch, r.prompt_id, index)
        return self.calls.episode(group, index, (group.attempts or {}).get(index), group.attempt_numbers.get(index, 0),
                                  seed, self._saved.pop((group.group_id, index), None),
                                  self._prefixes.pop((group.group_id, index), None))

    # ------------------------------------------------------------------ completion

    def _split_by_variance(self, tx: Connection, groups: list[GroupHandle]) -> tuple[list[GroupHandle], list[GroupHandle]]:
        """Rewards come from the store: a restored group's earlier generations are there."""
        if not groups or not self.p.config.algorithm.discard_zero_variance:
            return groups, []
        rewards = queries.sample_rewards(tx, [g.group_id for g in groups])
        if self._flat_streak >= self.p.config.algorithm.max_flat_groups_in_a_row:
            # A policy that answers every prompt the same way (collapsed, or done
            # learning) makes every group flat; discarding forever would never fill a
            # step. Train on them instead: their advantages are zero, so the step is
            # harmless, and the run ends.
            self._flat_streak = 0
            return groups, []
        keep = [g for g in groups if np.std(rewards[g.group_id]) > 1e-9]
        drop = [g for g in groups if np.std(rewards[g.group_id]) <= 1e-9]
        self._flat_streak = 0 if keep else self._flat_streak + len(drop)
        return keep, drop

