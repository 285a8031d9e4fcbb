"""The rollout side: episodes advancing turn by turn against the engine, the environment's
steps (in the driver or on Ray workers), and finished calls and groups reaching the store
in group-commit batches.

`pump` is the rollout pump's loop; `calls` handles one model call from submit to the
episode's next turn; `group_commit` batches what finished into one transaction (a cut);
`episodes` and `live_episode` are one episode's state machine and what the pump keeps
beside it; `env_steps` is the stepper seam and `ray_environments` its Ray backend."""
