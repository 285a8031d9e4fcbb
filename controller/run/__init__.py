"""One run's own state, below both pumps: its directory and lock (`run_dir`), the state the
pumps coordinate by and the map of every thread and lock (`runtime`), the prompt order and
staleness bound (`sampler`), ledger or no-ledger dispatch (`dispatch`), what the pumps tell
the trace (`tracing`) and what a run shows a person (`run_log`, `metrics_backends`).

Nothing here runs a pump: every floor above (rollout, training, recovery, the job) reads
these parts, so they import only the controller's seams (`protocols`), the config and the
store."""
