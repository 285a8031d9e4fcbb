"""The single controller: builds the parts, restores once if resuming, then runs the
rollout pump and the snapshot pump beside the train pump.

Threads, not asyncio: the engine and the trainer are synchronous torch code whose
kernels release the GIL, and every store call is a short blocking SQLite transaction.
Threads overlap generation with training on two cores without wrapping everything in
executors; the pumps coordinate only through the store and `RuntimeState`.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rolloutdb.config import Config
from rolloutdb.controller.job import build
from rolloutdb.controller.tasks import registry
from rolloutdb.controller.recovery import resume as resuming
from rolloutdb.controller.run.dispatch import GroupHandle, LedgerDispatch, NoLedgerDispatch
from rolloutdb.controller.run.runtime import Progress, RolloutParts, RuntimeState
from rolloutdb.controller.rollout.pump import RolloutPump
from rolloutdb.controller.run.run_dir import RunDir, RunLock
from rolloutdb.controller.run.metrics_backends import open_metrics
from rolloutdb.controller.run.run_log import ProgressBar, plot_rewards, read_metrics, summary_line
from rolloutdb.controller.run.sampler import PromptOrder, StalenessBound
from rolloutdb.controller.recovery.snapshot_pump import SnapshotPump
from rolloutdb.controller.training.pump import TrainPump
from rolloutdb.controller.training.checkpoints import TrainerCheckpoints
from rolloutdb.controller.tasks.plugins import TaskPlugins
from rolloutdb.store import Chunk, SavedEpisode, Store, anchor_name, faults, keep_steps_for, open_tracer, segments_dir_of

if TYPE_CHECKING:  # aiohttp is imported only when a run has agent servers
    from rolloutdb.controller.agent_server.client import AgentPool


# A graceful stop right after a resume waits this long for the rollout pump to start the
# restored groups (its first commit, normally milliseconds; longer only when they do not
# all fit in generation.max_inflight_calls at once).
RESTARTED_WAIT_S = 2.0


@dataclass
class StopReport:
    """What a graceful stop (`Controller.request_shutdown`) did: `saved` says it in one line."""

    reason: str  # the signal's name
    step: int  # the trainer's step at the stop
    saved: str  # "rollout snapshot N (step_S) at step S", or "nothing new: why"
    snapshot: int | None  # the final snapshot's number, when it was published
    stop_s: float  # from the request (the signal) to the final snapshot published


@dataclass
class RunSummary:
    run_dir: Path
    steps: int
    line: str
    plot: Path | None
    wall_s: float
    stopped: StopReport | None = None  # a graceful stop; None: the run trained every step (or failed)


class Controller:
    """`resume`: None (a new run), "latest" or a snapshot directory; `start_over` (with
    "latest"): move the run's state aside and train it again from step 0. `lock` and
    `resume_plan`: taken and made by `rolloutdb train` before building this (the run
    lock and `resume.plan_resume`); taken and made here when not given."""

    def __init__(self, config: Config, run_dir: str | Path, *, resume: str | None = None, start_over: bool = False,
                 lock: RunLock | None = None, resume_plan: resuming.ResumePlan | None = None,
                 plugins: TaskPlugins | None = None):
        self.config = config
        self.dirs = RunDir(Path(run_dir))
        self.resume = "latest" if start_over and not resume else resume
        self.start_over = start_over
        self.lock = lock
        self.resume_plan = resume_plan
        self.plugins = plugins  # registry.check_plugins(config), when the caller checked already
        self.writing = False  # set once the run directory is about to change
        self.runtime = RuntimeState()
        self.restored: list[tuple[GroupHandle, list[int]]] = []
        # (group, generation) -> what turn- and prefix-level recovery restore
        self.saved_episodes: dict[tuple[int, int], SavedEpisode] = {}
        self.saved_prefixes: dict[tuple[int, int], list[Chunk]] = {}
        self.restored_cut: float | None = None  # the restored snapshot's cut time
        self.snapshotter: SnapshotPump | None = None
        self.agents: AgentPool | None = None  # with environment.servers
        self.stopped: StopReport | None = None
        self.rollout_pump: RolloutPump | None = None
        self.shutdown_asked_at: float | None = None  # time.monotonic() of request_shutdown

    def request_shutdown(self, reason: str) -> None:
        """Stop gracefully: no new group is handed out, the step in progress ends, a due or
        in-progress trainer checkpoint is published, a final rollout snapshot is taken, and
        `run` returns a summary whose `stopped` says what was saved. Called from a signal
        handler (`rolloutdb/commands/_graceful_stop.py`), so it sets one attribute and
        nothing else: no lock (the handler may have interrupted this very thread inside
        one), no I/O; the pumps poll it."""
        self.shutdown_asked_at = time.monotonic()
        self.runtime.shutdown = reason

    def saved_so_far(self) -> str:
        """What a stop right now leaves to resume from, in one line, from attributes only
        (a signal handler's last words before it exits at once)."""
        last = self.snapshotter.last_published if self.snapshotter is not None else None
        if last is not None:
            seq, anchor, step = last
            return f"rollout snapshot {seq} ({anchor}) at step {step}, the newest this process published"
        if self.restored_cut is not None:
            return "nothing new: no snapshot published since the one this resume restored"
        return "nothing new: no rollout snapshot published by this process"

    def _progress(self) -> Progress:
        return Progress(step=self.trainer.step, policy_version=self.engine.policy_version)

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Build the parts. A resume decides and restores before the logs are opened or
        a directory is made, so a refused resume writes nothing (`resume.py`)."""
        cfg = self.config
        done = None
        found = self.plugins or registry.check_plugins(cfg)
        if self.resume:
            self.resume_plan = self.resume_plan or resuming.plan_resume(self.dirs, self.resume, start_over=self.start_over)
        else:
            self.writing = True
            self.dirs.create()
            self.dirs.write_config(cfg)
        build.set_threads(cfg.cluster.torch_threads)
        policy_dir = build.build_policy(cfg, self.dirs.policy, found.dataset)
        self.dataset, self.env = registry.build_task(cfg, policy_dir, found)
        self.trainer = build.build_trainer(cfg, policy_dir)
        self.engine = build.build_engine(cfg, policy_dir)
        self.env_steps = build.build_env_stepper(cfg, self.env, policy_dir)
        self.publisher = build.build_publisher(cfg, self.dirs.checkpoints)
        if self.resume:
            parts = resuming.ResumeParts(config=cfg, dirs=self.dirs, resume=self.resume, plan=self.resume_plan,
                                         trainer=self.trainer, engine=self.engine, dataset=self.dataset)
            done = resuming.restore_run(parts, on_writing=self._writing_starts)
        self.writing = True
        self.dirs.create()
        attempt = self.dirs.record_attempt(cfg)  # config.yaml: what this attempt runs with
        # The step the resume restored: the steps after it are trained again, and the
        # dashboards drop what earlier attempts logged for them. A start-over moved the
        # old logs aside with the run, so it starts them afresh.
        resumed_at = done.step if done is not None and done.moved_to is None else None
        self.tracer = open_tracer(self.dirs.logs, enabled=cfg.trace.enabled)
        self.metrics = open_metrics(self.dirs.metrics, cfg.logging.backends, log_dir=self.dirs.logs,
                                    run_name=cfg.run.name or self.dirs.root.name, config=cfg.model_dump(),
                                    attempt=attempt, resumed_at=resumed_at)
        if done is not None and done.store is not None:
            self.store, self.restored = done.store, done.groups
            if done.restore_plan is not None:
                self.saved_episodes = done.restore_plan.saved_episodes
                self.saved_prefixes = done.restore_plan.saved_prefixes
                self.restored_cut = done.restore_plan.cut_time
        else:
            self.store = self.create_store()
        # Where the samples' sealed payload is read from, whether or not this run takes
        # snapshots (a store resumed with rollout_checkpointing off still references them).
        self.store.segments_dir = segments_dir_of(self.dirs.checkpoints)
        if done is not None:
            resuming.announce(done, metrics=self.metrics, tracer=self.tracer)
        self.agents = build.build_agents(cfg, self.engine, config_path=self.dirs.config, policy_dir=policy_dir,
                                         log_dir=self.dirs.logs, token_path=self.dirs.agent_token, log_event=self._log)
        env_checkpoint = build.build_env_checkpoint(cfg, self.agents)
        if self.agents is None:
            self._setup_pumps(env_checkpoint)
            return
        self.agents.start()
        # The agents the snapshot holds go back to their servers; if anything later in
        # setup fails, the scope takes them off again.
        with env_checkpoint.restore_scope(self._saved_agents()):
            self._setup_pumps(env_checkpoint)

    def _writing_starts(self) -> None:
        """The restore is about to change the run directory: a failure from now on is no refusal."""
        self.writing = True

    def _saved_agents(self) -> dict[str, dict]:
        """What the restored snapshot's env_episodes hold, keyed by the abandoned attempt's
        episode key, with the prompt id that routes each to its server."""
        prompts = {g.group_id: g.reservation.prompt_id for g, _ in self.restored}
        return {
            s.key: {"prompt_id": prompts[group_id], "turn": s.turn, "state": s.state, "token_ids": s.token_ids,
                    "logprobs": s.logprobs, "token_versions": s.token_versions}
            for (group_id, _), s in self.saved_episodes.items() if s.token_ids is not None and group_id in prompts
        }

    def _setup_pumps(self, env_checkpoint) -> None:
        cfg = self.config
        self.checkpoints = TrainerCheckpoints(cfg, self.trainer, self.publisher, log_event=self._log,
                                              on_published=self._wake_snapshots,
                                              on_written=self._wake_snapshots)
        self.checkpoints.publish_bootstrap()
        self.bar = ProgressBar(cfg.algorithm.total_steps, enabled=cfg.logging.progress, start_step=self.trainer.step)
        if cfg.ledger_dispatch:
            # the settled record keeps the steps a rewind to the oldest kept checkpoint needs
            dispatcher: LedgerDispatch | NoLedgerDispatch = LedgerDispatch(
                keep_steps_for(cfg.checkpointing.interval_steps, cfg.checkpointing.keep_last))
        else:
            with self.store.read() as conn:
                dispatcher = NoLedgerDispatch.resuming(conn)
        self.parts = RolloutParts(
            config=cfg,
            store=self.store,
            order=PromptOrder(len(self.dataset), cfg.run.seed),
            bound=StalenessBound(cfg.algorithm.max_staleness, cfg.algorithm.total_steps),
            engine=self.engine,
            env=self.env,
            trainer=self.trainer,
            dispatcher=dispatcher,
            runtime=self.runtime,
            read_progress=self._progress,
            log_event=self._log,
            tracer=self.tracer,
        )
        if cfg.rollout_checkpointing.enabled:
            self.snapshotter = SnapshotPump(
                self.parts,
                self.publisher,
                interval_s=cfg.rollout_checkpointing.interval_s,
                config_text=cfg.to_yaml(),
                env_checkpoint=env_checkpoint,
            )

    def create_store(self) -> Store:
        cfg = self.config
        return Store.create(
            self.dirs.store,
            config_fingerprint=cfg.fingerprint(),
            dataset_fingerprint=self.dataset.fingerprint(),
            ledger_dispatch=cfg.ledger_dispatch,
            replay_capacity=cfg.algorithm.replay_capacity,
            seed=cfg.run.seed,
        )

    def _log(self, event: dict) -> None:
        self.metrics.write(event)
        if event.get("kind") == "train_step":
            self.bar.update(event)

    def _step_done(self, step: int) -> None:
        """After a trainer checkpoint, a snapshot anchored to it: the train pump waits
        only until its cut is taken (the copy and fsyncs run on the snapshot pump), so
        no optimizer commit lands first and every durable step gets its snapshot unless
        the process dies in between. With `checkpointing.async` the checkpoint is only
        begun here (a copy of the state) and the cut is held until the checkpoint is
        published: by the snapshot pump once its write ends, or at a later boundary
        (`publish_if_written`, `poll`; training/checkpoints.py, snapshot_pump.py)."""
        self.checkpoints.poll()  # async: an earlier checkpoint whose write has ended
        if not self.checkpoints.maybe_publish(step):
            return
        if self.checkpoints.pending is not None:
            if self.snapshotter is not None:
                self.snapshotter.anchor_new_checkpoint(step, pending=self.checkpoints.pending)
            faults.point("train.after_checkpoint_copy")
        elif self.snapshotter is not None:
            faults.point("train.after_checkpoint")
            self.snapshotter.anchor_new_checkpoint(step)

    def _wake_snapshots(self) -> None:
        """An async checkpoint's write ended (on the Publisher's background thread) or it was
        published: the snapshot pump publishes it and the boundary's cut held for it now, not
        at its next interval or the next step boundary (up to a whole train step later)."""
        if self.snapshotter is not None:
            self.snapshotter.wake()

    # ------------------------------------------------------------------ run

    def run(self) -> RunSummary:
        t0 = time.time()
        own_lock = self.lock is None
        if own_lock:
            self.lock = self.dirs.lock(create=not self.resume)
        try:
            try:
                if own_lock:
                    self.dirs.check_for(resume=bool(self.resume))
                self.setup()
            except BaseException:
                if not self.writing:
                    self.lock.undo()  # a refusal: leave even the lock file as it was
                raise
            pump = RolloutPump(self.parts, self.restored, self.saved_episodes, self.saved_prefixes,
                               restored_cut=self.restored_cut, stepper=self.env_steps, agents=self.agents)
            self.rollout_pump = pump
            if self.snapshotter is not None and self.config.rollout_recovery.keeps_turns:
                self.snapshotter.flush_rollouts = pump.flush
                if self.config.rollout_recovery.target_level == "prefix":
                    self.snapshotter.uncommitted_calls = pump.uncommitted_calls
            threads = [threading.Thread(target=pump.run, name="rollout-pump", daemon=True)]
            if self.snapshotter is not None:
                # A fresh run's first snapshot before the rollout pump hands out a prompt: a
                # run killed from then on always has a snapshot to resume from, and one
                # killed earlier holds no work, so its resume may start over (resume.py).
                # Not after a restore: the snapshot restored is that point, and one cut now,
                # before the pump starts the restored attempts, would hold none of the turns
                # and prefixes they continue from (they are in the pump until then): a second
                # stop before the next snapshot would restore it and lose them all.
                if self.restored_cut is None:
                    self.snapshotter.attempt(force=True)
                if self.checkpoints.asynchronous:
                    self.snapshotter.publish_written_checkpoint = self.checkpoints.publish_if_written
                threads.append(threading.Thread(target=self.snapshotter.run, name="snapshot-pump", daemon=True))
            # Setup leaves ~440k long-lived objects (torch, transformers, SQLAlchemy,
            # Alembic); every full collection walked them all with every thread stopped,
            # 360-800 ms a time, and set the rollout pump's commit-window p99. Frozen, they
            # are never scanned again: full collections fell to 1-2 ms and committed calls/s
            # doubled (BENCHMARKS.md, group commit).
            gc.collect()
            gc.freeze()
            pumps_started = time.perf_counter()
            for t in threads:
                t.start()
            try:
                TrainPump(self.parts, on_step_done=self._step_done).run()
                stopping = self.runtime.shutdown is not None and self.trainer.step < self.config.algorithm.total_steps
                if stopping and not self.runtime.stop.is_set():
                    self.stopped = self._stop_gracefully(str(self.runtime.shutdown))
                elif not self.runtime.stop.is_set():
                    self.checkpoints.finish()  # async: the last checkpoint published
            except BaseException as e:
                self.runtime.fail(e)
            finally:
                self.runtime.stop.set()
                self.runtime.notify()
                if self.snapshotter is not None:
                    self.snapshotter.wake()
                for t in threads:
                    t.join(timeout=60)
                gc.unfreeze()  # a process that goes on (tests, your own loop) collects them again
                if self.snapshotter is not None and self.runtime.error is None:
                    self.snapshotter.publish_held()  # the last checkpoint's snapshot
                self.checkpoints.abandon()  # a failed run's unpublished checkpoint
                self._log_store_share(time.perf_counter() - pumps_started)
        finally:
            self.close()
            if own_lock:
                self.lock.release()
        if self.runtime.error is not None:
            raise self.runtime.error
        summary = self.finish(time.time() - t0)
        summary.stopped = self.stopped
        return summary

    def _stop_gracefully(self, reason: str) -> StopReport:
        """After the train pump ended at a shutdown request, with the rollout pump still
        running (it hands out nothing new, and commits what finishes, so the cut holds it)
        and the snapshot pump too: publish the trainer checkpoint the final snapshot anchors
        to, then take that snapshot, forced, on this thread (the train pump is stopped, so
        no optimizer commit can abort it). The grace budget is the signal handler's: past
        it the process exits wherever this is, with what is durable."""
        t0 = self.shutdown_asked_at if self.shutdown_asked_at is not None else time.monotonic()
        step = self.trainer.step
        durable = self.checkpoints.publish_at_stop(step, write=self.snapshotter is not None)
        anchor = anchor_name(step or None)
        if self.snapshotter is None:
            kept = f"trainer checkpoint {anchor} is durable" if durable else "no trainer checkpoint of this step"
            saved = f"nothing new: rollout_checkpointing.enabled is false ({kept})"
            report = StopReport(reason, step, saved, None, time.monotonic() - t0)
        elif not self._restored_groups_started():
            saved = ("nothing new: the groups this resume restored had not all restarted (a cut now would hold none of "
                     f"the turns they continue from); {self.saved_so_far()}")
            report = StopReport(reason, step, saved, None, time.monotonic() - t0)
        else:
            result = self.snapshotter.attempt(force=True)
            if result.outcome == "published" and result.sequence is not None:
                saved = f"rollout snapshot {result.sequence} ({result.anchor}) at step {step}"
            else:
                why = f"{result.outcome}: {result.error}" if result.error else result.outcome
                saved = f"nothing new: the final snapshot was {why}; {self.saved_so_far()}"
            report = StopReport(reason, step, saved, result.sequence if result.outcome == "published" else None,
                                time.monotonic() - t0)
        self.metrics.write({"kind": "shutdown", "t": time.time(), "reason": reason, "step": step, "saved": report.saved,
                            "snapshot": report.snapshot, "stop_s": report.stop_s})
        return report

    def _restored_groups_started(self) -> bool:
        """A stop soon after a resume: the rollout pump starts the restored groups in its
        first commits (it does so while stopping too); wait for that, within RESTARTED_WAIT_S,
        so the final cut holds the turns and prefixes they continue from (`run`)."""
        pump = self.rollout_pump
        deadline = time.monotonic() + RESTARTED_WAIT_S
        while pump is not None and not pump.restored_started and time.monotonic() < deadline:
            if self.runtime.stop.is_set():
                return False
            time.sleep(0.01)
        return pump is None or pump.restored_started

    def _log_store_share(self, pumps_wall_s: float) -> None:
        """How much of each pump's wall time went into store transactions."""
        clock = self.store.tx_time
        shares = {
            name: {
                "transactions": int(n),
                "store_s": round(sec, 4),
                "store_cpu_s": round(cpu, 4),
                "share": round(sec / pumps_wall_s, 5),
                "cpu_share": round(cpu / pumps_wall_s, 5),
            }
            for name, (n, sec, cpu) in clock.totals.items()
        }
        self.metrics.write({"kind": "store_share", "t": time.time(), "pumps_wall_s": pumps_wall_s, "threads": shares})

    def finish(self, wall_s: float) -> RunSummary:
        steps = read_metrics(self.dirs.metrics, "train_step")
        snapshots = read_metrics(self.dirs.metrics, "snapshot")  # every stop's: the metrics file is appended
        plot = plot_rewards(steps, self.dirs.plots / "reward_curve.png") if self.config.logging.plot and steps else None
        return RunSummary(self.dirs.root, len(steps), summary_line(steps, snapshots), plot, wall_s)

    def close(self) -> None:
        # The environment workers before the engine: the engine pool shuts its Ray cluster down.
        for name in ("env_steps", "engine", "agents", "bar", "publisher", "tracer", "metrics", "store"):
            part = getattr(self, name, None)
            if part is not None:
                part.close()
