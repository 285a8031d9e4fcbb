"""Stopping and starting without losing work: the snapshot pump (`snapshot_pump`) cuts and
publishes rollout snapshots (with the environment's side, `env_checkpoint`), `resume`
decides and performs a restart from the newest usable anchor, and `run_audit` proves
exactly-once over every stop a run directory has been through (`rolloutdb verify`)."""
