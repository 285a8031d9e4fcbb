"""Prefix chunks carry the logprob of each token: prefix-level recovery.

Revision ID: v1_3_a
Revises: v1_2_a
Create Date: 2026-12-01

At `rollout_recovery.target_level: prefix` every snapshot saves the tokens each running
call had decoded at its cut, and a resumed call continues from them. The resumed call's
output must be the uninterrupted call's: its prefix tokens keep the logprobs they were
sampled with, which the engine cannot recompute once the weights moved on (the engine
that resumes runs the anchor's weights; the prefix may come from an older version). One
nullable column:

* ``logprobs`` BLOB, float32 little-endian, one per token of the chunk.

A call's tokens from different policy versions are separate chunks (each chunk has one
``policy_version``), so versions need no new column. NULL: a chunk written before this
revision; the engine recomputes its logprobs from the prefill (exact when the resuming
weights are the ones that decoded it).

Frozen: nothing here reads the application's models.
"""

import sqlalchemy as sa
from alembic import op

revision = "v1_3_a"
down_revision = "v1_2_a"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("token_chunks") as batch:
        batch.add_column(sa.Column("logprobs", sa.LargeBinary, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("token_chunks") as batch:
        batch.drop_column("logprobs")
