"""No ``finalizer_results``: the table had no writer and no reader.

Revision ID: v1_7_a
Revises: v1_6_a
Create Date: 2026-12-02

``finalizer_results`` (v1_0_a) was to hold a per-group finalizer's output until the group
was trained. No code ever wrote it: GRPO computes its advantages from the samples when it
trains a batch (controller/training/grpo.py), so a group's finalized form is never stored,
and a copy of it in the store would be one more payload for every snapshot to carry and for
restore and invariant 3 to keep consistent. The table goes; a store or snapshot file that
holds rows in it (only tests and hand-made files can) loses them on upgrade, which nothing
reads.

The downgrade recreates the table empty, as v1_0_a defined it. Frozen: the table is
written out here as it is at v1_6_a.
"""

import sqlalchemy as sa
from alembic import op

revision = "v1_7_a"
down_revision = "v1_6_a"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_table("finalizer_results")


def downgrade() -> None:
    op.create_table(
        "finalizer_results",
        sa.Column("group_id", sa.Integer, nullable=False),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("group_id", name="pk_finalizer_results"),
    )
