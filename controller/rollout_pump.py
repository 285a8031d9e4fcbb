"""The rollout pump: stamp prompts with a train step, generate their groups, and put
finished groups in the replay buffer (or discard them with a reason).

One loop for ledger and no-ledger dispatch; the difference is in `dispatch.py`. Each
store change is one short transaction; generation happens outside every transaction.

Order of work in each wave:
1. restored groups first (a resumed run redoes what was in flight before reading new
   prompts);
2. steps with a shortfall, lowest first, as far ahead as the staleness bound admits;
   prompts come from the spare pool first, then the dataloader, whose leftovers go to
   the spare pool.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from rolloutdb.controller.dispatch import GroupHandle
from rolloutdb.controller.episodes import EpisodeSpec, call_seed, run_episodes
from rolloutdb.controller.runtime import RolloutParts
from rolloutdb.controller.tracing import RolloutTrace
from rolloutdb.gpu_capture.protocol import SamplingParams
from rolloutdb.store import FinishedGeneration, ReplayFullError, Reservation, faults, codec, ledger, pools, queries

ZERO_VARIANCE = ledger.ZERO_REWARD_VARIANCE  # the store owns the names of the reasons the algorithm owns
IDLE_WAIT_S = 0.5


class RolloutPump:
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
        # (group, generation indices still to run) for groups a restore handed back
        self._restored = list(restored)
        self._flat_streak = 0  # zero-variance groups discarded in a row
        self.trace = RolloutTrace(parts.tracer)
        self._last_opened = self._derive_last_opened()

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        rt = self.p.runtime
        try:
            while not rt.stop.is_set():
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
        """Highest step already stamped: from the store, so a resumed run continues."""
        with self.p.store.read() as conn:
            top = queries.highest_stamped_step(conn)
        done = self.p.read_progress().step
        return done if top is None else max(top, done)

    def _next_wave(self) -> list[GroupHandle]:
        """Stamp and dispatch the next wave in one transaction (reserve, then dispatch:
        the ledger records both states, one cut covers them). An idle poll writes
        nothing, so it does not move the mutation counter."""
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

    def _run_wave(self, wave: list[GroupHandle]) -> None:
        t0 = time.time()
        seed = self.p.config.run.seed
        specs, owners = [], []
        for g in wave:
            for i, attempt_id in sorted((g.attempts or {}).items()):
                r = g.reservation
                specs.append(EpisodeSpec(f"g{g.group_id}.{i}-a{attempt_id}", r.prompt_id, call_seed(seed, r.epoch, r.prompt_id, i)))
                owners.append((g, i))
        results = run_episodes(self.p.engine, self.p.env, specs, self.params)
        finished: dict[int, dict[int, FinishedGeneration]] = {}
        for (g, i), res in zip(owners, results):
            finished.setdefault(g.group_id, {})[i] = FinishedGeneration(
                token_ids=res.token_ids,
                logprobs=res.logprobs,
                reward=res.reward,
                version_token_counts=codec.version_runs(res.token_versions),
            )
        # One cut: the samples land, and groups whose rewards carry no signal are
        # discarded with their step's shortfall raised, so a snapshot never sees one
        # without the other.
        with self.p.store.atomic() as tx:
            self.p.dispatcher.finish(tx, [(g, finished.get(g.group_id, {})) for g in wave])
            keep, drop = self._split_by_variance(tx, wave)
            if drop:
                self.p.dispatcher.discard(tx, drop, reason=ZERO_VARIANCE)
                for g in drop:
                    pools.add_shortfall(tx, g.target_step, 1)
        faults.point("pump.after_finish")
        self.trace.finished(owners, results)
        self.trace.discarded(drop, ZERO_VARIANCE)
        self._enter_replay(keep)
        self.p.log_event(
            {
                "kind": "rollout_wave",
                "t_start": t0,
                "t_end": time.time(),
                "policy_version": wave[0].policy_version,
                "steps": sorted({g.target_step for g in wave}),
                "groups": len(wave),
                "discarded": len(drop),
                "tokens": int(sum(len(r.token_ids) for r in results)),
                "policy_tokens": int(sum(r.policy_tokens for r in results)),
                "reward_mean": float(np.mean([r.reward for r in results])) if results else 0.0,
            }
        )
        self.p.runtime.notify()

    def _split_by_variance(self, tx, wave: list[GroupHandle]) -> tuple[list[GroupHandle], list[GroupHandle]]:
        """Rewards come from the store: a restored group's earlier generations are there."""
        if not self.p.config.algorithm.discard_zero_variance:
            return wave, []
        rewards = queries.sample_rewards(tx, [g.group_id for g in wave])
        if self._flat_streak >= self.p.config.algorithm.max_flat_groups_in_a_row:
            # A policy that answers every prompt the same way (collapsed, or done
            # learning) makes every group flat; discarding forever would never fill a
            # step. Train on them instead: their advantages are zero, so the step is
            # harmless, and the run ends.
            self._flat_streak = 0
            return wave, []
        keep = [g for g in wave if np.std(rewards[g.group_id]) > 1e-9]
        drop = [g for g in wave if np.std(rewards[g.group_id]) <= 1e-9]
        self._flat_streak = 0 if keep else self._flat_streak + len(drop)
        return keep, drop

    def _enter_replay(self, groups: list[GroupHandle]) -> None:
        """Into the replay buffer, one permit each; waits while the buffer is full."""
        pending = list(groups)
        while pending and not self.p.runtime.stop.is_set():
            try:
                with self.p.store.atomic() as tx:
                    self.p.dispatcher.enter_replay(tx, pending)
                    counts = queries.version_token_counts(tx, [g.group_id for g in pending]) if self.trace.enabled else {}
            except ReplayFullError:
                self.p.runtime.wait(IDLE_WAIT_S)  # the train pump frees permits
                continue
            faults.point("pump.after_enter_replay")
            self.trace.entered_replay(pending, counts)
            pending = []
