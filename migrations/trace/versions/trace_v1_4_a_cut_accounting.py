"""Trace: the cut's decode point (`decoded_at` on `snapshot_cut` and `restore_done`) and
what each `call_fallback` cost (the attempt's fields and `tokens`), so that every token a
prefix-level cut had decoded is either kept or has a traced reason.

Revision ID: trace_v1_4_a
Revises: trace_v1_3_a
Create Date: 2027-02-02

Why: `rolloutdb trace` counts, per stop, the tokens the attempts running at it had
decoded by the restored cut and the tokens the resumed run kept. A cut reads the running
calls before its ledger read (its decode point, `decoded_at`): what a call decoded between
the two is not the cut's, and without the time the analysis counted it as lost. A
fallback names the call by the ledger's attempt id only and not what it cost; with the
attempt's (prompt_id, generation_index, attempt) and `tokens` the analysis joins it to
the stop's attempts and reports the tokens lost without a reason (0 when the accounting
holds).

Data migration: none; older rows get NULL in the new columns (the analysis then uses the
cut's own time as its decode point and counts their fallbacks as 0 tokens). The downgrade
refuses a file with any non-NULL value in them rather than drop it.

Frozen: the columns are defined here as they were at this revision.
"""

import sqlalchemy as sa
from alembic import op

revision = "trace_v1_4_a"
down_revision = "trace_v1_3_a"
branch_labels = None
depends_on = None

COMMON = ("prompt_id", "generation_index", "group_id", "attempt", "step", "policy_version", "reason")
_ATTEMPT = ("group_id", "prompt_id", "generation_index", "attempt", "step", "policy_version")
_GROUP = ("group_id", "prompt_id", "step", "policy_version")
# Every event at trace_v1_3_a, in its table's column order (list fields excluded): the
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
    "snapshot_cut": ("step", "policy_version", "cut_time", "snapshot_seq", "anchor", "snapshot", "groups_in_flight"),
    "restore_done": ("step", "policy_version", "cut_time", "snapshot_seq", "anchor", "snapshot", "groups_restored",
                     "replay_restored"),
    "call_finished": _ATTEMPT + ("turn", "tokens", "finish_reason"),
    "turn_committed": _ATTEMPT + ("turn", "tokens", "total_tokens"),
    "episode_restored": _ATTEMPT + ("from_attempt", "turn", "tokens", "total_tokens"),
    "call_fallback": ("attempt_id", "turn", "reason"),
}
# The columns this revision appends, per table, with their types.
NEW_COLUMNS = {
    "snapshot_cut": (("decoded_at", sa.Float),),
    "restore_done": (("decoded_at", sa.Float),),
    "call_fallback": tuple((c, sa.Integer) for c in _ATTEMPT + ("tokens",)),
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
        raise RuntimeError(f"trace holds values that trace_v1_3_a has no column for ({held}); "
                           "keep it at trace_v1_4_a or later")
    bind.exec_driver_sql("DROP VIEW events")
    for table, columns in NEW_COLUMNS.items():
        with op.batch_alter_table(table) as batch:
            for name, _kind in columns:
                batch.drop_column(name)
    bind.exec_driver_sql(_events_view(OLD_EVENT_FIELDS))
