"""The settled record keeps the recent steps: old ``settled_steps`` rows fold into ``settled_prefix``.

Revision ID: v1_12_a
Revises: v1_11_a
Create Date: 2026-12-04

Until this revision ``settled_steps`` kept one row per train step for the whole run:
~27 bytes a step that every snapshot copied and every check decoded (~8 us a step of
Python per snapshot: 0.25 s a snapshot at 30k steps). From here on a train step's settle
folds the rows that lie wholly below the lowest live sampler position and are older than
the steps a resume could rewind to into one row of counts:

* table ``settled_prefix``, at most one row (``id`` 1): every position below
  ``seq_end`` settled exactly once; ``trained`` of them trained, ``discarded`` a JSON
  object reason -> count for the rest; ``through_step`` the latest train step folded
  (NULL: none), below which a resume from a trainer checkpoint alone cannot rewind.

No data migration: an upgraded file folds nothing until its run trains on. Downgrade
writes a folded prefix back as one ``settled_steps`` row: its positions stay settled
exactly once and its counts stay right, but which step trained each one and which were
discarded is gone (the first ``trained`` positions are written as trained at
``through_step``, the rest as discarded for their reasons in sorted order).

Frozen: the table and the blob's varint layout are written out here as they are at
this revision.
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "v1_12_a"
down_revision = "v1_11_a"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "settled_prefix",
        sa.Column("id", sa.Integer, nullable=False),
        sa.Column("seq_end", sa.Integer, nullable=False),
        sa.Column("trained", sa.Integer, nullable=False),
        sa.Column("discarded", sa.Text, nullable=False),
        sa.Column("through_step", sa.Integer, nullable=True),
        sa.CheckConstraint("id = 1", name="ck_settled_prefix_single_row"),
        sa.CheckConstraint("seq_end >= 0 AND trained >= 0 AND trained <= seq_end", name="ck_settled_prefix_counts"),
        sa.PrimaryKeyConstraint("id", name="pk_settled_prefix"),
    )


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def downgrade() -> None:
    bind = op.get_bind()
    row = bind.exec_driver_sql("SELECT seq_end, trained, discarded, through_step FROM settled_prefix").fetchone()
    if row is not None and row[0] > 0:
        seq_end, trained, discarded, through = row[0], row[1], json.loads(row[2]), row[3]
        codes = {reason: code for code, reason in bind.exec_driver_sql("SELECT code, reason FROM discard_reasons")}
        blob, gap = bytearray(), trained
        for reason in sorted(discarded):
            if not discarded[reason]:
                continue
            if reason not in codes:
                codes[reason] = max(codes.values(), default=0) + 1
                bind.exec_driver_sql("INSERT INTO discard_reasons (code, reason) VALUES (?, ?)", (codes[reason], reason))
            blob += _varint(gap) + _varint(discarded[reason]) + _varint(codes[reason])
            gap = 0
        step = (through if through is not None else 0) if trained else None
        bind.exec_driver_sql("INSERT INTO settled_steps (seq_start, seq_end, trained_step, target_step, others) "
                             "VALUES (0, ?, ?, NULL, ?)", (seq_end, step, bytes(blob) or None))
    op.drop_table("settled_prefix")
