"""Environment episodes carry their transcript so far: turn-level recovery.

Revision ID: v1_2_a
Revises: v1_1_a
Create Date: 2026-12-01

After every finished turn of a multi-turn episode the rollout pump saves the episode in
its next group-commit transaction; a resume continues the episode from that turn instead
of from the start, so it needs every token after the prompt so far (the policy's replies
and the environment's observations, in order), their logprobs and the policy version of
each token. Three nullable columns:

* ``token_ids`` BLOB, int32 little-endian;
* ``logprobs`` BLOB, float32 little-endian, 0.0 for environment tokens;
* ``version_token_counts`` TEXT, JSON runs ``[[version, count], ...]`` as samples have
  them, environment tokens under version -1.

NULL in all three: a row written before this revision, or by an environment that saves
only its state. Such an episode cannot be resumed at turn level (the pump restarts it),
so existing rows are left NULL: there is no transcript to fill them with.

Frozen: nothing here reads the application's models.
"""

import sqlalchemy as sa
from alembic import op

revision = "v1_2_a"
down_revision = "v1_1_a"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("env_episodes") as batch:
        batch.add_column(sa.Column("token_ids", sa.LargeBinary, nullable=True))
        batch.add_column(sa.Column("logprobs", sa.LargeBinary, nullable=True))
        batch.add_column(sa.Column("version_token_counts", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("env_episodes") as batch:
        batch.drop_column("version_token_counts")
        batch.drop_column("logprobs")
        batch.drop_column("token_ids")
