"""Two rollouts indexes fewer: ``ix_rollouts_group_id`` and ``ix_rollouts_state`` dropped.

Revision ID: v1_13_a
Revises: v1_12_a
Create Date: 2026-12-04

``rollouts`` had three secondary indexes: UNIQUE (``group_id``, ``generation_index``,
``attempt``), ``group_id`` alone and ``state``. The UNIQUE index's leading column serves
every look-up by group, so the index on ``group_id`` duplicated it; the one on ``state``
served only whole-table reads of the running attempts at a restore, over a table that
holds only what is in flight. Each cost every attempt's insert (and, for ``state``, every
finish and abandon) a B-tree write, and a snapshot its pages: 2.2 of the 7.3 MiB of a
snapshot with 80k attempts in flight. A partial index, ``ix_rollouts_abandoned`` (``state``
WHERE ``state = 'abandoned'``), keeps the one per-snapshot read of the abandoned attempts
a search: it holds a few rows. No data changes; downgrade puts the two back and drops it.
"""

import sqlalchemy as sa
from alembic import op

revision = "v1_13_a"
down_revision = "v1_12_a"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_rollouts_group_id", table_name="rollouts")
    op.drop_index("ix_rollouts_state", table_name="rollouts")
    op.create_index("ix_rollouts_abandoned", "rollouts", ["state"], sqlite_where=sa.text("state = 'abandoned'"))


def downgrade() -> None:
    op.drop_index("ix_rollouts_abandoned", table_name="rollouts")
    op.create_index("ix_rollouts_group_id", "rollouts", ["group_id"])
    op.create_index("ix_rollouts_state", "rollouts", ["state"])
