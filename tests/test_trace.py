"""The trace writer: its file, its schema versions, its batching and what a SIGKILL costs.

Persisted state is always read through a second sqlite3 connection."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import signal
import sqlite3
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from rolloutdb.store.trace import queries as trace_queries
from rolloutdb.store.trace.analysis import attempt_rows_sql
from rolloutdb.store.trace.events import EVENTS, trace_metadata
from rolloutdb.store.trace.writer import (
    TRACE_FILENAME,
    NullTracer,
    TraceError,
    Tracer,
    open_trace_file,
    open_tracer,
    trace_file_for,
)
from rolloutdb.store.sqlite.revision import trace_head_revision

REPO = Path(__file__).resolve().parents[1]


def rows(path, sql, *args):
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql, args).fetchall()


def test_a_new_trace_file_is_built_by_its_migrations_and_equals_the_trace_metadata(tmp_path):
    path = open_trace_file(tmp_path / "logs" / TRACE_FILENAME)
    assert rows(path, "SELECT version_num FROM alembic_version") == [("trace_v1_6_a",)]
    assert trace_head_revision() == "trace_v1_6_a"
    engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, trace_metadata) == []
    finally:
        engine.dispose()


# Columns whose values grow as a run goes: an index led by one takes new rows at its end
# (group ids are the live store's AUTOINCREMENT keys, steps and policy versions grow with
# training, seq and t with every event, run with every process).
APPEND_ORDER_COLUMNS = frozenset({"seq", "t", "run", "group_id", "step", "policy_version"})


def test_every_trace_index_leads_with_a_column_that_grows_as_the_run_goes(tmp_path):
    # A key drawn at random (a prompt id) puts each new row on a random page of the whole
    # index: a page read and write per event once the trace outgrows the cache (23-29 ms
    # per 1000-row batch at 3M rows, BENCHMARKS.md "Per-event costs"). Read from the file
    # the migrations build, not from events.py alone.
    path = open_trace_file(tmp_path / TRACE_FILENAME)
    leading = {name: rows(path, f"PRAGMA index_info({name})")[0][2]
               for (name,) in rows(path, "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")}
    assert leading, "the trace has no index at all: the analysis's look-ups would scan"
    random_keyed = {name: col for name, col in leading.items() if col not in APPEND_ORDER_COLUMNS}
    assert random_keyed == {}, f"indexes led by a column a run does not write in order: {random_keyed}"
    for table in ("attempt_dispatched", "call_finished", "turn_committed"):
        assert leading[f"ix_{table}_group_id_generation_index_attempt"] == "group_id"


def test_the_analysis_reads_an_abandoned_attempts_rows_by_index_search_not_by_scanning_the_trace(tmp_path):
    path = open_trace_file(tmp_path / TRACE_FILENAME)
    keys = [[7, 70, 1, 0], [8, 80, 0, 2]]
    with contextlib.closing(sqlite3.connect(path)) as conn:
        for table in ("attempt_dispatched", "call_finished", "turn_committed"):
            columns = trace_queries.BASE_COLUMNS[table].split(", ")
            plan = " | ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + attempt_rows_sql(table, columns, keys)))
            assert f"SEARCH d USING INDEX ix_{table}_group_id_generation_index_attempt" in plan, plan
            assert "SCAN d" not in plan and "AUTOMATIC" not in plan, plan


def test_events_from_many_threads_are_all_written_with_the_run_id_and_common_columns(tmp_path):
    tracer = open_tracer(tmp_path)

    def worker(k):
        for i in range(200):
            tracer.emit("attempt_dispatched", prompt_id=k, generation_index=i, attempt=0, group_id=k, policy_version=3)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
        assert not th.is_alive(), "a tracing thread did not finish in 60 s"
    assert tracer.flush()
    path = tmp_path / TRACE_FILENAME
    # Seen by another connection while the tracer is still open: the batches are committed.
    got = rows(path, "SELECT prompt_id, count(*), count(DISTINCT generation_index), min(policy_version) FROM events "
                     "WHERE event = 'attempt_dispatched' GROUP BY prompt_id")
    assert got == [(k, 200, 200, 3) for k in range(8)]
    assert rows(path, "SELECT DISTINCT run_id FROM events") == [(tracer.run_id,)]
    assert rows(path, "SELECT count(*), min(seq), max(seq) FROM events") == [(1601, 1, 1601)]
    tracer.close()
    assert tracer.dropped == 0


def test_each_process_gets_a_new_run_id_and_appends_to_the_same_file(tmp_path):
    first = Tracer(tmp_path / TRACE_FILENAME)
    first.emit("group_sealed", group_id=1, prompt_id=7)
    first.close()
    second = Tracer(tmp_path / TRACE_FILENAME)
    second.emit("group_sealed", group_id=2, prompt_id=8)
    second.close()
    assert first.run_id != second.run_id
    got = rows(tmp_path / TRACE_FILENAME, "SELECT run_id, event, group_id FROM events ORDER BY seq")
    assert got == [
        (first.run_id, "run_started", None),
        (first.run_id, "group_sealed", 1),
        (second.run_id, "run_started", None),
        (second.run_id, "group_sealed", 2),
    ]
    pid, host = json.loads(rows(tmp_path / TRACE_FILENAME, "SELECT fields FROM events WHERE seq = 1")[0][0]).values()
    assert pid == os.getpid() and host


def test_each_event_is_a_row_of_its_own_table_with_a_column_per_field_and_lists_as_rows(tmp_path):
    with Tracer(tmp_path / TRACE_FILENAME, clock=lambda: 1.0) as tracer:
        tracer.emit("group_published", t=5.0, group_id=4, prompt_id=9, version_token_counts={2: 30, 3: 12}, tokens=42)
        tracer.emit("train_step", t=6.0, step=3, policy_version=2, group_ids=[4, 5], batch_age=0.25)
        tracer.emit("attempt_abandoned", t=7.0, prompt_id=9, generation_index=1, attempt=0, reason="restart")
        tracer.emit("refit", t=8.0, old_version=2, new_version=3, running=[{"prompt_id": 9, "tokens": 4}])
    path = tmp_path / TRACE_FILENAME
    assert rows(path, "SELECT seq, t, run, group_id, prompt_id, step, policy_version, tokens FROM group_published") == [
        (2, 5.0, 1, 4, 9, None, None, 42)]
    assert rows(path, "SELECT seq, policy_version, tokens FROM published_tokens ORDER BY 2") == [(2, 2, 30), (2, 3, 12)]
    assert rows(path, "SELECT seq, step, policy_version, batch_age, tokens FROM train_step") == [(3, 3, 2, 0.25, None)]
    assert rows(path, "SELECT seq, group_id FROM trained_groups ORDER BY 2") == [(3, 4), (3, 5)]
    assert rows(path, "SELECT reason, tokens FROM attempt_abandoned") == [("restart", None)]
    assert json.loads(rows(path, "SELECT running FROM refit")[0][0]) == [{"prompt_id": 9, "tokens": 4}]
    # The run: one row, its first and last event and last seq kept by the writer.
    (run,) = rows(path, "SELECT run, run_id, pid, first_t, last_t, last_seq FROM runs")
    assert run[0] == 1 and run[1] == tracer.run_id and run[2] == os.getpid() and run[3:] == (1.0, 8.0, 5)
    # The `events` view: every event in one table, in the shape of trace_v1_0_a.
    view = rows(path, "SELECT seq, run_id, event, prompt_id, group_id, reason, fields FROM events WHERE seq > 1 ORDER BY seq")
    assert [r[:6] for r in view] == [(2, tracer.run_id, "group_published", 9, 4, None),
                                     (3, tracer.run_id, "train_step", None, None, None),
                                     (4, tracer.run_id, "attempt_abandoned", 9, None, "restart"),
                                     (5, tracer.run_id, "refit", None, None, None)]
    assert json.loads(view[0][6]) == {"tokens": 42}
    assert json.loads(view[3][6])["running"] == [{"prompt_id": 9, "tokens": 4}]


def test_a_caller_cannot_change_an_event_after_emitting_it(tmp_path):
    running = [{"prompt_id": 1, "tokens": 3}]
    with Tracer(tmp_path / TRACE_FILENAME, flush_interval=0.5) as tracer:
        tracer.emit("refit", old_version=0, new_version=1, running=running)
        running[0]["tokens"] = 99
    running = rows(tmp_path / TRACE_FILENAME, "SELECT running FROM refit")[0][0]
    assert json.loads(running) == [{"prompt_id": 1, "tokens": 3}]


def test_an_unknown_event_or_field_is_refused_where_it_is_emitted(tmp_path):
    with Tracer(tmp_path / TRACE_FILENAME) as tracer:
        with pytest.raises(ValueError, match="unknown trace event 'group_sealde'"):
            tracer.emit("group_sealde", group_id=1)
        with pytest.raises(ValueError, match=r"has no field\(s\) \['colour'\]"):
            tracer.emit("group_sealed", group_id=1, colour="red")
    assert rows(tmp_path / TRACE_FILENAME, "SELECT count(*) FROM events WHERE event != 'run_started'") == [(0,)]


def test_with_tracing_off_nothing_is_written(tmp_path):
    tracer = open_tracer(tmp_path / "logs", enabled=False)
    assert isinstance(tracer, NullTracer) and not tracer.enabled
    tracer.emit("anything at all", whatever=1)
    assert tracer.flush()
    tracer.close()
    assert not (tmp_path / "logs").exists()


def test_a_closed_trace_is_left_whole_without_side_files(tmp_path):
    with open_tracer(tmp_path) as tracer:
        tracer.emit("group_reserved", group_id=1, prompt_id=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [TRACE_FILENAME]
    assert rows(tmp_path / TRACE_FILENAME, "PRAGMA integrity_check") == [("ok",)]
    assert rows(tmp_path / TRACE_FILENAME, "PRAGMA journal_mode") == [("delete",)]


def test_a_file_that_is_not_a_trace_is_refused_and_left_unchanged(tmp_path):
    other = tmp_path / TRACE_FILENAME
    with contextlib.closing(sqlite3.connect(other)) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.execute("INSERT INTO alembic_version VALUES ('v1_1_a')")
        conn.commit()
    before = other.read_bytes()
    with pytest.raises(TraceError, match="not a rolloutdb trace file"):
        Tracer(other)
    assert other.read_bytes() == before
    other.write_bytes(b"not sqlite at all" * 10)
    with pytest.raises(TraceError, match="not a SQLite database"):
        Tracer(other)


def test_a_trace_written_by_a_newer_rolloutdb_is_refused(tmp_path):
    path = open_trace_file(tmp_path / TRACE_FILENAME)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'trace_v9_0_a'")
        conn.commit()
    with pytest.raises(TraceError, match="trace_v9_0_a is newer than this rolloutdb knows"):
        Tracer(path)


def test_a_run_directory_or_its_log_directory_leads_to_the_trace_file(tmp_path):
    (tmp_path / "logs").mkdir()
    with pytest.raises(TraceError, match="no trace file"):
        trace_file_for(tmp_path)
    with pytest.raises(TraceError, match="no such directory"):
        trace_file_for(tmp_path / "missing")
    open_trace_file(tmp_path / "logs" / TRACE_FILENAME)
    assert trace_file_for(tmp_path) == tmp_path / "logs" / TRACE_FILENAME
    assert trace_file_for(tmp_path / "logs") == tmp_path / "logs" / TRACE_FILENAME


def test_every_event_and_field_is_documented_in_docs_trace_md():
    doc = (REPO / "docs" / "trace.md").read_text(encoding="utf-8")
    for event, fields in EVENTS.items():
        section = re.search(rf"^### `{event}`\n(.*?)(?=^### |\Z)", doc, re.S | re.M)
        assert section, f"docs/trace.md has no section for {event}"
        for field in fields:
            assert f"`{field}`" in section.group(1), f"docs/trace.md: {event} does not describe {field}"


# --------------------------------------------------------------------------- SIGKILL

_CHILD = textwrap.dedent(
    """
    import mmap, struct, sys, time
    from rolloutdb.store.trace.writer import Tracer
    tracer = Tracer(sys.argv[1])
    with open(sys.argv[2], "r+b") as f:
        progress = mmap.mmap(f.fileno(), 16)
    i = 0
    while True:
        t = time.time()
        tracer.emit("attempt_dispatched", t=t, prompt_id=i, generation_index=0, attempt=0)
        progress[:16] = struct.pack("<qd", i, t)  # the last event handed to the tracer
        i += 1
        time.sleep(0.0002)
    """
)


def test_a_sigkilled_run_leaves_an_intact_trace_missing_only_its_last_milliseconds(tmp_path):
    path = tmp_path / TRACE_FILENAME
    progress_file = tmp_path / "progress"
    progress_file.write_bytes(b"\0" * 16)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(progress_file)])
    try:
        with open(progress_file, "r+b") as f:
            progress = mmap.mmap(f.fileno(), 16)
            deadline = time.monotonic() + 60
            while struct.unpack("<qd", progress[:16])[0] < 3000 and time.monotonic() < deadline:
                assert child.poll() is None, "the writing child died on its own"
                time.sleep(0.01)
            # Freeze it, read how far it got, then kill it: nothing runs in between.
            os.kill(child.pid, signal.SIGSTOP)
            last_index, last_t = struct.unpack("<qd", progress[:16])
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert last_index >= 3000, f"the child emitted only {last_index + 1} events in 60 s"
    assert rows(path, "PRAGMA integrity_check") == [("ok",)]
    kept = [r[0] for r in rows(path, "SELECT prompt_id FROM events WHERE event = 'attempt_dispatched' ORDER BY seq")]
    # A prefix of what was emitted, in order: no gap, nothing torn, nothing invented.
    assert kept == list(range(len(kept)))
    assert len(kept) <= last_index + 1
    newest_kept = rows(path, "SELECT max(t) FROM events")[0][0]
    # What was lost is the tail the writer had not committed yet: batches commit every
    # few milliseconds (FLUSH_INTERVAL_S); the bound here leaves room for a loaded machine.
    assert last_t - newest_kept < 0.5, f"lost the last {last_t - newest_kept:.3f} s of events"
    # The next run appends to the killed run's file.
    with Tracer(path) as again:
        again.emit("restore_done", snapshot_seq=1, cut_time=newest_kept)
    assert rows(path, "SELECT count(DISTINCT run_id) FROM events") == [(2,)]
