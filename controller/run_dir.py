"""The run directory: everything one run owns, in one place.

    RUN_DIR/
      config.yaml               the resolved config (after overrides)
      rollout_state.sqlite      the live store (WAL)
      policy/                   the initial policy (tiny Llama + tokenizer) when built here
      checkpoints/              bootstrap/, step_<N>/, rollout snapshots under them
      logs/metrics.jsonl        one JSON object per event (train steps, rollout waves)
      logs/rollout_trace.sqlite trace events, when rollout_checkpointing.trace is on
      plots/                    reward_curve.png and the trace report's plots
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rolloutdb.config import Config
from rolloutdb.store.fsio import replace_file, temp_path_beside


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def store(self) -> Path:
        return self.root / "rollout_state.sqlite"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def policy(self) -> Path:
        return self.root / "policy"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.logs / "metrics.jsonl"

    @property
    def trace(self) -> Path:
        return self.logs / "rollout_trace.sqlite"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    def has_run(self) -> bool:
        return self.store.exists()

    def create(self) -> None:
        for d in (self.root, self.checkpoints, self.logs, self.plots):
            d.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: Config) -> None:
        tmp = temp_path_beside(self.config, "write")
        tmp.write_text(config.to_yaml(), encoding="utf-8")
        replace_file(tmp, self.config)
