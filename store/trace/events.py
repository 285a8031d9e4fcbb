"""The trace's events: each event's fields and their types, and the tables they are
stored in (revision trace_v1_1_a's scheme: one table per event, one typed column per
field; list-valued fields as rows of their own tables; trace_v1_2_a adds the per-call and
per-turn events of streaming rollouts, trace_v1_3_a `call_fallback`, trace_v1_4_a the cut's
decode point and what each fallback cost, trace_v1_5_a how exactly a continued call
continued, trace_v1_6_a indexes keyed in the order rows arrive). `trace_metadata` is the schema at head;
the trace's migrations (``rolloutdb/migrations/trace``) build the files, and a test
compares the two. docs/trace.md describes every event and field; a test checks the two
agree.
"""

from __future__ import annotations

from sqlalchemy import (
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)

from ..sqlite.revision import NAMING

# Fields that many events carry and that analyses join on.
COMMON_FIELDS = ("prompt_id", "generation_index", "group_id", "attempt", "step", "policy_version", "reason")
_ATTEMPT = ("group_id", "prompt_id", "generation_index", "attempt", "step", "policy_version")
_GROUP = ("group_id", "prompt_id", "step", "policy_version")

# Event name -> its fields, in the order of its table's columns (after seq, t, run).
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "run_started": ("pid", "host"),
    "group_reserved": _GROUP + ("epoch", "group_size"),
    "attempt_dispatched": _ATTEMPT + ("prefix_tokens",),
    "call_cut": _ATTEMPT + ("tokens",),
    "attempt_abandoned": _ATTEMPT + ("reason", "tokens"),
    "rollout_finished": _ATTEMPT + ("tokens", "reward", "finish_reason", "version_token_counts"),
    "group_sealed": _GROUP + ("generations",),
    "group_published": _GROUP + ("version_token_counts", "tokens"),
    "group_discarded": _GROUP + ("reason",),
    "refit": ("step", "policy_version", "old_version", "new_version", "running"),
    "train_step": ("step", "policy_version", "group_ids", "batch_age", "tokens"),
    # trace_v1_4_a appends `decoded_at` to both (prefix level: the cut's decode point).
    "snapshot_cut": ("step", "policy_version", "cut_time", "snapshot_seq", "anchor", "snapshot", "groups_in_flight",
                     "decoded_at"),
    "restore_done": ("step", "policy_version", "cut_time", "snapshot_seq", "anchor", "snapshot", "groups_restored",
                     "replay_restored", "decoded_at"),
    # trace_v1_2_a: what a stop kept (streaming pump, turn-level recovery).
    # trace_v1_5_a appends `prefix_exactness` (a call continued from a cut prefix: bitwise or
    # distribution, as its engine reported).
    "call_finished": _ATTEMPT + ("turn", "tokens", "finish_reason", "prefix_exactness"),
    "turn_committed": _ATTEMPT + ("turn", "tokens", "total_tokens"),
    "episode_restored": _ATTEMPT + ("from_attempt", "turn", "tokens", "total_tokens"),
    # trace_v1_3_a: a running call a prefix-level cut could not save (it restarts its turn);
    # trace_v1_4_a appends the attempt's fields and the tokens it cost.
    "call_fallback": ("attempt_id", "turn", "reason") + _ATTEMPT + ("tokens",),
}
EVENTS: dict[str, frozenset[str]] = {name: frozenset(fields) for name, fields in EVENT_FIELDS.items()}

# Column type of every scalar field; `running` is a JSON list.
FIELD_TYPES = {
    **dict.fromkeys(
        ("prompt_id", "generation_index", "group_id", "attempt", "step", "policy_version", "pid", "epoch", "group_size",
         "prefix_tokens", "tokens", "generations", "old_version", "new_version", "snapshot_seq", "groups_in_flight",
         "groups_restored", "replay_restored", "turn", "total_tokens", "from_attempt", "attempt_id"),
        "int"),
    **dict.fromkeys(("reward", "batch_age", "cut_time", "decoded_at"), "float"),
    **dict.fromkeys(("reason", "host", "finish_reason", "anchor", "snapshot", "prefix_exactness"), "text"),
    "running": "json",
}

# List-valued fields, each stored as rows of its own table: (event, field) -> (table, columns).
LIST_TABLES: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("rollout_finished", "version_token_counts"): ("finished_tokens", ("policy_version", "tokens")),
    ("group_published", "version_token_counts"): ("published_tokens", ("policy_version", "tokens")),
    ("train_step", "group_ids"): ("trained_groups", ("group_id",)),
}

# Indexes for SQLite's own look-ups (the DuckDB analysis scans whole tables, except the
# per-attempt rows of the attempts a stop abandoned, which it asks SQLite for by these).
# Every key leads with a value that grows as the run goes (trace_v1_6_a): group ids are
# the live store's AUTOINCREMENT keys, so a new row lands on the index pages of the groups
# in flight. A key led by a value drawn at random (a prompt id) put each row on a random
# page of the whole index: a page read and write per event once the trace outgrew the
# cache (23-29 ms per 1000-row batch at 3M rows against 1.7-2.6 ms on an empty trace).
# tests/test_trace.py holds every index to an append-order leading column.
EVENT_INDEXES = {
    "group_published": ("group_id",),
    "attempt_dispatched": ("group_id", "generation_index", "attempt"),
    "call_finished": ("group_id", "generation_index", "attempt"),
    "turn_committed": ("group_id", "generation_index", "attempt"),
    "episode_restored": ("group_id", "generation_index", "attempt"),
}

ABANDON_REASONS = ("restart", "deadline", "error")


def event_columns(name: str) -> tuple[str, ...]:
    """The scalar fields of event `name`, in its table's column order."""
    return tuple(f for f in EVENT_FIELDS[name] if (name, f) not in LIST_TABLES)


# --------------------------------------------------------------------------- schema

trace_metadata = MetaData(naming_convention=NAMING)
_SQL_TYPES = {"int": Integer, "float": Float, "text": Text, "json": Text}

runs = Table(
    "runs",
    trace_metadata,
    Column("run", Integer, primary_key=True, autoincrement=False),
    Column("run_id", String(36), nullable=False, unique=True),  # new for each process
    Column("pid", Integer),
    Column("host", String(255)),
    Column("first_t", Float, nullable=False),  # min and max t of its events,
    Column("last_t", Float, nullable=False),  # updated with every batch it commits
    Column("last_seq", Integer, nullable=False),
)

event_tables: dict[str, Table] = {}
for _name in EVENT_FIELDS:
    event_tables[_name] = Table(
        _name,
        trace_metadata,
        Column("seq", Integer, primary_key=True, autoincrement=False),
        Column("t", Float, nullable=False),
        Column("run", Integer, ForeignKey("runs.run"), nullable=False),
        *(Column(f, _SQL_TYPES[FIELD_TYPES[f]]()) for f in event_columns(_name)),
        *([Index(f"ix_{_name}_{'_'.join(EVENT_INDEXES[_name])}", *EVENT_INDEXES[_name])] if _name in EVENT_INDEXES else []),
    )
list_tables: dict[str, Table] = {}
for (_name, _field), (_table, _cols) in LIST_TABLES.items():
    list_tables[_table] = Table(
        _table,
        trace_metadata,
        Column("seq", Integer, ForeignKey(f"{_name}.seq"), primary_key=True),
        *(Column(c, Integer, primary_key=True) if i == 0 else Column(c, Integer, nullable=False) for i, c in enumerate(_cols)),
    )
