"""A trace written at revision trace_v1_0_a (one `events` table) is still read: the
analysis upgrades a copy and gives the same figures, and a new run appending to it
upgrades the file in place.

The trace_v1_0_a file is the hand-built job of test_trace_analysis, written at head and
taken down to trace_v1_0_a by the real migrations (Alembic downgrade), then checked to
have exactly trace_v1_0_a's schema; it holds the same events and run ids as the file it
came from, so the figures must be equal to the last digit.
"""

from __future__ import annotations

import contextlib
import importlib
import shutil
import sqlite3

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, event
from sqlalchemy.pool import NullPool

from rolloutdb.store.trace import queries as trace_queries
from rolloutdb.store.trace.analysis import TraceAnalysis
from rolloutdb.store.sqlite.revision import trace_alembic_config
from rolloutdb.store.trace.writer import TRACE_FILENAME, Tracer
from test_trace_analysis import write_baseline, write_run_a, write_run_b

V1_0_A = importlib.import_module("rolloutdb.migrations.trace.versions.trace_v1_0_a_events")


def rows(path, sql):
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql).fetchall()


def downgrade_to_v1_0_a(path) -> None:
    engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _fk_off(dbapi_conn, _record):  # noqa: ANN001
        dbapi_conn.execute("PRAGMA foreign_keys = OFF")

    try:
        with engine.begin() as conn:
            cfg = trace_alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "trace_v1_0_a")
        with engine.connect() as conn:  # exactly trace_v1_0_a's tables, nothing else
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), V1_0_A._tables())
            assert diff == [], diff
    finally:
        engine.dispose()


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


def test_a_run_appending_to_a_trace_v1_0_a_file_upgrades_it_in_place_and_keeps_every_event(tmp_path):
    run, _ = _job(tmp_path, "old")
    downgrade_to_v1_0_a(run)
    old = rows(run, "SELECT seq, t, run_id, event, prompt_id, generation_index, group_id, attempt, step, "
                    "policy_version, reason FROM events ORDER BY seq")
    with Tracer(run) as again:
        again.emit("group_sealed", group_id=99, prompt_id=99)
    assert rows(run, "SELECT version_num FROM alembic_version") == [("trace_v1_2_a",)]
    # Every old event, now read through the `events` view, then the new run's two.
    new = rows(run, "SELECT seq, t, run_id, event, prompt_id, generation_index, group_id, attempt, step, "
                    "policy_version, reason FROM events ORDER BY seq")
    assert new[:len(old)] == old
    assert [(r[0], r[2], r[3]) for r in new[len(old):]] == [(54, again.run_id, "run_started"),
                                                            (55, again.run_id, "group_sealed")]
    assert rows(run, "SELECT run, last_seq FROM runs ORDER BY run") == [(1, 31), (2, 53), (3, 55)]
    assert rows(run, "PRAGMA integrity_check") == [("ok",)]
