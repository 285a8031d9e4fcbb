"""Trace: `call_fallback`, a running call a snapshot's cut could not save (prefix level),
as a table of its own (trace_v1_1_a's scheme), and the `events` view rebuilt to show it.

Revision ID: trace_v1_3_a
Revises: trace_v1_2_a
Create Date: 2027-01-19

Why: at `rollout_recovery.target_level: prefix` a call the cut cannot continue from its
prefix (its episode runs on a `restart_only` agent server, its agent's export is at
another turn, an engine that cannot continue it exactly) falls back to the turn path,
and the trace says so per call, with the reason; `rolloutdb trace` counts them per stop.
The event names the call by the ledger's attempt id (`attempt_id`), its `turn` and a
`reason`: the shape both the cut (agent servers) and the engines (uncuttable settings)
write.

Data migration: none; every row of an older file stays as it is, the new table starts
empty. The downgrade refuses a file that holds any `call_fallback` event (trace_v1_2_a
has no place for it) rather than drop it.

Frozen: the table is defined here as it was at this revision.
"""

import sqlalchemy as sa
from alembic import op

revision = "trace_v1_3_a"
down_revision = "trace_v1_2_a"
branch_labels = None
depends_on = None

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
COMMON = ("prompt_id", "generation_index", "group_id", "attempt", "step", "policy_version", "reason")
_ATTEMPT = ("group_id", "prompt_id", "generation_index", "attempt", "step", "policy_version")
_GROUP = ("group_id", "prompt_id", "step", "policy_version")
# Every event at trace_v1_2_a, in its table's column order (list fields excluded): the
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
}
NEW_EVENT_FIELDS = {
    "call_fallback": ("attempt_id", "turn", "reason"),
}


def _tables() -> sa.MetaData:
    """The new table; `runs` only as the target of its foreign key."""
    m = sa.MetaData(naming_convention=NAMING)
    C, I = sa.Column, sa.Integer
    sa.Table("runs", m, C("run", I, primary_key=True, autoincrement=False))
    sa.Table(
        "call_fallback", m,
        C("seq", I, primary_key=True, autoincrement=False),
        C("t", sa.Float, nullable=False),
        C("run", I, sa.ForeignKey("runs.run"), nullable=False),
        C("attempt_id", I),
        C("turn", I),
        C("reason", sa.Text),
    )
    return m


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
    m = _tables()
    for name in NEW_EVENT_FIELDS:
        m.tables[name].create(bind)
    bind.exec_driver_sql("DROP VIEW events")
    bind.exec_driver_sql(_events_view({**OLD_EVENT_FIELDS, **NEW_EVENT_FIELDS}))


def downgrade() -> None:
    bind = op.get_bind()
    held = {name: bind.exec_driver_sql(f"SELECT count(*) FROM {name}").scalar() for name in NEW_EVENT_FIELDS}
    held = {name: n for name, n in held.items() if n}
    if held:
        raise RuntimeError(f"trace holds events that trace_v1_2_a has no table for ({held}); "
                           "keep it at trace_v1_3_a or later")
    bind.exec_driver_sql("DROP VIEW events")
    m = _tables()
    for name in NEW_EVENT_FIELDS:
        m.tables[name].drop(bind)
    bind.exec_driver_sql(_events_view(OLD_EVENT_FIELDS))
