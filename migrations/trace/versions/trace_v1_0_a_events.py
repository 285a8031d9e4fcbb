"""Trace baseline: events, their per-version token counts and their group lists.

Revision ID: trace_v1_0_a
Revises:
Create Date: 2026-11-30

Frozen: the tables are defined here as they were at this revision.
"""

import sqlalchemy as sa
from alembic import op

revision = "trace_v1_0_a"
down_revision = None
branch_labels = None
depends_on = None

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _tables() -> sa.MetaData:
    m = sa.MetaData(naming_convention=NAMING)
    C, I = sa.Column, sa.Integer
    sa.Table(
        "events", m,
        C("seq", I, primary_key=True, autoincrement=False),
        C("t", sa.Float, nullable=False),
        C("run_id", sa.String(36), nullable=False),
        C("event", sa.String(32), nullable=False),
        C("prompt_id", I),
        C("generation_index", I),
        C("group_id", I),
        C("attempt", I),
        C("step", I),
        C("policy_version", I),
        C("reason", sa.String(32)),
        C("fields", sa.Text),
        sa.Index("ix_events_event", "event"),
        sa.Index("ix_events_prompt_id_generation_index", "prompt_id", "generation_index"),
        sa.Index("ix_events_group_id", "group_id"),
    )
    sa.Table(
        "version_tokens", m,
        C("seq", I, sa.ForeignKey("events.seq"), primary_key=True),
        C("policy_version", I, primary_key=True),
        C("tokens", I, nullable=False),
    )
    sa.Table(
        "event_groups", m,
        C("seq", I, sa.ForeignKey("events.seq"), primary_key=True),
        C("group_id", I, primary_key=True),
    )
    return m


def upgrade() -> None:
    _tables().create_all(op.get_bind())


def downgrade() -> None:
    _tables().drop_all(op.get_bind())
