"""A finished sample's payload is written once: immutable payload segment files.

Revision ID: v1_6_a
Revises: v1_5_a
Create Date: 2026-12-01

Until this revision every sample kept its token ids and logprobs inline, so every rollout
snapshot copied the whole in-flight payload again (BENCHMARKS.md, "Snapshots and restore": 1 GiB in flight, 5-6 s
of copy + hash + fsync per snapshot). From here on a snapshot first seals the inline
payload into a new segment file under ``CHECKPOINT_DIR/payload_segments/`` (written once,
never opened for writing again, store/checkpoints/segments.py) and points the samples at
it; the snapshot's store file then holds the references, not the payload.

* table ``payload_segments``: ``segment_id`` (AUTOINCREMENT: a number is never handed out
  again), ``file_name`` (unique), ``blake3`` (of the whole file, as the manifests list
  it), ``bytes``, ``rows``, ``created_at``.
* ``samples.segment_id``: nullable, references ``payload_segments``; ``token_ids`` and
  ``logprobs`` become nullable; ``sample_id`` becomes AUTOINCREMENT (never reused). Either the payload is inline (``segment_id`` NULL, both
  BLOBs set) or it is in the segment (both NULL): two CHECK constraints.

No data moves: an upgraded file keeps its payload inline, and its next snapshot seals it.
Frozen: the tables are defined here as they are at this revision (batch mode rebuilds
``samples`` from the definition below, not from the application's models). Kept apart
from the settled tables, so it chains after any revision that changes those.
"""

import sqlalchemy as sa
from alembic import op

revision = "v1_6_a"
down_revision = "v1_5_a"
branch_labels = None
depends_on = None

# `samples` as of v1_4_a (column order as the files have it: v1_1_a added
# version_token_counts last), the table batch mode copies from.
_SAMPLES_V1_4_A = sa.Table(
    "samples", sa.MetaData(),
    sa.Column("sample_id", sa.Integer, nullable=False),
    sa.Column("group_id", sa.Integer, nullable=False),
    sa.Column("generation_index", sa.Integer, nullable=False),
    sa.Column("prompt_id", sa.Integer, nullable=False),
    sa.Column("num_tokens", sa.Integer, nullable=False),
    sa.Column("token_ids", sa.LargeBinary, nullable=False),
    sa.Column("logprobs", sa.LargeBinary, nullable=False),
    sa.Column("reward", sa.Float, nullable=False),
    sa.Column("policy_version", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("version_token_counts", sa.Text, nullable=False),
    sa.PrimaryKeyConstraint("sample_id", name="pk_samples"),
    sa.UniqueConstraint("group_id", "generation_index", name="uq_samples_group_id_generation_index"),
)


def upgrade() -> None:
    op.create_table(
        "payload_segments",
        sa.Column("segment_id", sa.Integer, nullable=False),
        sa.Column("file_name", sa.String(64), nullable=False),
        sa.Column("blake3", sa.String(64), nullable=False),
        sa.Column("bytes", sa.Integer, nullable=False),
        sa.Column("rows", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.PrimaryKeyConstraint("segment_id", name="pk_payload_segments"),
        sa.UniqueConstraint("file_name", name="uq_payload_segments_file_name"),
        sqlite_autoincrement=True,
    )
    # AUTOINCREMENT: a sample id is never handed out again, so the ids a seal read still
    # name the same samples when it points them at the segment (schema.Sample).
    with op.batch_alter_table("samples", copy_from=_SAMPLES_V1_4_A, table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.alter_column("token_ids", existing_type=sa.LargeBinary, nullable=True)
        batch.alter_column("logprobs", existing_type=sa.LargeBinary, nullable=True)
        batch.add_column(sa.Column("segment_id", sa.Integer, nullable=True))
        batch.create_foreign_key("fk_samples_segment_id_payload_segments", "payload_segments",
                                 ["segment_id"], ["segment_id"])
        batch.create_check_constraint("ck_samples_payload_inline_or_segment", "(segment_id IS NULL) = (token_ids IS NOT NULL)")
        batch.create_check_constraint("ck_samples_payload_together", "(token_ids IS NULL) = (logprobs IS NULL)")
        batch.create_index("ix_samples_segment_id", ["segment_id"])


def downgrade() -> None:
    # Only an inline payload survives a downgrade: a file whose samples point at segments
    # cannot be read by an older rolloutdb (restore one of its older snapshots instead).
    bind = op.get_bind()
    if bind.exec_driver_sql("SELECT count(*) FROM samples WHERE segment_id IS NOT NULL").scalar_one():
        raise RuntimeError("samples reference payload segments; an older rolloutdb cannot read them")
    with op.batch_alter_table("samples") as batch:
        batch.drop_index("ix_samples_segment_id")
        batch.drop_constraint("ck_samples_payload_inline_or_segment", type_="check")
        batch.drop_constraint("ck_samples_payload_together", type_="check")
        batch.drop_constraint("fk_samples_segment_id_payload_segments", type_="foreignkey")
        batch.drop_column("segment_id")
        batch.alter_column("token_ids", existing_type=sa.LargeBinary, nullable=False)
        batch.alter_column("logprobs", existing_type=sa.LargeBinary, nullable=False)
    op.drop_table("payload_segments")
