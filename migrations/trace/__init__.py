"""Alembic migrations of the rolloutdb trace file (LOG_DIR/rollout_trace.sqlite).

A second script location beside the store's: the trace has its own schema and its own
revisions (``trace_v1_0_a``, ...), recorded in the trace file's ``alembic_version``.
Revisions are frozen like the store's: they define the tables they touch locally.
"""
