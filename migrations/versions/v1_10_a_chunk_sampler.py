"""Prefix chunks name the sampler that decoded them: an engine, its version, its scheme.

Revision ID: v1_10_a
Revises: v1_9_a
Create Date: 2026-12-03

A running call's prefix saved at a cut is continued after a restore, and its engine
reports the continuation bitwise-exact (token for token what the uninterrupted call would
have decoded) or distribution-exact (sampled from the same policy). Bitwise holds only
when the engine that continues samples exactly as the one that decoded the prefix did:
vLLM changed its sampling RNG within 2026, and another engine or version never
reproduces the uninterrupted call's draws. One nullable column:

* ``sampler`` TEXT: the identity of what decoded the chunk's tokens
  (``GenerationEngine.sampler_identity``: engine, version, sampling scheme, e.g.
  ``vllm/0.32.0/v1-per-request-generator``).

NULL: a chunk written before this revision, or a call whose output was decoded by more
than one sampler (continued across an engine change): never continued as bitwise.

Frozen: nothing here reads the application's models.
"""

import sqlalchemy as sa
from alembic import op

revision = "v1_10_a"
down_revision = "v1_9_a"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("token_chunks") as batch:
        batch.add_column(sa.Column("sampler", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("token_chunks") as batch:
        batch.drop_column("sampler")
