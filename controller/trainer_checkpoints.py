"""Trainer checkpoints: `bootstrap/` before the first step and `step_<N>/` on the
configured interval, published through the store's one commit protocol under the save
lock (the Publisher's) that rollout snapshots take too."""

from __future__ import annotations

from pathlib import Path

from rolloutdb.config import Config
from rolloutdb.controller.protocols import Trainer
from rolloutdb.store import Publisher


class TrainerCheckpoints:
    """Publishes `bootstrap/` before the first step and `step_<N>/` every
    `checkpointing.interval_steps`, through the one commit protocol. Each publication
    holds the save lock (`Publisher.lock`, runtime.py's lock order) for its length, so it
    never lands inside a rollout snapshot attempt."""

    def __init__(self, config: Config, trainer: Trainer, publisher: Publisher):
        self.config = config.checkpointing
        self.trainer = trainer
        self.publisher = publisher

    def _write(self, tmp: Path) -> None:
        self.trainer.save_checkpoint(tmp)

    def publish_bootstrap(self) -> None:
        """Once per run directory: a resumed run keeps the bootstrap it has."""
        from rolloutdb.store import BOOTSTRAP, scan

        with self.publisher.lock:  # the look and the publication are one save
            if BOOTSTRAP not in scan(self.publisher.root).durable_anchor_names():
                self.publisher.publish_bootstrap(self._write)

    def maybe_publish(self, step: int) -> bool:
        if not self.config.enabled or step % self.config.interval_steps:
            return False
        self.publisher.publish_trainer_checkpoint(step, self._write)  # takes the save lock
        return True
