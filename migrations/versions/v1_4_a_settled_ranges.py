"""Settled groups leave the live store: the compacted record ``settled_ranges``.

Revision ID: v1_4_a
Revises: v1_3_a
Create Date: 2026-12-01

Until this revision every trained and discarded group kept its ledger row and every
attempt row forever (0.36 MB after 30 quickstart steps, 3.3 MB after 300). From here on
the commit that settles a group deletes those rows and records its sampler position in
a run-length range (store/live/compaction.py):

* table ``settled_ranges``: ``seq_start`` (primary key), ``seq_end`` (one past the last
  position), ``outcome`` ('trained' | 'discarded'), ``trained_step``, ``target_step``,
  ``discard_reason``; one row per maximal run of consecutive positions with the same
  outcome, steps and reason.

* table ``settled_prompts``: ``epoch`` (primary key), ``bits`` (bit ``p % 8`` of byte
  ``p // 8`` set once prompt id ``p`` settled in the epoch), ``settles`` (the epoch's
  settled groups): the ranges prove each position once, these each (epoch, prompt id)
  once, so a prompt handed out again at a new position after its first group settled
  is still counted as duplicated.

Data migration: the settled groups of an older file become ranges (gaps and islands:
consecutive positions of one key share ``sample_seq - row_number()``), and their ledger
and attempt rows go. ``prompt_groups`` and ``rollouts`` are rebuilt with AUTOINCREMENT
holding only the live rows: with settled rows deleted, SQLite's default would hand the
highest deleted id out again, and the trace names groups and attempts by id, so ids
must never come back; the sequence starts at the old highest id. Rebuilding copies only
the live rows, which is also what keeps an upgrade of a 100k-group file fast (bench/
bench_compaction_upgrade.py): deleting the settled rows in place cost more than copying
the rest.

Frozen: the table definitions are written out here as they are at this revision.
"""

from alembic import op

revision = "v1_4_a"
down_revision = "v1_3_a"
branch_labels = None
depends_on = None

CREATE_RANGES = """CREATE TABLE settled_ranges (
\tseq_start INTEGER NOT NULL,
\tseq_end INTEGER NOT NULL,
\toutcome VARCHAR(16) NOT NULL,
\ttrained_step INTEGER,
\ttarget_step INTEGER,
\tdiscard_reason VARCHAR(64),
\tCONSTRAINT pk_settled_ranges PRIMARY KEY (seq_start),
\tCONSTRAINT ck_settled_ranges_nonempty CHECK (seq_end > seq_start),
\tCONSTRAINT ck_settled_ranges_outcome CHECK (outcome IN ('trained', 'discarded'))
)"""

CREATE_PROMPTS = """CREATE TABLE settled_prompts (
\tepoch INTEGER NOT NULL,
\tbits BLOB NOT NULL,
\tsettles INTEGER NOT NULL,
\tCONSTRAINT pk_settled_prompts PRIMARY KEY (epoch)
)"""

# Islands: within one key, consecutive positions have equal sample_seq - row_number().
# PARTITION BY and GROUP BY treat NULLs as equal, as the key must. NOT INDEXED: nearly
# every row is settled, and a scan in rowid order beats 100k look-ups through the state
# index (2.1 s -> see bench/bench_compaction_upgrade.py).
COMPACT = """INSERT INTO settled_ranges (seq_start, seq_end, outcome, trained_step, target_step, discard_reason)
SELECT min(sample_seq), max(sample_seq) + 1, state, trained_step, target_step, discard_reason
FROM (SELECT sample_seq, state, trained_step, target_step, discard_reason,
             sample_seq - row_number() OVER (PARTITION BY state, trained_step, target_step, discard_reason
                                             ORDER BY sample_seq) AS island
      FROM prompt_groups NOT INDEXED WHERE state IN ('trained', 'discarded'))
GROUP BY state, trained_step, target_step, discard_reason, island"""

GROUPS = """CREATE TABLE _v1_4_a_prompt_groups (
\tgroup_id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
\tsample_seq INTEGER NOT NULL,
\tepoch INTEGER NOT NULL,
\tprompt_id INTEGER NOT NULL,
\tnum_generations INTEGER NOT NULL,
\ttarget_step INTEGER,
\tstate VARCHAR(16) NOT NULL,
\tdiscard_reason VARCHAR(64),
\tpolicy_version INTEGER,
\ttrained_step INTEGER,
\tcreated_at FLOAT NOT NULL,
\tupdated_at FLOAT NOT NULL,
\tCONSTRAINT uq_prompt_groups_epoch_prompt_id UNIQUE (epoch, prompt_id),
\tCONSTRAINT ck_prompt_groups_state CHECK (state IN ('reserved', 'dispatched', 'sealed', 'published', 'trained', 'discarded')),
\tCONSTRAINT ck_prompt_groups_discard_reason CHECK ((state = 'discarded') = (discard_reason IS NOT NULL)),
\tCONSTRAINT uq_prompt_groups_sample_seq UNIQUE (sample_seq)
)"""
GROUP_COLUMNS = ("group_id, sample_seq, epoch, prompt_id, num_generations, target_step, state, discard_reason, "
                 "policy_version, trained_step, created_at, updated_at")

ROLLOUTS = """CREATE TABLE _v1_4_a_rollouts (
\tattempt_id INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
\tgroup_id INTEGER NOT NULL,
\tgeneration_index INTEGER NOT NULL,
\tattempt INTEGER NOT NULL,
\tstate VARCHAR(16) NOT NULL,
\tabandon_reason VARCHAR(16),
\tpolicy_version INTEGER NOT NULL,
\tdispatched_at FLOAT NOT NULL,
\tended_at FLOAT,
\tCONSTRAINT uq_rollouts_group_id_generation_index_attempt UNIQUE (group_id, generation_index, attempt),
\tCONSTRAINT ck_rollouts_state CHECK (state IN ('running', 'finished', 'abandoned')),
\tCONSTRAINT ck_rollouts_abandon_reason CHECK ((state = 'abandoned') = (abandon_reason IS NOT NULL)),
\tCONSTRAINT ck_rollouts_abandon_reason_known CHECK (abandon_reason IS NULL OR abandon_reason IN ('restart', 'deadline', 'error')),
\tCONSTRAINT fk_rollouts_group_id_prompt_groups FOREIGN KEY(group_id) REFERENCES prompt_groups (group_id) ON DELETE CASCADE
)"""
ROLLOUT_COLUMNS = ("attempt_id, group_id, generation_index, attempt, state, abandon_reason, policy_version, "
                   "dispatched_at, ended_at")
INDEXES = (
    "CREATE INDEX ix_prompt_groups_state ON prompt_groups (state)",
    "CREATE INDEX ix_rollouts_group_id ON rollouts (group_id)",
    "CREATE INDEX ix_rollouts_state ON rollouts (state)",
)


def _rebuild(run, table: str, create: str, columns: str, keep: str, key: str) -> None:
    """Recreate `table` from `create` (named `_v1_4_a_<table>`) with the rows `keep`
    selects, its AUTOINCREMENT sequence at the old highest id. Foreign keys are off
    during migrations (store/sqlite/revision.py), so dropping a referenced table and
    renaming the copy into its place leaves the references pointing at the copy."""
    top = run(f"SELECT coalesce(max({key}), 0) FROM {table}").scalar_one()
    run(create)
    run(f"INSERT INTO _v1_4_a_{table} ({columns}) SELECT {columns} FROM {table} WHERE {keep}")
    run(f"DROP TABLE {table}")
    run(f"ALTER TABLE _v1_4_a_{table} RENAME TO {table}")
    run(f"DELETE FROM sqlite_sequence WHERE name = '{table}'")
    run(f"INSERT INTO sqlite_sequence (name, seq) VALUES ('{table}', {int(top)})")


def _mark_prompts(bind) -> None:
    """One bitmap per epoch of the settled groups' prompt ids (bit `p % 8` of byte
    `p // 8`) and the count of settled groups. Python, written out here (frozen, not the
    store's compaction code): SQLite has no bit aggregate. 100k settled groups: ~0.1 s."""
    bitmaps: dict[int, tuple[bytearray, list[int]]] = {}
    rows = bind.exec_driver_sql(
        "SELECT epoch, prompt_id FROM prompt_groups NOT INDEXED WHERE state IN ('trained', 'discarded')")
    for epoch, prompt_id in rows:
        bits, n = bitmaps.setdefault(epoch, (bytearray(), [0]))
        if len(bits) <= prompt_id >> 3:
            bits.extend(bytes((prompt_id >> 3) + 1 - len(bits)))
        bits[prompt_id >> 3] |= 1 << (prompt_id & 7)
        n[0] += 1
    for epoch, (bits, n) in bitmaps.items():
        bind.exec_driver_sql("INSERT INTO settled_prompts (epoch, bits, settles) VALUES (?, ?, ?)",
                             (epoch, bytes(bits), n[0]))


def upgrade() -> None:
    bind = op.get_bind()

    def run(sql: str):
        return bind.exec_driver_sql(sql)

    run(CREATE_RANGES)
    run(COMPACT)
    run(CREATE_PROMPTS)
    _mark_prompts(bind)
    settled = "state IN ('trained', 'discarded')"
    _rebuild(run, "rollouts", ROLLOUTS, ROLLOUT_COLUMNS,
             # the live groups' attempts, found through ix_rollouts_group_id: a few
             # hundred look-ups instead of a scan of every attempt of the run
             f"group_id IN (SELECT group_id FROM prompt_groups NOT INDEXED WHERE NOT ({settled}))", "attempt_id")
    _rebuild(run, "prompt_groups", GROUPS, GROUP_COLUMNS, f"NOT ({settled})", "group_id")
    for sql in INDEXES:
        run(sql)


def downgrade() -> None:
    # The settled rows' details beyond their ranges (group and attempt ids, policy
    # versions, timestamps) are gone: a downgrade keeps the live rows and drops the
    # ranges, which an older rolloutdb cannot read.
    op.drop_table("settled_prompts")
    op.drop_table("settled_ranges")

