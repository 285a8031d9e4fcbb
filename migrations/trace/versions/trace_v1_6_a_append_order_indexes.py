"""Trace: the per-attempt indexes lead with `group_id`, which grows as the run goes, instead
of `prompt_id`, which a run draws at random; the group events' `prompt_id` indexes go.

Revision ID: trace_v1_6_a
Revises: trace_v1_5_a
Create Date: 2026-12-04

Why: an index keyed by a random value takes each new row on a random leaf page of the
whole index. Once the trace outgrows the page cache every event paid a page read and a
page write (5.4 KB of WAL per row in batches of 30 at 3M rows): a 1000-row batch of
`call_finished` cost 1.7-2.6 ms on an empty trace and 23-29 ms at 3M rows (BENCHMARKS.md,
"Per-event costs against the run's length"). Group ids are the live store's AUTOINCREMENT keys, so the rows a run writes go to
the index pages of the groups in flight: the pages touched per event follow the work in
flight, not the trace's size. The analysis matches an attempt's rows by
(`group_id`, `prompt_id`, `generation_index`, `attempt`) and looks them up in SQLite by the
new indexes. The `prompt_id` indexes of `group_reserved`, `group_sealed` and
`group_discarded` served no query (EXPLAIN QUERY PLAN of every figure); they are dropped,
not re-keyed.

Data migration: none; the indexes are rebuilt (one sort of each per-attempt table: the
first run that appends to a large old trace pays it once). The downgrade puts the old
indexes back.

Frozen: the index names and keys are written out here as they are at each revision.
"""

from alembic import op

revision = "trace_v1_6_a"
down_revision = "trace_v1_5_a"
branch_labels = None
depends_on = None

PER_ATTEMPT = ("attempt_dispatched", "call_finished", "turn_committed", "episode_restored")
OLD_KEY = ("prompt_id", "generation_index", "attempt")
NEW_KEY = ("group_id", "generation_index", "attempt")
DROPPED = {"group_reserved": ("prompt_id",), "group_sealed": ("prompt_id",), "group_discarded": ("prompt_id",)}


def _name(table: str, key: tuple[str, ...]) -> str:
    return f"ix_{table}_{'_'.join(key)}"


def upgrade() -> None:
    for table in PER_ATTEMPT:
        op.drop_index(_name(table, OLD_KEY), table_name=table)
        op.create_index(_name(table, NEW_KEY), table, list(NEW_KEY))
    for table, key in DROPPED.items():
        op.drop_index(_name(table, key), table_name=table)


def downgrade() -> None:
    for table, key in DROPPED.items():
        op.create_index(_name(table, key), table, list(key))
    for table in PER_ATTEMPT:
        op.drop_index(_name(table, NEW_KEY), table_name=table)
        op.create_index(_name(table, OLD_KEY), table, list(OLD_KEY))
