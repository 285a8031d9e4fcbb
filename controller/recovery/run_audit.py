"""The run audit behind `rolloutdb verify RUN_DIR`: exactly-once over every stop a run
directory has been through.

The run directory is the controller's (`run_dir.RunDir` names its files), and so is the
config: it is read through `rolloutdb.config`, the same validation `rolloutdb train`
applies. The store does the counting over its own ledger (`audit_ledger`), given the
run's `groups_per_step`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from rolloutdb.config import ConfigError, load_config
from rolloutdb.controller.run.run_dir import RunDir
from rolloutdb.store import (LedgerAudit, NotAStoreError, RecordDamaged, audit_ledger, ledger,
                             store_segment_problems)


@dataclass
class RunVerdict(LedgerAudit):
    """`LedgerAudit` of one run directory (see there for what each count means)."""

    run_dir: Path | None = None


def run_groups_per_step(config_path: Path) -> int:
    """`algorithm.groups_per_step` of the run's config, validated as `train` would."""
    if not config_path.exists():
        raise NotAStoreError(f"{config_path}: missing; `rolloutdb verify RUN_DIR` needs the run's config.yaml")
    try:
        return load_config(config_path).algorithm.groups_per_step
    except ConfigError as e:
        raise NotAStoreError(f"{config_path}: not a valid run config ({e}); restore the run's config.yaml") from None


def verify_run(run_dir: str | Path, *, algorithm_reasons: frozenset[str] = ledger.ALGORITHM_DISCARD_REASONS) -> RunVerdict:
    """Read RUN_DIR/config.yaml, then audit RUN_DIR/rollout_state.sqlite read-only (no
    side files created). `algorithm_reasons`: the discard reasons that settle a group."""
    dirs = RunDir(Path(run_dir))
    groups_per_step = run_groups_per_step(dirs.config)
    try:
        audit = audit_ledger(dirs.store, groups_per_step=groups_per_step, algorithm_reasons=algorithm_reasons)
    except RecordDamaged as e:  # a forged settled record: nothing can be counted over it
        raise NotAStoreError(f"{dirs.store}: {e}") from None
    # The payload the live store keeps in segments: each one it references, read whole
    # and checked against the size and BLAKE3 recorded when it was sealed.
    audit.problems.extend(store_segment_problems(dirs.store, dirs.checkpoints))
    fields = {f.name: getattr(audit, f.name) for f in dataclasses.fields(audit)}
    return RunVerdict(**fields, run_dir=dirs.root)
