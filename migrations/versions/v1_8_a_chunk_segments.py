"""A running call's prefix chunks are written once: token chunks may reference a segment.

Revision ID: v1_8_a
Revises: v1_7_a
Create Date: 2026-12-02

Until this revision every prefix-level snapshot wrote every running call's whole prefix
into its own ``token_chunks`` (BLOBs inline), so a cut cost the tokens decoded so far. From
here on a cut writes only the tokens each call decoded since the last published cut, once,
into an immutable segment file under ``CHECKPOINT_DIR/payload_segments/`` (the payload
segments' format and publication: store/checkpoints/segments.py), and a snapshot's
``token_chunks`` rows reference the chunks it needs, earlier cuts' included.

* ``token_chunks.segment_id``: nullable, references ``payload_segments`` (the snapshot
  file records each segment its chunks reference, as it does for samples, so its manifest
  lists and hashes it); ``segment_row``: the chunk's row in that segment's ``payload``
  table; ``token_ids`` becomes nullable. Either the chunk's bytes are inline
  (``segment_id`` and ``segment_row`` NULL, ``token_ids`` set) or in the segment (both
  set, both BLOBs NULL): two CHECK constraints.

No data moves: an upgraded file keeps its chunks inline and restores unchanged (the one
reader, ``pools.read_chunks``, takes either). Frozen: ``token_chunks`` is defined here as
it is at v1_7_a (batch mode rebuilds the table from it, not from the application's models).
"""

import sqlalchemy as sa
from alembic import op

revision = "v1_8_a"
down_revision = "v1_7_a"
branch_labels = None
depends_on = None

_TOKEN_CHUNKS_V1_7_A = sa.Table(
    "token_chunks", sa.MetaData(),
    sa.Column("chunk_id", sa.Integer, nullable=False),
    sa.Column("attempt_id", sa.Integer, nullable=False),
    sa.Column("chunk_index", sa.Integer, nullable=False),
    sa.Column("prefix_count", sa.Integer, nullable=False),
    sa.Column("token_ids", sa.LargeBinary, nullable=False),
    sa.Column("max_tokens", sa.Integer, nullable=False),
    sa.Column("min_tokens", sa.Integer, nullable=False),
    sa.Column("policy_version", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("logprobs", sa.LargeBinary, nullable=True),
    sa.PrimaryKeyConstraint("chunk_id", name="pk_token_chunks"),
    sa.UniqueConstraint("attempt_id", "chunk_index", name="uq_token_chunks_attempt_id_chunk_index"),
    # Its foreign key to rollouts (ON DELETE CASCADE) is created again in `upgrade`, after
    # the others: batch mode copies a table's constraints in set order, and a file's CREATE
    # statement must come out the same at every run (tests/fixtures/ compares them).
)


def upgrade() -> None:
    with op.batch_alter_table("token_chunks", copy_from=_TOKEN_CHUNKS_V1_7_A) as batch:
        batch.alter_column("token_ids", existing_type=sa.LargeBinary, nullable=True)
        batch.add_column(sa.Column("segment_id", sa.Integer, nullable=True))
        batch.add_column(sa.Column("segment_row", sa.Integer, nullable=True))
        batch.create_foreign_key("fk_token_chunks_attempt_id_rollouts", "rollouts", ["attempt_id"], ["attempt_id"],
                                 ondelete="CASCADE")
        batch.create_foreign_key("fk_token_chunks_segment_id_payload_segments", "payload_segments",
                                 ["segment_id"], ["segment_id"])
        batch.create_check_constraint("ck_token_chunks_chunk_inline_or_segment",
                                      "(segment_id IS NULL) = (token_ids IS NOT NULL)")
        batch.create_check_constraint("ck_token_chunks_chunk_row_with_segment",
                                      "(segment_id IS NULL) = (segment_row IS NULL)")


def downgrade() -> None:
    op.execute("DELETE FROM token_chunks WHERE segment_id IS NOT NULL")  # their bytes are not in the file
    with op.batch_alter_table("token_chunks") as batch:
        batch.drop_constraint("ck_token_chunks_chunk_row_with_segment", type_="check")
        batch.drop_constraint("ck_token_chunks_chunk_inline_or_segment", type_="check")
        batch.drop_constraint("fk_token_chunks_segment_id_payload_segments", type_="foreignkey")
        batch.drop_column("segment_row")
        batch.drop_column("segment_id")
        batch.alter_column("token_ids", existing_type=sa.LargeBinary, nullable=False)
