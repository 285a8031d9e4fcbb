"""Samples record how many tokens each policy version produced.

Revision ID: v1_1_a
Revises: v1_0_a
Create Date: 2026-11-29

Batch age weighs every token by the policy version that produced it; a call that runs
across a refit has tokens from two versions. v1_0_a kept only the version a call began
on, so existing rows are filled with all their tokens under that version, which is
exactly what v1_0_a's writer meant.

Frozen: the table is defined here as this revision needs it.
"""

import sqlalchemy as sa
from alembic import op

revision = "v1_1_a"
down_revision = "v1_0_a"
branch_labels = None
depends_on = None

samples = sa.table(
    "samples",
    sa.column("sample_id", sa.Integer),
    sa.column("num_tokens", sa.Integer),
    sa.column("policy_version", sa.Integer),
    sa.column("version_token_counts", sa.Text),
)


def upgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("version_token_counts", sa.Text, nullable=True))
    # Data migration: one run [[policy_version, num_tokens]] per existing sample.
    op.execute(
        samples.update().values(
            version_token_counts="[["
            + sa.cast(samples.c.policy_version, sa.Text)
            + ", "
            + sa.cast(samples.c.num_tokens, sa.Text)
            + "]]"
        )
    )
    with op.batch_alter_table("samples") as batch:
        batch.alter_column("version_token_counts", existing_type=sa.Text, nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("version_token_counts")
