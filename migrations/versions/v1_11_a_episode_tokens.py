"""A turn's save appends its tokens: episode transcripts move to ``episode_tokens``.

Revision ID: v1_11_a
Revises: v1_10_a
Create Date: 2026-12-04

Until this revision an episode's transcript (every token after the prompt so far) lived
in its ``env_episodes`` row, and every turn's save rewrote the row whole: O(tokens so
far) per turn, 8 bytes a token (256 KB a turn at 32k tokens; a row with its BLOBs in
overflow pages is rewritten page by page even when only ``turn`` changes). From here on:

* table ``episode_tokens``: primary key (``attempt_id``, ``first_token``), a piece of
  the transcript of the episode of ``attempt_id`` (foreign key to
  ``env_episodes.attempt_id``, ON DELETE CASCADE) from token ``first_token`` on:
  ``token_ids`` int32 LE, ``logprobs`` float32 LE, ``version_token_counts`` JSON runs,
  one entry per token in all three; a save appends the tokens the episode added;
* ``env_episodes``: ``token_ids``, ``logprobs``, ``version_token_counts`` dropped;
  ``transcript_tokens`` INTEGER added, how many tokens the pieces hold (NULL: no
  transcript, the episode saves only its state).

Data migration: a row whose three transcript columns are all set becomes one piece at
``first_token`` 0 and ``transcript_tokens`` = its token count (an empty transcript: no
piece, 0); a row with any of them NULL has no transcript (NULL), as readers treated it.
Downgrade joins each episode's pieces back into its row.

Frozen: the tables are written out here as they are at this revision.
"""

import json
import sqlite3

import sqlalchemy as sa
from alembic import op

revision = "v1_11_a"
down_revision = "v1_10_a"
branch_labels = None
depends_on = None

TOKEN_BYTES = 4  # int32 token ids
TRANSCRIPT_COLUMNS = ("token_ids", "logprobs", "version_token_counts")

# `env_episodes` as of v1_10_a (column order as the files have it: v1_2_a added the
# transcript last), the table batch mode copies from: a reflected copy orders its
# constraints differently from run to run.
_EPISODES_V1_10_A = sa.Table(
    "env_episodes", sa.MetaData(),
    sa.Column("episode_key", sa.String(64), nullable=False),
    sa.Column("attempt_id", sa.Integer, nullable=False),
    sa.Column("turn", sa.Integer, nullable=False),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("token_ids", sa.LargeBinary, nullable=True),
    sa.Column("logprobs", sa.LargeBinary, nullable=True),
    sa.Column("version_token_counts", sa.Text, nullable=True),
    sa.Column("transcript_tokens", sa.Integer, nullable=True),  # added first by upgrade()
    sa.PrimaryKeyConstraint("episode_key", name="pk_env_episodes"),
    sa.UniqueConstraint("attempt_id", name="uq_env_episodes_attempt_id"),
    sa.ForeignKeyConstraint(["attempt_id"], ["rollouts.attempt_id"], ondelete="CASCADE",
                            name="fk_env_episodes_attempt_id_rollouts"),
)


def upgrade() -> None:
    op.create_table(
        "episode_tokens",
        sa.Column("attempt_id", sa.Integer, nullable=False),
        sa.Column("first_token", sa.Integer, nullable=False),
        sa.Column("token_ids", sa.LargeBinary, nullable=False),
        sa.Column("logprobs", sa.LargeBinary, nullable=False),
        sa.Column("version_token_counts", sa.Text, nullable=False),
        sa.CheckConstraint("first_token >= 0", name="ck_episode_tokens_piece_offset"),
        sa.ForeignKeyConstraint(["attempt_id"], ["env_episodes.attempt_id"], ondelete="CASCADE",
                                name="fk_episode_tokens_attempt_id_env_episodes"),
        sa.PrimaryKeyConstraint("attempt_id", "first_token", name="pk_episode_tokens"),
    )
    whole = "token_ids IS NOT NULL AND logprobs IS NOT NULL AND version_token_counts IS NOT NULL"
    op.execute("INSERT INTO episode_tokens (attempt_id, first_token, token_ids, logprobs, version_token_counts) "
               f"SELECT attempt_id, 0, token_ids, logprobs, version_token_counts FROM env_episodes "
               f"WHERE {whole} AND length(token_ids) > 0")
    op.add_column("env_episodes", sa.Column("transcript_tokens", sa.Integer, nullable=True))
    op.execute(f"UPDATE env_episodes SET transcript_tokens = length(token_ids) / {TOKEN_BYTES} WHERE {whole}")
    if sqlite3.sqlite_version_info >= (3, 35, 0):
        # SQLite drops a plain column in place, editing the table's DDL text: no copy of
        # the table, and the same DDL every time (a batch copy orders the constraints as
        # a set iterates, and the fixture test compares the DDL text).
        for column in TRANSCRIPT_COLUMNS:
            op.execute(f"ALTER TABLE env_episodes DROP COLUMN {column}")
    else:
        with op.batch_alter_table("env_episodes", copy_from=_EPISODES_V1_10_A) as batch:
            for column in TRANSCRIPT_COLUMNS:
                batch.drop_column(column)


def _joined(pieces: list[tuple[bytes, bytes, str]]) -> tuple[bytes, bytes, str]:
    runs: list[list[int]] = []
    for _, _, counts in pieces:
        for version, n in json.loads(counts):
            if runs and runs[-1][0] == version:
                runs[-1][1] += n
            else:
                runs.append([version, n])
    return b"".join(p[0] for p in pieces), b"".join(p[1] for p in pieces), json.dumps(runs)


def downgrade() -> None:
    op.add_column("env_episodes", sa.Column("token_ids", sa.LargeBinary, nullable=True))
    op.add_column("env_episodes", sa.Column("logprobs", sa.LargeBinary, nullable=True))
    op.add_column("env_episodes", sa.Column("version_token_counts", sa.Text, nullable=True))
    bind = op.get_bind()
    pieces: dict[int, list[tuple[bytes, bytes, str]]] = {}
    for attempt_id, tokens, logprobs, counts in bind.exec_driver_sql(
            "SELECT attempt_id, token_ids, logprobs, version_token_counts FROM episode_tokens "
            "ORDER BY attempt_id, first_token"):
        pieces.setdefault(attempt_id, []).append((tokens, logprobs, counts))
    for attempt_id, n in bind.exec_driver_sql(
            "SELECT attempt_id, transcript_tokens FROM env_episodes WHERE transcript_tokens IS NOT NULL").all():
        joined = _joined(pieces.get(attempt_id, []))
        if len(joined[0]) // TOKEN_BYTES != n:
            continue  # pieces that do not add up: no transcript (readers restart such an episode)
        bind.exec_driver_sql("UPDATE env_episodes SET token_ids = ?, logprobs = ?, version_token_counts = ? "
                             "WHERE attempt_id = ?", (*joined, attempt_id))
    op.drop_table("episode_tokens")
    if sqlite3.sqlite_version_info >= (3, 35, 0):
        op.execute("ALTER TABLE env_episodes DROP COLUMN transcript_tokens")
    else:
        with op.batch_alter_table("env_episodes") as batch:
            batch.drop_column("transcript_tokens")
