"""The schema at head, as SQLAlchemy 2 typed models.

These classes *define* the schema and serve inspection; the pumps' hot paths use the
`Table` objects behind them through SQLAlchemy Core (see `ledger.py`). Files are never
created from this metadata: they are created by running the Alembic migrations, and
`tests/test_migrations.py` checks that the migrated schema equals this metadata.

Payloads (token ids, logprobs) are BLOBs of a fixed little-endian dtype (see
`codec.py`); nothing here is ever pickled.
"""

from __future__ import annotations

from sqlalchemy import (
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ..sqlite.revision import NAMING

# Group states, in the order a group moves through them. `discarded` is terminal too.
GROUP_STATES = ("reserved", "dispatched", "sealed", "published", "trained", "discarded")
ROLLOUT_STATES = ("running", "finished", "abandoned")
ABANDON_REASONS = ("restart", "deadline", "error")
SNAPSHOT_OUTCOMES = (
    "published",
    "skipped_unchanged",
    "skipped_commit",
    "skipped_not_durable",
    "aborted_commit",
    "failed",
)
# Prompt ids per `settled_prompts` row: 512 bytes of bits, so a settle rewrites at most one
# page-sized row of its epoch's bitmap however large the dataset (revision v1_9_a).
PROMPT_CHUNK = 4096



def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class RunMeta(Base):
    """One row: who this store belongs to and the settings a restore must match."""

    __tablename__ = "run_meta"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)
    config_fingerprint: Mapped[str] = mapped_column(String(64))
    dataset_fingerprint: Mapped[str] = mapped_column(String(64))
    # Forest (tree-shaped) rollout settings, a JSON object. This version has none and
    # writes {} ("off"); the column lets a version with forest training land without a
    # migration, and a restore refuses a file whose settings differ from the run's
    # (README, "Only sound checkpoints of this run").
    forest_training: Mapped[str] = mapped_column(Text)
    ledger_dispatch: Mapped[int] = mapped_column(Integer)
    replay_capacity: Mapped[int] = mapped_column(Integer)
    # Bumped by every mutation (write transaction); the snapshot pump compares it to skip
    # a cut when nothing changed.
    mutation_counter: Mapped[int] = mapped_column(Integer)


class SamplerState(Base):
    """One row: the dataloader cursor. Every prompt handed out has a `sample_seq` below
    `next_seq`, which is what invariant 4 (cursor covers restored work) checks."""

    __tablename__ = "sampler_state"
    __table_args__ = (
        CheckConstraint("id = 1", name="single_row"),
        CheckConstraint(_in("stamping", ("target_step", "none")), name="stamping"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    next_seq: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(Integer)
    stamping: Mapped[str] = mapped_column(String(16))


class PromptGroup(Base):
    """The recovery ledger: one row per prompt group the sampler handed out."""

    __tablename__ = "prompt_groups"
    __table_args__ = (
        UniqueConstraint("epoch", "prompt_id"),
        CheckConstraint(_in("state", GROUP_STATES), name="state"),
        CheckConstraint(
            "(state = 'discarded') = (discard_reason IS NOT NULL)", name="discard_reason"
        ),
        Index(None, "state"),
        # Ids are never handed out twice (revision v1_4_a): settled rows are deleted
        # (compaction.py) and the trace names groups by id.
        {"sqlite_autoincrement": True},
    )

    group_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    sample_seq: Mapped[int] = mapped_column(Integer, unique=True)
    epoch: Mapped[int] = mapped_column(Integer)
    prompt_id: Mapped[int] = mapped_column(Integer)
    num_generations: Mapped[int] = mapped_column(Integer)
    target_step: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    discard_reason: Mapped[str | None] = mapped_column(String(64))
    policy_version: Mapped[int | None] = mapped_column(Integer)
    trained_step: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class Rollout(Base):
    """One row per generation of a group and per attempt at it.

    Indexed by its key and by UNIQUE (group_id, generation_index, attempt) only, whose
    leading column serves every look-up by group (revision v1_13_a dropped a separate
    index on `group_id`, which duplicated it, and one on `state`: the pumps look attempts
    up by id or group, and the few whole-table reads of running attempts, at a restore,
    scan a table that holds only what is in flight; a partial index holds the abandoned
    ones, which a snapshot with agent servers reads). Each index cost every attempt's
    insert and every state change a B-tree write, and a snapshot its pages: 2.2 of the
    7.3 MiB of a snapshot with 80k attempts in flight (BENCHMARKS.md, "Two rollouts
    indexes fewer")."""

    __tablename__ = "rollouts"
    __table_args__ = (
        UniqueConstraint("group_id", "generation_index", "attempt"),
        CheckConstraint(_in("state", ROLLOUT_STATES), name="state"),
        CheckConstraint(
            "(state = 'abandoned') = (abandon_reason IS NOT NULL)", name="abandon_reason"
        ),
        CheckConstraint(
            f"abandon_reason IS NULL OR {_in('abandon_reason', ABANDON_REASONS)}",
            name="abandon_reason_known",
        ),
        # Only the abandoned attempts (a few: retried generations), for the snapshot pump's
        # read of them at every agent-server snapshot (`queries.episode_keys`).
        Index("ix_rollouts_abandoned", "state", sqlite_where=text("state = 'abandoned'")),
        {"sqlite_autoincrement": True},  # as prompt_groups
    )

    attempt_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    group_id: Mapped[int] = mapped_column(ForeignKey("prompt_groups.group_id", ondelete="CASCADE"))
    generation_index: Mapped[int] = mapped_column(Integer)
    attempt: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    abandon_reason: Mapped[str | None] = mapped_column(String(16))
    policy_version: Mapped[int] = mapped_column(Integer)
    dispatched_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)


class TokenChunk(Base):
    """Prefix capture: tokens a running call had decoded at a cut, with the limits the
    call was started with, so a resumed call can continue exactly. One chunk per run of
    tokens of one policy version (a call that ran across a refit has several);
    `logprobs` (revision v1_3_a) float32 little-endian, one per token; NULL in chunks
    written before it (the engine then recomputes them from the prefill).

    Its bytes are inline, or (revision v1_8_a) row `segment_row` of the segment
    `segment_id` names, written once by the cut that first saw those tokens and
    referenced by every later snapshot that needs them (`pools.read_chunks` takes either);
    the segment's empty `logprobs` BLOB stands for NULL."""

    __tablename__ = "token_chunks"
    __table_args__ = (
        UniqueConstraint("attempt_id", "chunk_index"),
        CheckConstraint("(segment_id IS NULL) = (token_ids IS NOT NULL)", name="chunk_inline_or_segment"),
        CheckConstraint("(segment_id IS NULL) = (segment_row IS NULL)", name="chunk_row_with_segment"),
    )

    chunk_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt_id: Mapped[int] = mapped_column(
        ForeignKey("rollouts.attempt_id", ondelete="CASCADE")
    )
    chunk_index: Mapped[int] = mapped_column(Integer)
    prefix_count: Mapped[int] = mapped_column(Integer)
    token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    max_tokens: Mapped[int] = mapped_column(Integer)
    min_tokens: Mapped[int] = mapped_column(Integer)
    policy_version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)
    segment_id: Mapped[int | None] = mapped_column(ForeignKey("payload_segments.segment_id"))
    segment_row: Mapped[int | None] = mapped_column(Integer)
    # Revision v1_10_a: the sampler that decoded the tokens (`GenerationEngine.sampler_identity`:
    # engine/version/scheme); NULL before it, or for a call decoded by more than one.
    # A continuation is reported bitwise only by an engine of the same identity.
    sampler: Mapped[str | None] = mapped_column(String(128))


class PayloadSegment(Base):
    """An immutable payload segment file (revision v1_6_a): finished samples' token ids
    and logprobs, sealed once into ``CHECKPOINT_DIR/payload_segments/<file_name>`` and
    never written again (store/live/payload.py, store/checkpoints/segments.py). A row
    lives while a sample references it; the snapshot manifest lists the same checksum."""

    __tablename__ = "payload_segments"
    __table_args__ = ({"sqlite_autoincrement": True},)  # a segment number is never reused

    segment_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    file_name: Mapped[str] = mapped_column(String(64), unique=True)
    blake3: Mapped[str] = mapped_column(String(64))  # of the whole file, as its manifest entry
    bytes: Mapped[int] = mapped_column(Integer)
    rows: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)


class Sample(Base):
    """A finished generation. Keyed by group id but with no foreign key to the ledger:
    without ledger dispatch the data plane still holds samples (see invariant 3).

    Its payload (token ids, logprobs) is inline until a snapshot seals it into a payload
    segment (revision v1_6_a): then `segment_id` names the segment and both BLOBs are
    NULL here; the one reader of payload (`payload.read_samples`) takes either."""

    __tablename__ = "samples"
    __table_args__ = (
        UniqueConstraint("group_id", "generation_index"),
        CheckConstraint("(segment_id IS NULL) = (token_ids IS NOT NULL)", name="payload_inline_or_segment"),
        CheckConstraint("(token_ids IS NULL) = (logprobs IS NULL)", name="payload_together"),
        # A sample id is never handed out again (v1_6_a): sealing reads the inline payload,
        # writes the segment, then points the ids it read at it; a trained sample deleted
        # meanwhile must not lend its id to a new sample, which would be pointed at another's payload.
        {"sqlite_autoincrement": True},
    )

    sample_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    group_id: Mapped[int] = mapped_column(Integer)
    generation_index: Mapped[int] = mapped_column(Integer)
    prompt_id: Mapped[int] = mapped_column(Integer)
    num_tokens: Mapped[int] = mapped_column(Integer)
    token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)  # int32 little-endian; NULL once sealed
    logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)  # float32 little-endian; NULL once sealed
    reward: Mapped[float] = mapped_column(Float)
    policy_version: Mapped[int] = mapped_column(Integer)  # version the call began on
    # JSON list of [policy_version, token_count] runs (revision v1_1_a); batch age
    # weighs each token by the version that produced it.
    version_token_counts: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    segment_id: Mapped[int | None] = mapped_column(ForeignKey("payload_segments.segment_id"), index=True)


class ReplayGroup(Base):
    """A sealed group waiting to be trained. `permit` is its replay-capacity slot:
    unique, and below run_meta.replay_capacity."""

    __tablename__ = "replay_groups"

    group_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    permit: Mapped[int] = mapped_column(Integer, unique=True)
    epoch: Mapped[int] = mapped_column(Integer)
    prompt_id: Mapped[int] = mapped_column(Integer)
    target_step: Mapped[int | None] = mapped_column(Integer, index=True)
    num_tokens: Mapped[int] = mapped_column(Integer)
    published_at: Mapped[float] = mapped_column(Float)


class SparePrompt(Base):
    """Prompts read from the dataloader and not yet dispatched."""

    __tablename__ = "spare_prompts"
    __table_args__ = (UniqueConstraint("epoch", "prompt_id"),)

    sample_seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer)
    prompt_id: Mapped[int] = mapped_column(Integer)
    added_at: Mapped[float] = mapped_column(Float)


class StepShortfall(Base):
    """Per stamped train step, how many groups it still needs."""

    __tablename__ = "step_shortfall"
    __table_args__ = (CheckConstraint("needed >= 0", name="needed_nonnegative"),)

    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    needed: Mapped[int] = mapped_column(Integer)


class EnvEpisode(Base):
    """An episode of a running attempt after its last finished turn (turn-level
    recovery). `episode_key` is `<group_id>.<generation_index>-a<attempt>`.

    `transcript_tokens` (revision v1_11_a) is how many tokens of transcript the episode
    saved: every token after the prompt so far, the policy's replies and the
    environment's observations in order, kept in `episode_tokens` as pieces appended
    one per save. NULL: an episode that saves only its state (or one saved before
    v1_2_a); not resumable at turn level (the pump restarts the episode). A turn's save
    rewrites this small row and appends its new tokens: before v1_11_a the whole
    transcript lived here and every turn rewrote it, O(tokens so far) per turn.
    """

    __tablename__ = "env_episodes"

    episode_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    attempt_id: Mapped[int] = mapped_column(
        ForeignKey("rollouts.attempt_id", ondelete="CASCADE"), unique=True
    )
    turn: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(Text)  # JSON
    updated_at: Mapped[float] = mapped_column(Float)
    transcript_tokens: Mapped[int | None] = mapped_column(Integer)


class EpisodeToken(Base):
    """A piece of a saved episode's transcript (revision v1_11_a): the tokens
    [first_token, first_token + n) of the transcript of the episode of `attempt_id`,
    appended by the save that first had them (`pools.put_episodes`), so a turn writes
    what it added, not the transcript so far. `token_ids` int32 little-endian,
    `logprobs` float32 little-endian (0.0 for environment tokens), `version_token_counts`
    JSON runs `[[version, count], ...]` as samples have them, environment tokens under
    version -1 (the loss mask is "version != -1", the rule the train pump applies to
    samples); one entry per token in all three. The pieces of an episode, in
    `first_token` order, are contiguous from 0 and sum to its `transcript_tokens`; a
    reader that finds otherwise restarts the episode rather than resume from tokens that
    do not line up. Deleting the episode deletes its pieces (ON DELETE CASCADE)."""

    __tablename__ = "episode_tokens"
    __table_args__ = (CheckConstraint("first_token >= 0", name="piece_offset"),)

    attempt_id: Mapped[int] = mapped_column(
        ForeignKey("env_episodes.attempt_id", ondelete="CASCADE"), primary_key=True
    )
    first_token: Mapped[int] = mapped_column(Integer, primary_key=True)
    token_ids: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    version_token_counts: Mapped[str] = mapped_column(Text)


class SettledStep(Base):
    """The compacted record of settled groups (revision v1_5_a; v1_4_a kept run-length
    `settled_ranges`): a trained or discarded group leaves `prompt_groups` (and its
    attempts leave `rollouts`) in the commit that settles it, and its sampler position
    joins a row here (store/live/compaction.py). One row per settling record, about one
    per train step: positions [seq_start, seq_end) are trained at `trained_step`
    (stamped for `target_step`), except those `others` lists: discarded (with a reason
    code of `discard_reasons`) or not settled in this row (trained at another step,
    still live, or discarded in another row). A zero-variance discard among a step's
    positions is an entry of the blob, not a split of the row, so the table grows by
    one row per step, not three (BENCHMARKS.md, "A bounded live store").

    `others`: entries of three unsigned LEB128 varints (gap, length, code), in position
    order: `gap` positions after the previous entry's end (or after `seq_start`), a run
    of `length` positions, `code` 0 = not settled in this row, k >= 1 = discarded for
    `discard_reasons.code` k. NULL: every position trained here. A row of discards only
    has `trained_step` NULL and lists every position of its span. `seq_start` is always
    a position settled in its row. Spans may overlap (a position open in one row is
    settled in another); `queries.settled_runs` is the one reader that decodes them.

    Exactly-once over the whole run reads this table plus the live rows: every sampler
    position below the cursor is settled in exactly one row or is a ledger row or a
    spare prompt (invariant 1, `invariants.py`; `restore.choice.audit_ledger`). Positions
    alone do not prove prompts once: `settled_prompts` keeps each epoch's settled prompt
    ids for that, and the ledger's UNIQUE (epoch, prompt_id) still guards live rows."""

    __tablename__ = "settled_steps"
    __table_args__ = (CheckConstraint("seq_end > seq_start", name="nonempty"),)

    seq_start: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq_end: Mapped[int] = mapped_column(Integer)  # one past the last position
    trained_step: Mapped[int | None] = mapped_column(Integer)
    target_step: Mapped[int | None] = mapped_column(Integer)
    others: Mapped[bytes | None] = mapped_column(LargeBinary)


class SettledPrefix(Base):
    """The settled record's folded prefix (revision v1_12_a): every sampler position below
    `seq_end` settled exactly once, kept as counts instead of `settled_steps` rows. At most
    one row (none: nothing folded). A train step's settle folds the rows that lie wholly
    below the lowest live position (ledger, spare pool, cursor) and whose step is older
    than the steps a resume could rewind to (compaction.fold_settled), so the record's
    rows, the bytes a snapshot copies and the Python a check decodes stay bounded by the
    steps kept, not the run (BENCHMARKS.md, "The settled record keeps the recent steps").

    `trained`: how many folded positions were trained; `discarded`: JSON object, discard
    reason -> how many folded positions were discarded for it; together they count
    `seq_end` positions. `through_step`: the latest train step of a folded row (NULL:
    only discards folded), below which a resume from a trainer checkpoint alone cannot
    rewind: which positions those steps trained is no longer recorded."""

    __tablename__ = "settled_prefix"
    __table_args__ = (
        CheckConstraint("id = 1", name="single_row"),
        CheckConstraint("seq_end >= 0 AND trained >= 0 AND trained <= seq_end", name="counts"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    seq_end: Mapped[int] = mapped_column(Integer)
    trained: Mapped[int] = mapped_column(Integer)
    discarded: Mapped[str] = mapped_column(Text)  # JSON {reason: count}
    through_step: Mapped[int | None] = mapped_column(Integer)


class DiscardReason(Base):
    """The discard reasons `settled_steps.others` names by code (revision v1_5_a): a few
    rows per run ('zero_reward_variance', 'resume_check', ...), so a discard costs a
    one-byte code in its step's row instead of the reason's text. No UNIQUE index on
    `reason` (it would cost a page for a table of a few rows): the writer looks the
    reason up before adding it, in the settling transaction."""

    __tablename__ = "discard_reasons"

    code: Mapped[int] = mapped_column(Integer, primary_key=True)
    reason: Mapped[str] = mapped_column(String(64))


class SettledPrompts(Base):
    """Which prompts of each epoch have settled (revision v1_4_a; by chunk from v1_9_a):
    the (epoch, prompt id) a settled group leaves behind, so exactly-once still holds for
    prompts and not only for positions. A position could be exact while the sampler handed
    one prompt out at two positions (after its first group settled, the ledger's UNIQUE
    (epoch, prompt_id) no longer sees it). One row per (epoch, chunk) of PROMPT_CHUNK
    prompt ids: bit `p % 8` of byte `p // 8` of `bits` is set once prompt id
    `chunk * PROMPT_CHUNK + p` settled in this epoch (at most 512 bytes, trailing zero
    bytes left off); `settles`: how many groups of the epoch whose prompt is in the chunk
    settled. A settle reads and rewrites the one chunk its prompt is in, whatever the
    dataset size (compaction.mark_settled). An epoch's `settles` above its count of set
    bits means a prompt settled twice; a live row (ledger or spare) whose bit is set was
    handed out again."""

    __tablename__ = "settled_prompts"

    epoch: Mapped[int] = mapped_column(Integer, primary_key=True)
    chunk: Mapped[int] = mapped_column(Integer, primary_key=True)
    bits: Mapped[bytes] = mapped_column(LargeBinary)
    settles: Mapped[int] = mapped_column(Integer)


class SnapshotAttempt(Base):
    """Every snapshot attempt and its outcome; phase timings when published."""

    __tablename__ = "snapshot_attempts"
    __table_args__ = (CheckConstraint(_in("outcome", SNAPSHOT_OUTCOMES), name="outcome"),)

    attempt_seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[float] = mapped_column(Float)
    outcome: Mapped[str] = mapped_column(String(32))
    anchor: Mapped[str | None] = mapped_column(String(64))
    snapshot_seq: Mapped[int | None] = mapped_column(Integer)
    mutation_counter: Mapped[int] = mapped_column(Integer)
    timings: Mapped[str | None] = mapped_column(Text)  # JSON {phase: seconds}
    error: Mapped[str | None] = mapped_column(Text)


metadata = Base.metadata
T = metadata.tables  # Core tables for the hot paths: T["prompt_groups"], ...

# Tables whose rows are in-flight work, in the order `inspect` lists them.
STATE_TABLES = tuple(T)
