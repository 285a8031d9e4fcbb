"""Baseline: the recovery ledger, payloads, replay, pools and run metadata.

Revision ID: v1_0_a
Revises:
Create Date: 2026-11-29

Frozen: the tables are defined here as they were at this revision.
"""

import sqlalchemy as sa
from alembic import op

revision = "v1_0_a"
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
GROUP_STATES = "'reserved', 'dispatched', 'sealed', 'published', 'trained', 'discarded'"
OUTCOMES = (
    "'published', 'skipped_unchanged', 'skipped_commit', 'skipped_not_durable', "
    "'aborted_commit', 'failed'"
)


def _tables() -> sa.MetaData:
    m = sa.MetaData(naming_convention=NAMING)
    C, I, F, S, T, B = sa.Column, sa.Integer, sa.Float, sa.String, sa.Text, sa.LargeBinary
    sa.Table(
        "run_meta", m,
        C("id", I, primary_key=True),
        C("run_id", S(64), nullable=False),
        C("created_at", F, nullable=False),
        C("config_fingerprint", S(64), nullable=False),
        C("dataset_fingerprint", S(64), nullable=False),
        C("forest_training", T, nullable=False),
        C("ledger_dispatch", I, nullable=False),
        C("replay_capacity", I, nullable=False),
        C("mutation_counter", I, nullable=False),
        sa.CheckConstraint("id = 1", name="single_row"),
    )
    sa.Table(
        "sampler_state", m,
        C("id", I, primary_key=True),
        C("next_seq", I, nullable=False),
        C("epoch", I, nullable=False),
        C("seed", I, nullable=False),
        C("stamping", S(16), nullable=False),
        sa.CheckConstraint("id = 1", name="single_row"),
        sa.CheckConstraint("stamping IN ('target_step', 'none')", name="stamping"),
    )
    sa.Table(
        "prompt_groups", m,
        C("group_id", I, primary_key=True),
        C("sample_seq", I, nullable=False, unique=True),
        C("epoch", I, nullable=False),
        C("prompt_id", I, nullable=False),
        C("num_generations", I, nullable=False),
        C("target_step", I),
        C("state", S(16), nullable=False, index=True),
        C("discard_reason", S(64)),
        C("policy_version", I),
        C("trained_step", I),
        C("created_at", F, nullable=False),
        C("updated_at", F, nullable=False),
        sa.UniqueConstraint("epoch", "prompt_id"),
        sa.CheckConstraint(f"state IN ({GROUP_STATES})", name="state"),
        sa.CheckConstraint(
            "(state = 'discarded') = (discard_reason IS NOT NULL)", name="discard_reason"
        ),
    )
    sa.Table(
        "rollouts", m,
        C("attempt_id", I, primary_key=True),
        C("group_id", I, sa.ForeignKey("prompt_groups.group_id", ondelete="CASCADE"),
          nullable=False, index=True),
        C("generation_index", I, nullable=False),
        C("attempt", I, nullable=False),
        C("state", S(16), nullable=False, index=True),
        C("abandon_reason", S(16)),
        C("policy_version", I, nullable=False),
        C("dispatched_at", F, nullable=False),
        C("ended_at", F),
        sa.UniqueConstraint("group_id", "generation_index", "attempt"),
        sa.CheckConstraint("state IN ('running', 'finished', 'abandoned')", name="state"),
        sa.CheckConstraint(
            "(state = 'abandoned') = (abandon_reason IS NOT NULL)", name="abandon_reason"
        ),
        sa.CheckConstraint(
            "abandon_reason IS NULL OR abandon_reason IN ('restart', 'deadline', 'error')",
            name="abandon_reason_known",
        ),
    )
    sa.Table(
        "token_chunks", m,
        C("chunk_id", I, primary_key=True),
        C("attempt_id", I, sa.ForeignKey("rollouts.attempt_id", ondelete="CASCADE"),
          nullable=False),
        C("chunk_index", I, nullable=False),
        C("prefix_count", I, nullable=False),
        C("token_ids", B, nullable=False),
        C("max_tokens", I, nullable=False),
        C("min_tokens", I, nullable=False),
        C("policy_version", I, nullable=False),
        C("created_at", F, nullable=False),
        sa.UniqueConstraint("attempt_id", "chunk_index"),
    )
    sa.Table(
        "samples", m,
        C("sample_id", I, primary_key=True),
        C("group_id", I, nullable=False),
        C("generation_index", I, nullable=False),
        C("prompt_id", I, nullable=False),
        C("num_tokens", I, nullable=False),
        C("token_ids", B, nullable=False),
        C("logprobs", B, nullable=False),
        C("reward", F, nullable=False),
        C("policy_version", I, nullable=False),
        C("created_at", F, nullable=False),
        sa.UniqueConstraint("group_id", "generation_index"),
    )
    sa.Table(
        "replay_groups", m,
        C("group_id", I, primary_key=True),
        C("permit", I, nullable=False, unique=True),
        C("epoch", I, nullable=False),
        C("prompt_id", I, nullable=False),
        C("target_step", I, index=True),
        C("num_tokens", I, nullable=False),
        C("published_at", F, nullable=False),
    )
    sa.Table(
        "finalizer_results", m,
        C("group_id", I, primary_key=True),
        C("payload", T, nullable=False),
        C("created_at", F, nullable=False),
    )
    sa.Table(
        "spare_prompts", m,
        C("sample_seq", I, primary_key=True),
        C("epoch", I, nullable=False),
        C("prompt_id", I, nullable=False),
        C("added_at", F, nullable=False),
        sa.UniqueConstraint("epoch", "prompt_id"),
    )
    sa.Table(
        "step_shortfall", m,
        C("step", I, primary_key=True),
        C("needed", I, nullable=False),
        sa.CheckConstraint("needed >= 0", name="needed_nonnegative"),
    )
    sa.Table(
        "env_episodes", m,
        C("episode_key", S(64), primary_key=True),
        C("attempt_id", I, sa.ForeignKey("rollouts.attempt_id", ondelete="CASCADE"),
          nullable=False, unique=True),
        C("turn", I, nullable=False),
        C("state", T, nullable=False),
        C("updated_at", F, nullable=False),
    )
    sa.Table(
        "snapshot_attempts", m,
        C("attempt_seq", I, primary_key=True),
        C("started_at", F, nullable=False),
        C("outcome", S(32), nullable=False),
        C("anchor", S(64)),
        C("snapshot_seq", I),
        C("mutation_counter", I, nullable=False),
        C("timings", T),
        C("error", T),
        sa.CheckConstraint(f"outcome IN ({OUTCOMES})", name="outcome"),
    )
    return m


def upgrade() -> None:
    _tables().create_all(bind=op.get_bind())


def downgrade() -> None:
    _tables().drop_all(bind=op.get_bind())
