"""Trace: one table per event type with a typed column per field, a `runs` table, and a
view `events` in the shape of trace_v1_0_a.

Revision ID: trace_v1_1_a
Revises: trace_v1_0_a
Create Date: 2026-11-30

Why: an analysis that reads one 12-column `events` table must scan every event, the
per-call flood (attempt_dispatched, rollout_finished) included, and every column, to
find the few event types a figure needs; DuckDB's SQLite scanner pushes no filter down.
With a table per event type it reads only those tables, and only their columns.
`runs` holds each run's first and last event time (kept by the writer), so run spans no
longer need a scan of every event; a run is a small integer `run` on every row instead of
its 32-character run_id. List fields move to tables of their own per event.

Data migration: every event of an old file moves to its type's table, fields taken out
of the JSON; an event name this revision does not know stops the upgrade.

Frozen: the tables are defined here as they were at this revision.
"""

import sqlalchemy as sa
from alembic import op

revision = "trace_v1_1_a"
down_revision = "trace_v1_0_a"
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
EVENT_FIELDS = {
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
}
FLOAT = {"reward", "batch_age", "cut_time"}
TEXT = {"reason", "host", "finish_reason", "anchor", "snapshot", "running"}
# (event, old table) -> new table, its value columns
LISTS = {
    ("rollout_finished", "version_tokens"): ("finished_tokens", ("policy_version", "tokens")),
    ("group_published", "version_tokens"): ("published_tokens", ("policy_version", "tokens")),
    ("train_step", "event_groups"): ("trained_groups", ("group_id",)),
}
INDEXES = {
    "group_reserved": ("prompt_id",),
    "group_sealed": ("prompt_id",),
    "group_discarded": ("prompt_id",),
    "group_published": ("group_id",),
    "attempt_dispatched": ("prompt_id", "generation_index", "attempt"),
}


def _type(field):
    return sa.Float if field in FLOAT else sa.Text if field in TEXT else sa.Integer


def _tables() -> sa.MetaData:
    m = sa.MetaData(naming_convention=NAMING)
    C, I = sa.Column, sa.Integer
    sa.Table(
        "runs", m,
        C("run", I, primary_key=True, autoincrement=False),
        C("run_id", sa.String(36), nullable=False, unique=True),
        C("pid", I),
        C("host", sa.String(255)),
        C("first_t", sa.Float, nullable=False),
        C("last_t", sa.Float, nullable=False),
        C("last_seq", I, nullable=False),
    )
    for name, fields in EVENT_FIELDS.items():
        sa.Table(
            name, m,
            C("seq", I, primary_key=True, autoincrement=False),
            C("t", sa.Float, nullable=False),
            C("run", I, sa.ForeignKey("runs.run"), nullable=False),
            *(C(f, _type(f)) for f in fields),
            *([sa.Index(f"ix_{name}_{'_'.join(INDEXES[name])}", *INDEXES[name])] if name in INDEXES else []),
        )
    for (event, _old), (table, cols) in LISTS.items():
        sa.Table(
            table, m,
            C("seq", I, sa.ForeignKey(f"{event}.seq"), primary_key=True),
            *(C(c, I, primary_key=True) if i == 0 else C(c, I, nullable=False) for i, c in enumerate(cols)),
        )
    return m


def _events_view() -> str:
    """Every event in one table with trace_v1_0_a's columns, for reading by eye."""
    parts = []
    for name, fields in EVENT_FIELDS.items():
        common = [f"e.{c}" if c in fields else f"NULL AS {c}" for c in COMMON]
        extra = [f for f in fields if f not in COMMON]
        json = ("json_object(" + ", ".join(f"'{f}', " + (f"json(e.{f})" if f == "running" else f"e.{f}") for f in extra)
                + ")") if extra else "NULL"
        parts.append(f"SELECT e.seq, e.t, r.run_id, '{name}' AS event, {', '.join(common)}, {json} AS fields "
                     f"FROM {name} e JOIN runs r ON r.run = e.run")
    return "CREATE VIEW events AS\n" + "\nUNION ALL\n".join(parts)


def upgrade() -> None:
    bind = op.get_bind()
    known = ", ".join(f"'{n}'" for n in EVENT_FIELDS)
    unknown = bind.exec_driver_sql(f"SELECT DISTINCT event FROM events WHERE event NOT IN ({known})").scalars().all()
    if unknown:
        raise RuntimeError(f"trace has events this revision does not know: {sorted(unknown)}")
    m = _tables()
    m.create_all(bind)
    bind.exec_driver_sql(
        "INSERT INTO runs (run, run_id, pid, host, first_t, last_t, last_seq) "
        "SELECT row_number() OVER (ORDER BY min(t), run_id), run_id, "
        "  (SELECT CAST(json_extract(s.fields, '$.pid') AS INTEGER) FROM events s "
        "   WHERE s.run_id = e.run_id AND s.event = 'run_started' ORDER BY s.seq LIMIT 1), "
        "  (SELECT json_extract(s.fields, '$.host') FROM events s "
        "   WHERE s.run_id = e.run_id AND s.event = 'run_started' ORDER BY s.seq LIMIT 1), "
        "  min(t), max(t), max(seq) "
        "FROM events e GROUP BY run_id"
    )
    for name, fields in EVENT_FIELDS.items():
        values = [f"e.{f}" if f in COMMON else
                  f"json_extract(e.fields, '$.{f}')" if f != "running" else f"json_extract(e.fields, '$.running')"
                  for f in fields]
        bind.exec_driver_sql(
            f"INSERT INTO {name} (seq, t, run{''.join(', ' + f for f in fields)}) "
            f"SELECT e.seq, e.t, r.run{''.join(', ' + v for v in values)} "
            f"FROM events e JOIN runs r ON r.run_id = e.run_id WHERE e.event = '{name}'"
        )
    for (event, old), (table, cols) in LISTS.items():
        bind.exec_driver_sql(
            f"INSERT INTO {table} (seq, {', '.join(cols)}) SELECT x.seq, {', '.join('x.' + c for c in cols)} "
            f"FROM {old} x JOIN events e ON e.seq = x.seq WHERE e.event = '{event}'"
        )
    for old in ("version_tokens", "event_groups", "events"):
        op.drop_table(old)
    bind.exec_driver_sql(_events_view())


def downgrade() -> None:
    bind = op.get_bind()
    bind.exec_driver_sql("CREATE TABLE events_v1_0 AS SELECT * FROM events")
    bind.exec_driver_sql("DROP VIEW events")
    old = sa.MetaData(naming_convention=NAMING)
    C, I = sa.Column, sa.Integer
    sa.Table(
        "events", old,
        C("seq", I, primary_key=True, autoincrement=False), C("t", sa.Float, nullable=False),
        C("run_id", sa.String(36), nullable=False), C("event", sa.String(32), nullable=False),
        *(C(c, sa.String(32) if c == "reason" else I) for c in COMMON), C("fields", sa.Text),
        sa.Index("ix_events_event", "event"),
        sa.Index("ix_events_prompt_id_generation_index", "prompt_id", "generation_index"),
        sa.Index("ix_events_group_id", "group_id"),
    )
    sa.Table("version_tokens", old, C("seq", I, sa.ForeignKey("events.seq"), primary_key=True),
             C("policy_version", I, primary_key=True), C("tokens", I, nullable=False))
    sa.Table("event_groups", old, C("seq", I, sa.ForeignKey("events.seq"), primary_key=True),
             C("group_id", I, primary_key=True))
    new = _tables()
    old.create_all(bind)
    bind.exec_driver_sql("INSERT INTO events SELECT * FROM events_v1_0")
    bind.exec_driver_sql("INSERT INTO version_tokens SELECT seq, policy_version, tokens FROM finished_tokens "
                         "UNION ALL SELECT seq, policy_version, tokens FROM published_tokens")
    bind.exec_driver_sql("INSERT INTO event_groups SELECT seq, group_id FROM trained_groups")
    bind.exec_driver_sql("DROP TABLE events_v1_0")
    new.drop_all(bind)
