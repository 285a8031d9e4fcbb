"""A trace written at revision trace_v1_0_a (one `events` table) is still read: the
analysis upgrades a copy and gives the same figures, and a new run appending to it
upgrades the file in place. A trace at trace_v1_1_a (before the turn events) upgrades to
trace_v1_2_a with every row kept, one at trace_v1_2_a (before `call_fallback`) to
trace_v1_3_a, and one at trace_v1_3_a (before the cut's decode point and the fallbacks'
tokens) to trace_v1_4_a.

The trace_v1_0_a file is the hand-built job of test_trace_analysis, written at head and
taken down to trace_v1_0_a by the real migrations (Alembic downgrade), then checked to
have exactly trace_v1_0_a's schema; it holds the same events and run ids as the file it
came from, so the figures must be equal to the last digit.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import shutil
import sqlite3

import pytest

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
import sqlalchemy as sa
from sqlalchemy import create_engine, event
from sqlalchemy.pool import NullPool

from rolloutdb.store.trace import queries as trace_queries
from rolloutdb.store.trace.analysis import TraceAnalysis
from rolloutdb.store.sqlite.revision import trace_alembic_config
from rolloutdb.store.sqlite.revision import run_trace_migrations
from rolloutdb.store.trace.writer import TRACE_FILENAME, Tracer
from test_trace_analysis import write_baseline, write_run_a, write_run_b

V1_0_A = importlib.import_module("rolloutdb.migrations.trace.versions.trace_v1_0_a_events")
V1_1_A = importlib.import_module("rolloutdb.migrations.trace.versions.trace_v1_1_a_event_tables")
V1_2_A = importlib.import_module("rolloutdb.migrations.trace.versions.trace_v1_2_a_turn_events")
V1_3_A = importlib.import_module("rolloutdb.migrations.trace.versions.trace_v1_3_a_call_fallback")
V1_4_A = importlib.import_module("rolloutdb.migrations.trace.versions.trace_v1_4_a_cut_accounting")
V1_5_A = importlib.import_module("rolloutdb.migrations.trace.versions.trace_v1_5_a_prefix_exactness")
V1_6_A = importlib.import_module("rolloutdb.migrations.trace.versions.trace_v1_6_a_append_order_indexes")
NEW_AT_V1_2_A = ("call_finished", "turn_committed", "episode_restored")
NEW_AT_V1_3_A = ("call_fallback",)
HEAD = "trace_v1_6_a"


def rows(path, sql):
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql).fetchall()


def downgrade_to(path, revision: str, tables) -> None:
    """Take the trace at `path` down to `revision` with the real migrations and check it
    has exactly that revision's tables (`tables`: its frozen MetaData), nothing else."""
    engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _fk_off(dbapi_conn, _record):  # noqa: ANN001
        dbapi_conn.execute("PRAGMA foreign_keys = OFF")

    try:
        with engine.begin() as conn:
            cfg = trace_alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, revision)
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), tables)
            assert diff == [], diff
    finally:
        engine.dispose()


def upgrade_to(path, revision: str) -> None:
    """Bring the trace at `path` up to `revision` (not further) with the real migrations."""
    engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)
    try:
        with engine.begin() as conn:
            cfg = trace_alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        engine.dispose()


def v1_3_a_tables():
    """Every table at trace_v1_3_a: trace_v1_2_a's and `call_fallback`."""
    m = v1_2_a_tables()
    for table in V1_3_A._tables().sorted_tables:
        if table.name != "runs":
            table.to_metadata(m)
    return m


def v1_4_a_tables():
    """Every table at trace_v1_4_a: trace_v1_3_a's with the columns that revision appends."""
    m = v1_3_a_tables()
    for name, columns in V1_4_A.NEW_COLUMNS.items():
        for column, kind in columns:
            m.tables[name].append_column(sa.Column(column, kind()))
    return m


def v1_5_a_tables():
    """Every table at trace_v1_5_a: trace_v1_4_a's with `call_finished.prefix_exactness`
    (and its indexes keyed by prompt, as every revision before trace_v1_6_a)."""
    m = v1_4_a_tables()
    for name, columns in V1_5_A.NEW_COLUMNS.items():
        for column, kind in columns:
            m.tables[name].append_column(sa.Column(column, kind()))
    return m


def v1_2_a_tables():
    """Every table at trace_v1_2_a: trace_v1_1_a's and the three that revision added."""
    m = V1_1_A._tables()
    for table in V1_2_A._tables().sorted_tables:
        if table.name != "runs":
            table.to_metadata(m)
    return m


def downgrade_to_v1_0_a(path) -> None:
    downgrade_to(path, "trace_v1_0_a", V1_0_A._tables())


def _job(tmp_path, name):
    run, base = tmp_path / name / "run" / TRACE_FILENAME, tmp_path / name / "base" / TRACE_FILENAME
    write_run_a(run).close()
    write_run_b(run).close()
    write_baseline(base).close()
    return run, base


def _figures(run, base) -> dict:
    with TraceAnalysis([run], [base]) as a:
        return {name: a.query(name).rows for name in trace_queries.QUERIES}


def test_a_trace_v1_0_a_file_analyses_exactly_as_the_same_job_at_head_and_is_left_unchanged(tmp_path):
    head_run, head_base = _job(tmp_path, "head")
    old_run, old_base = tmp_path / "old_run.sqlite", tmp_path / "old_base.sqlite"
    for head, old in ((head_run, old_run), (head_base, old_base)):
        shutil.copyfile(head, old)  # the same events and run ids
        downgrade_to_v1_0_a(old)
    assert rows(old_run, "SELECT version_num FROM alembic_version") == [("trace_v1_0_a",)]
    assert rows(old_run, "SELECT count(*), count(DISTINCT run_id) FROM events") == [(53, 2)]
    before = {p: p.read_bytes() for p in (old_run, old_base)}

    assert _figures(old_run, old_base) == _figures(head_run, head_base)
    assert {p: p.read_bytes() for p in (old_run, old_base)} == before  # upgraded in a copy


def test_a_run_appending_to_a_trace_v1_0_a_file_upgrades_it_in_place_and_keeps_every_event(tmp_path, caplog):
    run, _ = _job(tmp_path, "old")
    downgrade_to_v1_0_a(run)
    old = rows(run, "SELECT seq, t, run_id, event, prompt_id, generation_index, group_id, attempt, step, "
                    "policy_version, reason FROM events ORDER BY seq")
    with Tracer(run) as again:
        again.emit("group_sealed", group_id=99, prompt_id=99)
    assert rows(run, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    # Said once at the start, not left silent: an upgrade can rebuild indexes for seconds.
    said = [r.getMessage() for r in caplog.records if r.name == "rolloutdb.trace"]
    assert said == [f"trace: upgrading {run} (0 MiB) from trace_v1_0_a to {HEAD}, once"], said
    # Every old event, now read through the `events` view, then the new run's two.
    new = rows(run, "SELECT seq, t, run_id, event, prompt_id, generation_index, group_id, attempt, step, "
                    "policy_version, reason FROM events ORDER BY seq")
    assert new[:len(old)] == old
    assert [(r[0], r[2], r[3]) for r in new[len(old):]] == [(54, again.run_id, "run_started"),
                                                            (55, again.run_id, "group_sealed")]
    assert rows(run, "SELECT run, last_seq FROM runs ORDER BY run") == [(1, 31), (2, 53), (3, 55)]
    assert rows(run, "PRAGMA integrity_check") == [("ok",)]


def _every_row(path) -> dict[str, list]:
    """Every row of every table and view of the file, in a fixed order."""
    names = [n for (n,) in rows(path, "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') "
                                      "AND name NOT LIKE 'sqlite_%' AND name != 'alembic_version' ORDER BY name")]
    return {n: sorted(rows(path, f"SELECT * FROM {n}"), key=repr) for n in names}


def test_a_trace_v1_1_a_file_upgrades_to_trace_v1_2_a_with_every_row_kept(tmp_path):
    run, base = _job(tmp_path, "v1_1_a")
    downgrade_to(run, "trace_v1_1_a", V1_1_A._tables())
    assert rows(run, "SELECT version_num FROM alembic_version") == [("trace_v1_1_a",)]
    before = _every_row(run)
    assert sum(len(v) for k, v in before.items() if k != "events") > 53 and len(before["events"]) == 53
    assert not set(NEW_AT_V1_2_A) & set(before)

    upgrade_to(run, "trace_v1_3_a")  # trace_v1_4_a appends columns to old tables: its own test

    assert rows(run, "SELECT version_num FROM alembic_version") == [("trace_v1_3_a",)]
    after = _every_row(run)
    # Every old table and the `events` view hold exactly what they held; the new tables are empty.
    new = NEW_AT_V1_2_A + NEW_AT_V1_3_A
    assert {k: v for k, v in after.items() if k not in new} == before
    assert {k: after[k] for k in new} == dict.fromkeys(new, [])
    assert rows(run, "PRAGMA integrity_check") == [("ok",)]
    assert rows(run, "PRAGMA foreign_key_check") == []
    # A new run appends the new events, which the `events` view shows too.
    with Tracer(run) as again:
        again.emit("turn_committed", t=500.0, group_id=1, prompt_id=10, generation_index=0, attempt=0, turn=3,
                   tokens=40, total_tokens=55)
    (view,) = rows(run, "SELECT run_id, event, prompt_id, attempt, fields FROM events WHERE event = 'turn_committed'")
    assert view[:4] == (again.run_id, "turn_committed", 10, 0)
    assert json.loads(view[4]) == {"turn": 3, "tokens": 40, "total_tokens": 55}


def test_a_trace_v1_1_a_file_analyses_exactly_as_the_same_job_at_head(tmp_path):
    head_run, head_base = _job(tmp_path, "head")
    old_run = tmp_path / "old_run.sqlite"
    shutil.copyfile(head_run, old_run)
    downgrade_to(old_run, "trace_v1_1_a", V1_1_A._tables())
    before = old_run.read_bytes()
    assert _figures(old_run, head_base) == _figures(head_run, head_base)
    assert old_run.read_bytes() == before


def test_a_trace_holding_turn_events_refuses_the_downgrade_to_trace_v1_1_a_and_keeps_them(tmp_path):
    path = tmp_path / TRACE_FILENAME
    with Tracer(path) as tr:
        tr.emit("call_finished", group_id=1, prompt_id=1, generation_index=0, attempt=0, turn=0, tokens=4)
    with pytest.raises(RuntimeError, match=r"trace_v1_1_a has no table for \(\{'call_finished': 1\}\)"):
        downgrade_to(path, "trace_v1_1_a", V1_1_A._tables())
    # One transaction: the step down from head is rolled back with the refused one.
    assert rows(path, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert rows(path, "SELECT prompt_id, tokens FROM call_finished") == [(1, 4)]


def test_a_trace_v1_2_a_file_upgrades_to_trace_v1_3_a_with_every_row_kept_and_shows_call_fallback(tmp_path):
    run, _ = _job(tmp_path, "v1_2_a")
    downgrade_to(run, "trace_v1_2_a", v1_2_a_tables())
    assert rows(run, "SELECT version_num FROM alembic_version") == [("trace_v1_2_a",)]
    before = _every_row(run)
    assert "call_fallback" not in before and len(before["events"]) == 53

    upgrade_to(run, "trace_v1_3_a")

    assert rows(run, "SELECT version_num FROM alembic_version") == [("trace_v1_3_a",)]
    after = _every_row(run)
    assert {k: v for k, v in after.items() if k != "call_fallback"} == before
    assert after["call_fallback"] == []
    assert rows(run, "PRAGMA foreign_key_check") == []
    with contextlib.closing(sqlite3.connect(run)) as conn, conn:
        conn.execute("INSERT INTO runs VALUES (9, 'r9', 1, 'h', 600.0, 600.0, 60)")
        conn.execute("INSERT INTO call_fallback VALUES (60, 600.0, 9, 17, 2, 'restart_only_server:restarts')")
    (view,) = rows(run, "SELECT run_id, event, reason, fields FROM events WHERE event = 'call_fallback'")
    assert view[:3] == ("r9", "call_fallback", "restart_only_server:restarts")
    assert json.loads(view[3]) == {"attempt_id": 17, "turn": 2}


def test_a_trace_holding_a_call_fallback_refuses_the_downgrade_to_trace_v1_2_a_and_keeps_it(tmp_path):
    path = tmp_path / TRACE_FILENAME
    with Tracer(path) as tr:
        tr.emit("call_fallback", attempt_id=3, turn=0, reason="restart_only_server:restarts")
    with pytest.raises(RuntimeError, match=r"trace_v1_2_a has no table for \(\{'call_fallback': 1\}\)"):
        downgrade_to(path, "trace_v1_2_a", v1_2_a_tables())
    assert rows(path, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert rows(path, "SELECT attempt_id, turn, reason FROM call_fallback") == [(3, 0, "restart_only_server:restarts")]


def _old_columns(path, since=(V1_4_A, V1_5_A)) -> dict[str, list]:
    """Every row of every table and view as the revision before `since` had them: the
    columns those revisions append left out, the `events` view's JSON without their keys."""
    new: dict[str, set[str]] = {}
    for revision in since:
        for t, cols in revision.NEW_COLUMNS.items():
            new.setdefault(t, set()).update(c for c, _ in cols)
    out = {}
    for name, table_rows in _every_row(path).items():
        if name == "events":
            out[name] = sorted(((*r[:-1], json.dumps({k: v for k, v in json.loads(r[-1]).items()
                                                        if k not in new.get(r[3], ())}, sort_keys=True)
                                 if r[-1] is not None else None) for r in table_rows), key=repr)
            continue
        cols = [c for (_, c, *_rest) in rows(path, f"PRAGMA table_info({name})")]
        keep = [i for i, c in enumerate(cols) if c not in new.get(name, ())]
        out[name] = sorted((tuple(r[i] for i in keep) for r in table_rows), key=repr)
    return out


def test_a_trace_v1_3_a_file_upgrades_to_trace_v1_4_a_with_every_row_kept_and_the_new_columns_empty(tmp_path):
    run, _ = _job(tmp_path, "v1_3_a")
    with Tracer(run) as tr:  # at head: a fallback with no value in trace_v1_4_a's columns
        tr.emit("call_fallback", t=600.0, attempt_id=17, turn=2, reason="turn_not_committed")
    downgrade_to(run, "trace_v1_3_a", v1_3_a_tables())
    before = _old_columns(run)
    assert len(before["call_fallback"]) == 1

    run_trace_migrations(run)

    assert rows(run, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert _old_columns(run) == before
    for table, cols in V1_4_A.NEW_COLUMNS.items():
        assert rows(run, f"SELECT count(*) FROM {table} WHERE " + " OR ".join(f"{c} IS NOT NULL" for c, _ in cols)) \
            == [(0,)], table
    assert rows(run, "PRAGMA foreign_key_check") == []
    # A new run's fallback carries its attempt and cost, and the `events` view shows them.
    with Tracer(run) as again:
        again.emit("call_fallback", t=700.0, attempt_id=18, turn=1, reason="turn_not_committed", group_id=4,
                   prompt_id=40, generation_index=1, attempt=0, step=3, policy_version=3, tokens=12)
    (view,) = rows(run, "SELECT prompt_id, generation_index, attempt, fields FROM events "
                        "WHERE event = 'call_fallback' AND t = 700.0")
    assert view[:3] == (40, 1, 0)
    assert json.loads(view[3]) == {"attempt_id": 18, "turn": 1, "tokens": 12}


def test_a_trace_holding_a_fallbacks_tokens_refuses_the_downgrade_to_trace_v1_3_a_and_keeps_them(tmp_path):
    path = tmp_path / TRACE_FILENAME
    with Tracer(path) as tr:
        tr.emit("call_fallback", attempt_id=3, turn=0, reason="turn_not_committed", tokens=9)
        tr.emit("restore_done", step=1, policy_version=1, cut_time=5.0, decoded_at=4.9)
    with pytest.raises(RuntimeError, match=r"trace_v1_3_a has no column for \(\{'restore_done': 1, 'call_fallback': 1\}\)"):
        downgrade_to(path, "trace_v1_3_a", v1_3_a_tables())
    assert rows(path, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert rows(path, "SELECT tokens FROM call_fallback") == [(9,)]
    assert rows(path, "SELECT decoded_at FROM restore_done") == [(4.9,)]


def test_a_trace_v1_4_a_file_upgrades_to_trace_v1_5_a_with_every_row_kept_and_no_call_marked_continued(tmp_path):
    run, _ = _job(tmp_path, "v1_4_a")
    with Tracer(run) as tr:  # at head: a finished call with no value in trace_v1_5_a's column
        tr.emit("call_finished", t=600.0, group_id=4, prompt_id=40, generation_index=1, attempt=0, step=3,
                policy_version=3, turn=0, tokens=5, finish_reason="stop")
    downgrade_to(run, "trace_v1_4_a", v1_4_a_tables())
    before = _old_columns(run, since=(V1_5_A,))
    assert len(before["call_finished"]) >= 1

    run_trace_migrations(run)

    assert rows(run, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert _old_columns(run, since=(V1_5_A,)) == before
    assert rows(run, "SELECT count(*) FROM call_finished WHERE prefix_exactness IS NOT NULL") == [(0,)]
    # A new run's continued call says how it continued, and the `events` view shows it.
    with Tracer(run) as again:
        again.emit("call_finished", t=700.0, group_id=4, prompt_id=40, generation_index=1, attempt=1, step=3,
                   policy_version=3, turn=0, tokens=7, finish_reason="length", prefix_exactness="bitwise")
    (view,) = rows(run, "SELECT fields FROM events WHERE event = 'call_finished' AND t = 700.0")
    assert json.loads(view[0])["prefix_exactness"] == "bitwise"


def test_a_trace_holding_a_continued_calls_exactness_refuses_the_downgrade_to_trace_v1_4_a_and_keeps_it(tmp_path):
    path = tmp_path / TRACE_FILENAME
    with Tracer(path) as tr:
        tr.emit("call_finished", group_id=1, prompt_id=1, generation_index=0, attempt=1, step=1, policy_version=1,
                turn=0, tokens=3, finish_reason="stop", prefix_exactness="distribution")
    with pytest.raises(RuntimeError, match=r"trace_v1_4_a has no column for \(\{'call_finished': 1\}\)"):
        downgrade_to(path, "trace_v1_4_a", v1_4_a_tables())
    assert rows(path, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert rows(path, "SELECT prefix_exactness FROM call_finished") == [("distribution",)]


def _indexes(path) -> dict[str, tuple]:
    """Index name -> (table, its key columns), read from the file."""
    return {name: (table, tuple(r[2] for r in rows(path, f"PRAGMA index_info({name})")))
            for name, table in rows(path, "SELECT name, tbl_name FROM sqlite_master "
                                          "WHERE type = 'index' AND sql IS NOT NULL")}


def test_a_trace_v1_5_a_file_upgrades_to_trace_v1_6_a_with_every_row_kept_and_its_attempt_indexes_keyed_by_group(tmp_path):
    run, base = _job(tmp_path, "v1_5_a")
    head_rows, head_indexes, head_figures = _every_row(run), _indexes(run), _figures(run, base)
    downgrade_to(run, "trace_v1_5_a", v1_5_a_tables())
    assert rows(run, "SELECT version_num FROM alembic_version") == [("trace_v1_5_a",)]
    old = _indexes(run)
    assert old["ix_call_finished_prompt_id_generation_index_attempt"] == (
        "call_finished", ("prompt_id", "generation_index", "attempt"))
    assert old["ix_group_reserved_prompt_id"] == ("group_reserved", ("prompt_id",))
    assert _every_row(run) == head_rows
    assert _figures(run, base) == head_figures  # read through an upgraded copy

    run_trace_migrations(run)  # a run appending to it upgrades it in place

    assert rows(run, "SELECT version_num FROM alembic_version") == [(HEAD,)]
    assert _every_row(run) == head_rows
    assert _indexes(run) == head_indexes
    for table in V1_6_A.PER_ATTEMPT:
        assert head_indexes[f"ix_{table}_group_id_generation_index_attempt"] == (
            table, ("group_id", "generation_index", "attempt"))
    assert not any(key[0] == "prompt_id" for _, key in head_indexes.values())
    assert _figures(run, base) == head_figures
