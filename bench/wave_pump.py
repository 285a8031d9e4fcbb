"""The wave pump: the BASELINE of bench/bench_streaming.py, not product code.

This is the lockstep rollout pump of commit 1578329 (git show
1578329:controller/rollout_pump.py, with `run_episodes` from 1578329:controller/episodes.py),
kept only here so the streaming `RolloutPump` can be measured against it side by side.
Nothing outside bench/ imports it, and nothing should.

How it works (as it did):
- every episode of a wave starts together; a wave is up to max_batch_size // group_size
  groups (restored groups first, then steps with a shortfall, lowest first, within the
  staleness bound), stamped and dispatched in one transaction;
- each turn is one blocking batch: the requests of every episode still running go to
  the engine together (`generate_all`), and the next turn starts only when the slowest
  reply of the batch has finished;
- nothing reaches the store until the whole wave ends; then one transaction writes its
  finishes, discards the zero-variance groups (raising their step's shortfall) and makes
  the others enter the replay buffer (those without a permit wait and retry).

Adapted to today's APIs only: episodes are `controller.episodes.Episode` (the same seeds,
the same reply limits as the streaming pump, so both decode the same tokens), the engine
is reached through `generate_all(engine, requests)`, and the replay entries moved into
the wave's one transaction (the old pump opened a second one for them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from rolloutdb.controller.run.dispatch import GroupHandle
from rolloutdb.controller.rollout.episodes import Episode, call_seed
from rolloutdb.controller.run.runtime import RolloutParts
from rolloutdb.controller.run.tracing import RolloutTrace
from rolloutdb.gpu_capture.protocol import SamplingParams, generate_all
from rolloutdb.store import FinishedGeneration, Reservation, codec, faults, ledger, pools, queries

ZERO_VARIANCE = ledger.ZERO_REWARD_VARIANCE
IDLE_WAIT_S = 0.5


class WavePump:
    """Same constructor and `run()` as `RolloutPump` (minus turn-level recovery, which a
    wave pump cannot offer: nothing of a wave is durable before it ends)."""

    def __init__(self, parts: RolloutParts, restored: Sequence[tuple[GroupHandle, list[int]]] = ()):
        self.p = parts
        cfg = parts.config
        self.group_size = cfg.algorithm.group_size
        self.groups_per_step = cfg.algorithm.groups_per_step
        self.wave_cap = max(1, cfg.generation.max_batch_size // self.group_size)
        self.params = SamplingParams(
            max_tokens=cfg.generation.max_tokens,
            min_tokens=cfg.generation.min_tokens,
            temperature=cfg.generation.temperature,
            top_p=cfg.generation.top_p,
            stop=tuple(cfg.generation.stop),
        )
        self._restored = list(restored)
        self._waiting_replay: list[GroupHandle] = []
        self._flat_streak = 0
        self.trace = RolloutTrace(parts.tracer)
        self._last_opened = self._derive_last_opened()
        self.calls = 0  # finished model calls
        self.waves = 0

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        rt = self.p.runtime
        try:
            while not rt.stop.is_set():
                if self._waiting_replay:
                    self._enter_waiting()
                    continue
                wave = self._restored_wave() or self._next_wave()
                if wave:
                    self._run_wave(wave)
                elif self._all_steps_stamped():
                    return
                else:
                    rt.wait(IDLE_WAIT_S)  # until a refit admits the next step
        except BaseException as e:  # noqa: BLE001 - handed to the controller
            rt.fail(e)

    def _all_steps_stamped(self) -> bool:
        if self._last_opened < self.p.bound.total_steps:
            return False
        with self.p.store.read() as conn:
            return not pools.get_shortfall(conn)

    # ------------------------------------------------------------------ stamping

    def _derive_last_opened(self) -> int:
        with self.p.store.read() as conn:
            top = queries.highest_stamped_step(conn)
        done = self.p.read_progress().step
        return done if top is None else max(top, done)

    def _next_wave(self) -> list[GroupHandle]:
        """Stamp and dispatch the next wave in one transaction."""
        progress = self.p.read_progress()
        last_step = self.p.bound.last_admissible_step(progress.policy_version)
        if self._last_opened >= last_step and not self._has_work(last_step):
            return []
        handles: list[GroupHandle] = []
        with self.p.store.atomic() as tx:
            while self._last_opened < last_step:
                self._last_opened += 1
                pools.set_shortfall(tx, self._last_opened, self.groups_per_step)
            for step, needed in sorted(pools.get_shortfall(tx).items()):
                room = self.wave_cap - len(handles)
                if step > last_step or room <= 0:
                    break
                n = min(needed, room)
                prompts = self._take_prompts(tx, n)
                handles += self.p.dispatcher.reserve(tx, prompts, step=step, num_generations=self.group_size)
                pools.set_shortfall(tx, step, needed - n)
            if handles:
                self.p.dispatcher.dispatch(tx, handles, policy_version=progress.policy_version)
        if handles:
            faults.point("pump.after_dispatch")
            self.trace.reserved(handles, self.group_size)
            self.trace.dispatched(handles)
        return handles

    def _has_work(self, last_step: int) -> bool:
        with self.p.store.read() as conn:
            return any(step <= last_step for step in pools.get_shortfall(conn))

    def _take_prompts(self, tx, n: int) -> list[Reservation]:
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

    def _restored_wave(self) -> list[GroupHandle]:
        if not self._restored:
            return []
        wave, self._restored = self._restored[: self.wave_cap], self._restored[self.wave_cap :]
        version = self.p.read_progress().policy_version
        with self.p.store.atomic() as tx:
            for group, generations in wave:
                self.p.dispatcher.redispatch(tx, group, generations, policy_version=version)
        self.trace.dispatched([g for g, _ in wave])
        return [g for g, _ in wave]

    # ------------------------------------------------------------------ generation

    def _episodes(self, wave: list[GroupHandle]) -> tuple[list[tuple[GroupHandle, int]], list[Episode]]:
        """One episode per attempt, seeded as the streaming pump seeds it."""
        seed = self.p.config.run.seed
        owners, episodes = [], []
        for g in wave:
            r = g.reservation
            for i in sorted(g.attempts or {}):
                attempt = g.attempt_numbers.get(i, 0)
                owners.append((g, i))
                episodes.append(Episode.start(self.p.env, r.prompt_id, key=f"g{g.group_id}.{i}-a{attempt}",
                                              seed=call_seed(seed, r.epoch, r.prompt_id, i)))
        return owners, episodes

    def _run_wave(self, wave: list[GroupHandle]) -> None:
        t0 = time.time()
        owners, episodes = self._episodes(wave)
        env = self.p.env
        # Lockstep: each turn is one blocking batch of every episode still running.
        active = [e for e in episodes if not e.done]
        while active:
            results = generate_all(self.p.engine, [e.request(env, self.params) for e in active])
            for e, out in zip(active, results):
                e.absorb(env, out)
            self.calls += len(active)
            active = [e for e in active if not e.done]
        finished: dict[int, dict[int, FinishedGeneration]] = {}
        for (g, i), e in zip(owners, episodes):
            finished.setdefault(g.group_id, {})[i] = FinishedGeneration(
                token_ids=e.token_ids, logprobs=e.logprobs, reward=e.reward,
                version_token_counts=codec.version_runs(e.token_versions))
        # One cut for the wave: samples, discards with their shortfall, replay entries.
        with self.p.store.atomic() as tx:
            self.p.dispatcher.finish(tx, [(g, finished.get(g.group_id, {})) for g in wave])
            keep, drop = self._split_by_variance(tx, wave)
            if drop:
                self.p.dispatcher.discard(tx, drop, reason=ZERO_VARIANCE)
                for g in drop:
                    pools.add_shortfall(tx, g.target_step, 1)
            room = queries.replay_room(tx)
            entered, self._waiting_replay = keep[:room], keep[room:]
            if entered:
                self.p.dispatcher.enter_replay(tx, entered)
            counts = queries.version_token_counts(tx, [g.group_id for g in entered]) \
                if entered and self.trace.enabled else {}
        faults.point("pump.after_finish")
        self.trace.finished(owners, episodes)
        self.trace.discarded(drop, ZERO_VARIANCE)
        if entered:
            self.trace.entered_replay(entered, counts)
        self.waves += 1
        self.p.log_event({
            "kind": "rollout_wave",
            "t_start": t0,
            "t_end": time.time(),
            "policy_version": wave[0].policy_version,
            "steps": sorted({g.target_step for g in wave}),
            "groups": len(wave),
            "discarded": len(drop),
            "tokens": int(sum(len(e.token_ids) for e in episodes)),
            "policy_tokens": int(sum(e.policy_tokens for e in episodes)),
            "reward_mean": float(np.mean([e.reward for e in episodes])) if episodes else 0.0,
        })
        self.p.runtime.notify()

    def _enter_waiting(self) -> None:
        """Sealed groups that found the replay buffer full: retry once permits free up."""
        with self.p.store.atomic() as tx:
            room = queries.replay_room(tx)
            entered, self._waiting_replay = self._waiting_replay[:room], self._waiting_replay[room:]
            if entered:
                self.p.dispatcher.enter_replay(tx, entered)
            counts = queries.version_token_counts(tx, [g.group_id for g in entered]) \
                if entered and self.trace.enabled else {}
        if entered:
            self.trace.entered_replay(entered, counts)
            self.p.runtime.notify()
        else:
            self.p.runtime.wait(IDLE_WAIT_S)  # the train pump frees permits

    def _split_by_variance(self, tx, wave: list[GroupHandle]) -> tuple[list[GroupHandle], list[GroupHandle]]:
        if not self.p.config.algorithm.discard_zero_variance:
            return wave, []
        rewards = queries.sample_rewards(tx, [g.group_id for g in wave])
        if self._flat_streak >= self.p.config.algorithm.max_flat_groups_in_a_row:
            self._flat_streak = 0
            return wave, []
        keep = [g for g in wave if np.std(rewards[g.group_id]) > 1e-9]
        drop = [g for g in wave if np.std(rewards[g.group_id]) <= 1e-9]
        self._flat_streak = 0 if keep else self._flat_streak + len(drop)
        return keep, drop
