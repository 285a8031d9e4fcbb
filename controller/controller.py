"""The single controller: builds the parts, runs the rollout pump beside the train pump.

Threads, not asyncio: the engine and the trainer are synchronous torch code whose
kernels release the GIL, and every store call is a short blocking SQLite transaction.
Two threads (rollout pump, train pump) overlap generation with training on two cores
without wrapping everything in executors; they coordinate only through the store and
`RuntimeState`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rolloutdb.config import Config
from rolloutdb.controller import components
from rolloutdb.controller.dispatch import LedgerDispatch, NoLedgerDispatch
from rolloutdb.controller.parts import Progress, RolloutParts, RuntimeState
from rolloutdb.controller.rollout_pump import RolloutPump
from rolloutdb.controller.run_log import MetricsLog, ProgressBar, plot_rewards, read_metrics, summary_line
from rolloutdb.controller.run_dir import RunDir
from rolloutdb.controller.sampler import PromptOrder, StalenessBound
from rolloutdb.controller.train_pump import TrainPump
from rolloutdb.store import Store


@dataclass
class RunSummary:
    run_dir: Path
    steps: int
    line: str
    plot: Path | None
    wall_s: float


class Controller:
    def __init__(self, config: Config, run_dir: str | Path):
        self.config = config
        self.dirs = RunDir(Path(run_dir))
        self.runtime = RuntimeState()

    def _progress(self) -> Progress:
        return Progress(step=self.trainer.step, policy_version=self.engine.policy_version)

    def setup(self) -> None:
        cfg = self.config
        self.dirs.create()
        self.dirs.write_config(cfg)
        components.set_threads(cfg.cluster.torch_threads)
        policy_dir = components.build_policy(cfg, self.dirs.policy)
        self.dataset, self.env = components.build_task(cfg, policy_dir)
        self.trainer = components.build_trainer(cfg, policy_dir)
        self.engine = components.build_engine(cfg, policy_dir)
        self.store = Store.create(
            self.dirs.store,
            config_fingerprint=cfg.fingerprint(),
            dataset_fingerprint=self.dataset.fingerprint(),
            ledger_dispatch=cfg.ledger_dispatch,
            replay_capacity=cfg.algorithm.replay_capacity,
            seed=cfg.run.seed,
        )
        self.checkpoints = components.TrainerCheckpoints(cfg, self.dirs.checkpoints, self.trainer)
        self.checkpoints.publish_bootstrap()
        self.metrics = MetricsLog(self.dirs.metrics)
        self.bar = ProgressBar(cfg.algorithm.total_steps, enabled=cfg.logging.progress, start_step=self.trainer.step)
        dispatcher = LedgerDispatch() if cfg.ledger_dispatch else NoLedgerDispatch()
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
        )

    def _log(self, event: dict) -> None:
        self.metrics.write(event)
        if event.get("kind") == "train_step":
            self.bar.update(event)

    def _step_done(self, step: int) -> None:
        self.checkpoints.maybe_publish(step)

    def run(self) -> RunSummary:
        t0 = time.time()
        self.setup()
        rollout = RolloutPump(self.parts)
        thread = threading.Thread(target=rollout.run, name="rollout-pump", daemon=True)
        thread.start()
        try:
            TrainPump(self.parts, on_step_done=self._step_done).run()
        except BaseException as e:
            self.runtime.fail(e)
        finally:
            self.runtime.stop.set()
            self.runtime.notify()
            thread.join(timeout=60)
            self.close()
        if self.runtime.error is not None:
            raise self.runtime.error
        return self.finish(time.time() - t0)

    def finish(self, wall_s: float) -> RunSummary:
        steps = read_metrics(self.dirs.metrics, "train_step")
        plot = plot_rewards(steps, self.dirs.plots / "reward_curve.png") if self.config.logging.plot and steps else None
        return RunSummary(self.dirs.root, len(steps), summary_line(steps), plot, wall_s)

    def close(self) -> None:
        for closer in (getattr(self, "metrics", None), getattr(self, "store", None)):
            if closer is not None:
                closer.close()
