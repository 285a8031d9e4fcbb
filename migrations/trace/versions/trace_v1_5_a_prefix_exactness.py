"""Trace: how exactly a call continued from a cut prefix continued (`prefix_exactness`
on `call_finished`: bitwise or distribution, as its engine reported; NULL for a call that
started from scratch).

Revision ID: trace_v1_5_a
Revises: trace_v1_4_a
Create Date: 2027-02-09

Why: `rollout_recovery.prefix_exactness` asks for distribution-exact continuations (the
reply is a sample of the policy) or bitwise-exact ones (token for token the
uninterrupted call). Which one each continued call got is what an analysis of a resumed
run needs to trust its replies: a fallback says why a call did not continue, this says
how one that did continued.

Data migration: none; older rows get NULL. The downgrade refuses a file with any
non-NULL value in the new column rather than drop it.

Frozen: the columns are defined here as they were at this revision.
"""

import sqlalchemy as sa
from alembic import op

revision = "trace_v1_5_a"
down_revision = "trace_v1_4_a"
branch_labels = None
depends_on = None

COMMON = ("prompt_id", "generation_index", "group_id", "attempt", "step", "policy_version", "reason")
_ATTEMPT = ("group_id", "prompt_id", "generation_index", "attempt", "step", "policy_version")
_GROUP = ("group_id", "prompt_id", "step", "policy_version")
# Every event at trace_v1_4_a, in its table's column order (list fields excluded): the
# `events` view reads them all.
OLD_EVENT_FIELDS = {
    "run_started": ("pid", "host"),
    "group_reserved": _GROUP + ("epoch", "group_size"),
    "attempt_dispatched": _ATTEMPT + ("prefix_tokens",),
    "call_cut": _ATTEMPT + ("tokens",),
    "attempt_abandoned": _ATTEMPT + ("reason", "tokens"),
    "rollout_finished": _ATTEMPT + ("tokens", "reward", "finish_reason"),
    "group_sealed": _GROUP + ("generations",),
    "group_published": _GROUP + ("tokens",),
    "group_discarded": _GROUP + ("reason",),
    "refit": ("step", "policy_version", "old_version", "new_version", "running"),
    "train_step": ("step", "policy_version", "batch_age", "tokens"),
    "snapshot_cut": ("step", "policy_version", "cut_time", "snapshot_seq", "anchor", "snapshot", "groups_in_flight",
                     "decoded_at"),
    "restore_done": ("step", "policy_version", "cut_time", "snapshot_seq", "anchor", "snapshot", "groups_restored",
                     "replay_restored", "decoded_at"),
    "call_finished": _ATTEMPT + ("turn", "tokens", "finish_reason"),
    "turn_committed": _ATTEMPT + ("turn", "tokens", "total_tokens"),
    "episode_restored": _ATTEMPT + ("from_attempt", "turn", "tokens", "total_tokens"),
    "call_fallback": ("attempt_id", "turn", "reason") + _ATTEMPT + ("tokens",),
}
# The columns this revision appends, per table, with their types.
NEW_COLUMNS = {
    "call_finished": (("prefix_exactness", sa.Text),),
}


def _with_new(fields: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    return {name: cols + tuple(c for c, _ in NEW_COLUMNS.get(name, ())) for name, cols in fields.items()}


def _events_view(event_fields: dict[str, tuple[str, ...]]) -> str:
    """Every event in one table with trace_v1_0_a's columns, for reading by eye (as
    trace_v1_1_a builds it, over the events given)."""
    parts = []
    for name, fields in event_fields.items():
        common = [f"e.{c}" if c in fields else f"NULL AS {c}" for c in COMMON]
        extra = [f for f in fields if f not in COMMON]
        json = ("json_object(" + ", ".join(f"'{f}', " + (f"json(e.{f})" if f == "running" else f"e.{f}") for f in extra)
                + ")") if extra else "NULL"
        parts.append(f"SELECT e.seq, e.t, r.run_id, '{name}' AS event, {', '.join(common)}, {json} AS fields "
                     f"FROM {name} e JOIN runs r ON r.run = e.run")
    return "CREATE VIEW events AS\n" + "\nUNION ALL\n".join(parts)


def upgrade() -> None:
    bind = op.get_bind()
    bind.exec_driver_sql("DROP VIEW events")
    for table, columns in NEW_COLUMNS.items():
        for name, kind in columns:
            op.add_column(table, sa.Column(name, kind()))
    bind.exec_driver_sql(_events_view(_with_new(OLD_EVENT_FIELDS)))


def downgrade() -> None:
    bind = op.get_bind()
    held = {}
    for table, columns in NEW_COLUMNS.items():
        n = bind.exec_driver_sql(
            f"SELECT count(*) FROM {table} WHERE " + " OR ".join(f"{c} IS NOT NULL" for c, _ in columns)).scalar()
        if n:
            held[table] = n
    if held:
        raise RuntimeError(f"trace holds values that trace_v1_4_a has no column for ({held}); "
                           "keep it at trace_v1_5_a or later")
    bind.exec_driver_sql("DROP VIEW events")
    for table, columns in NEW_COLUMNS.items():
        with op.batch_alter_table(table) as batch:
            for name, _kind in columns:
                batch.drop_column(name)
    bind.exec_driver_sql(_events_view(OLD_EVENT_FIELDS))
