"""The train pump: for each step, wait for the groups stamped for it, train, release
their replay permits, refit the engine and publish trainer checkpoints.

The commit lock covers only the optimizer commit. A `StagedTrainer` computes step k
(forward, backward, gradient checks: `prepare_step`) holding no lock, and only
`commit_step` (the optimizer step and the step counter) and the store's `trained`
transaction for the batch run under the commit lock, so interval snapshots are cut
during the long part of a step and skipped (`skipped_commit`) only during the commit.
A cut taken during `prepare_step` is a consistent cut:
- the trainer's `step` is still k-1 and its weights are still version k-1's: the
  snapshot pump anchors the cut to `step_<k-1>` (and at the cut re-checks that the step
  has not moved, under the commit lock: a commit cannot fall inside a cut), a durable
  checkpoint holding exactly the weights, optimizer state and counter of the boundary
  before step k (a checkpoint is written only at a boundary, after a commit, on this
  thread; nothing prepare computes is in any checkpoint);
- the batch of step k is still in the replay buffer in the store as of the cut, not
  `trained`: the `trained` transaction commits with the optimizer step, under the lock;
- the engine still generates with version k-1 (the refit comes after the commit), so
  every sample in the cut was made by a version <= k-1, as at any cut anchored to
  `step_<k-1>`.
In short, nothing a cut reads changes between the end of commit k-1 and the start of
commit k: prepare only lengthens that interval, in which cuts were always taken (while
this pump waits for the batch of step k).
So a resume from that cut loads `step_<k-1>`, finds the same batch in replay for step
k, and trains it again from scratch: the work of the interrupted prepare is lost (it is
recomputed), and the batch is trained exactly once in the run's history: a cut sees it
`trained` only together with the trainer at step k (both change under the commit lock),
so only a cut anchored to `step_<k>`, whose weights hold that step, does. A kill
during the prepare (`train.prepared`, after the backward, before the commit) is the same
case: the resume restores a snapshot anchored at k-1 or earlier, in which the batch is
not `trained` (or not yet made: then it is generated again).
A trainer with only `train_step` cannot be split: its whole step runs under the lock.

Batch age is computed here from the samples' per-version token counts: for step k
(trained on policy version k-1) each policy token produced by version v is k-1-v
updates old. Environment tokens (version -1) are not the policy's and do not count.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
from rolloutdb.controller.rollout.episodes import ENV_TOKEN_VERSION
from rolloutdb.controller.run.runtime import RolloutParts
from rolloutdb.controller.protocols import Completion, NonFiniteTraining, StagedTrainer, TrainGroup
from rolloutdb.controller.run.tracing import TRACE_WAIT_S, RolloutTrace
from rolloutdb.store import faults, codec, queries

POLL_S = 0.5


def batch_age(step: int, version_runs: list[list[tuple[int, int]]]) -> float:
    """Token-weighted policy updates between generating each token and training on it."""
    trained_on = step - 1
    weighted = total = 0
    for runs in version_runs:
        for version, count in runs:
            if version == ENV_TOKEN_VERSION:
                continue
            weighted += (trained_on - version) * count
            total += count
    return weighted / total if total else 0.0


def _check_finite(step: int, metrics: dict[str, float]) -> None:
    """Any trainer's: a non-finite metric is never committed, refit or checkpointed."""
    broken = next(((k, v) for k, v in metrics.items() if not math.isfinite(float(v))), None)
    if broken is not None:
        raise NonFiniteTraining(step, f"the trainer's {broken[0]}", float(broken[1]),
                                "lower the learning rate and check the rewards and the model's weights")


class TrainPump:
    def __init__(
        self,
        parts: RolloutParts,
        *,
        on_step_done: Callable[[int], None] | None = None,
    ):
        self.p = parts
        self.trace = RolloutTrace(parts.tracer)
        self.on_step_done = on_step_done or (lambda step: None)
        trainer = parts.trainer
        self.staged: StagedTrainer | None = trainer if isinstance(trainer, StagedTrainer) else None

    def run(self) -> None:
        total = self.p.bound.total_steps
        rt = self.p.runtime
        while self.p.trainer.step < total and not rt.stop.is_set() and rt.shutdown is None:
            self.train_one(self.p.trainer.step + 1)

    def _wait_for_groups(self, step: int) -> list[int] | None:
        need = self.p.config.algorithm.groups_per_step
        rt = self.p.runtime
        while not rt.stop.is_set() and rt.shutdown is None:  # a graceful stop ends the wait, not a step
            with self.p.store.read() as conn:
                ids = queries.replay_groups_for_step(conn, step)
            if len(ids) >= need:
                return ids[:need]
            self.p.runtime.wait(POLL_S)
        return None

    def _load_groups(self, step: int, group_ids: list[int]) -> tuple[list[TrainGroup], dict]:
        rows = self.p.store.samples_of(group_ids)  # payload inline or from its segment
        groups: dict[int, TrainGroup] = {}
        runs_all, rewards, dispatch_versions = [], [], []
        prompts: dict[int, list[int]] = {}
        for gid, _i, pid, tok, lp, reward, vtc in rows:
            runs = codec.decode_version_counts(vtc)
            versions = [v for v, n in runs for _ in range(n)]
            logprobs = codec.decode_logprobs(lp)
            if not np.isfinite(logprobs).all():
                at = int(np.flatnonzero(~np.isfinite(logprobs))[0])
                raise NonFiniteTraining(step, f"the logprob the engine reported for token {at} of a sample of group "
                                        f"{gid} (policy version {versions[at] if at < len(versions) else '?'})",
                                        float(logprobs[at]), "the weights of that version give non-finite logits: "
                                        "lower the learning rate and check the model's weights")
            if pid not in prompts:
                prompts[pid] = list(self.p.env.start(pid)[0])  # start() is deterministic
            completion = Completion(
                prompt_ids=prompts[pid],
                token_ids=codec.decode_tokens(tok).tolist(),
                logprobs=logprobs.tolist(),
                token_versions=versions,
                reward=float(reward),
                loss_mask=[0 if v == ENV_TOKEN_VERSION else 1 for v in versions],
            )
            groups.setdefault(gid, TrainGroup(group_id=gid, prompt_id=pid, completions=[])).completions.append(completion)
            runs_all.append(runs)
            rewards.append(float(reward))
            policy = [v for v in versions if v != ENV_TOKEN_VERSION]
            if policy:
                dispatch_versions.append(policy[0])
        stats = {"runs": runs_all, "rewards": rewards, "first_versions": dispatch_versions}
        return [groups[g] for g in group_ids if g in groups], stats

    def train_one(self, step: int) -> None:
        ids = self._wait_for_groups(step)
        if ids is None:
            return
        t0 = time.time()
        groups, stats = self._load_groups(step, ids)
        if self.staged is not None:
            prepared = self.staged.prepare_step(groups)  # no lock: snapshots are cut meanwhile
            faults.point("train.prepared")
            with self.p.runtime.commit_lock:  # the optimizer commit: no snapshot cut inside
                metrics = self.staged.commit_step(prepared)
                _check_finite(step, metrics)
                with self.p.store.atomic() as tx:
                    self.p.dispatcher.trained(tx, ids, step=step)
        else:
            with self.p.runtime.commit_lock:  # the whole step: no snapshot cut inside
                metrics = self.p.trainer.train_step(groups)
                _check_finite(step, metrics)
                with self.p.store.atomic() as tx:
                    self.p.dispatcher.trained(tx, ids, step=step)
        faults.point("train.after_commit")
        running = {rid: len(toks) for rid, toks in self.p.engine.running_tokens().items()} if self.trace.enabled else {}
        self.p.engine.load_weights(self.p.trainer.export_weights(), step)
        self.trace.refit(step - 1, step, running)
        t1 = time.time()
        self.p.runtime.notify()
        age = batch_age(step, stats["runs"])
        staleness = [(step - 1) - v for v in stats["first_versions"]]
        tokens = sum(n for runs in stats["runs"] for v, n in runs if v != ENV_TOKEN_VERSION)
        self.trace.train_step(step, ids, age, tokens)
        # The metrics line waits for the trace to commit the step's event (a few ms, once a
        # step): a SIGKILL loses the trace's last milliseconds, and without the wait a step
        # could be logged as trained yet be missing from the trace the docs' batch-age SQL
        # reads (a fresh-clone CI run saw it). Past the wait it is logged all the same.
        self.trace.flush(TRACE_WAIT_S)
        self.p.log_event(
            {
                "kind": "train_step",
                "step": step,
                "t_start": t0,
                "t_end": t1,
                "reward_mean": float(np.mean(stats["rewards"])),
                "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
                "staleness_max": int(max(staleness)) if staleness else 0,
                "batch_age": age,
                "policy_tokens": int(tokens),
                "groups": len(ids),
                **{k: float(v) for k, v in metrics.items()},
            }
        )
        faults.point("train.after_step_logged")
        self.on_step_done(step)
