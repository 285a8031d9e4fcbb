"""A signal during a DuckDB query interrupts DuckDB instead of raising into it
(store/trace/interrupts.py).

DuckDB's Python client runs Python's signal handlers inside its execution loop. A handler
that raised there crossed DuckDB's frames: `rolloutdb sql` then died of SIGSEGV at exit or
hung deaf to every signal (seen 2026-12-04, once in a CI run; the subprocess tests are in
tests/test_cli_run_dirs.py and catch it only now and then, as races do). These tests pin
the mechanism itself, in this process and without ever raising into DuckDB: the handler
the caller had in place must run after the query, from `interruptible`, never inside it.
The test's handler only records and returns, so even the planted bug cannot hang here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from rolloutdb.store import AttachedFiles, QueryTimeout

RUNAWAY = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


@pytest.fixture
def attached(tmp_path: Path):
    db = tmp_path / "small.sqlite"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
        conn.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(100)])
        conn.commit()
    with AttachedFiles({"small": db}, default="small") as files:
        yield files


@pytest.fixture
def recording_handler():
    """A SIGINT handler that records the frame it ran in and returns (raises nothing)."""
    frames = []
    previous = signal.signal(signal.SIGINT, lambda _signum, frame: frames.append(frame))
    try:
        yield frames
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_sigint_mid_query_stops_it_and_runs_the_callers_handler_after_the_query_not_inside_duckdb(
        attached, recording_handler):
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        # The caller's handler ignores the signal: the query still stops (KeyboardInterrupt),
        # well before its time limit. Before the fix the handler ran inside DuckDB's loop,
        # returned, and the query ran on to its limit (QueryTimeout).
        with pytest.raises(KeyboardInterrupt):
            attached.query(RUNAWAY, timeout_s=20)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 19, "stopped by its time limit, not by the signal"
    assert len(recording_handler) == 1
    assert Path(recording_handler[0].f_code.co_filename).name == "interrupts.py"
    assert signal.getsignal(signal.SIGINT) is not None and attached.query("SELECT count(*) FROM t").rows == [(100,)]


def test_a_stop_signal_recorded_before_the_query_stops_it_as_if_it_came_during_it(attached, recording_handler):
    """The signal's own exception was lost (rolloutdb/commands/_stop_signals.py): `stop`
    names it. Without the check the query runs to its time limit (QueryTimeout)."""
    with pytest.raises(KeyboardInterrupt):
        attached.query(RUNAWAY, timeout_s=20, stop=lambda: signal.SIGINT)
    assert len(recording_handler) == 1


def test_the_time_limit_still_stops_a_query_and_leaves_the_callers_handlers_in_place(attached, recording_handler):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(QueryTimeout):
        attached.query(RUNAWAY, timeout_s=0.5)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert recording_handler == []
    assert attached.query("SELECT max(x) FROM t").rows == [(99,)]


@pytest.mark.parametrize("owner", ["sql", "analysis", "sqlite analysis", "inspect"])
def test_a_stop_right_after_the_working_directory_is_made_leaves_no_directory_behind(tmp_path, monkeypatch, owner):
    """`rolloutdb sql`, the trace analysis (DuckDB and SQLite) and a read-only open of a
    file in WAL mode each make a private working directory and remove it on close. A Ctrl-C whose exception is raised the moment the directory
    exists, before its owner held its name, left it behind (`tempfile.mkdtemp`; seen in a
    CI run of test_cli_run_dirs' "while attaching" case). Here the mkdir itself raises
    KeyboardInterrupt once it has made the directory: the worst moment, every time."""
    from rolloutdb.store.sqlite.readonly import _open_private_copy
    from rolloutdb.store.trace.analysis import TraceAnalysis, open_sqlite_analysis
    from rolloutdb.store.trace.writer import Tracer

    trace = tmp_path / "trace.sqlite"
    if "analysis" in owner:
        Tracer(trace).close()
    else:
        with contextlib.closing(sqlite3.connect(trace)) as conn:
            conn.execute("CREATE TABLE t (x INTEGER)")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    real_mkdir = os.mkdir

    def mkdir_then_stop(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        if Path(path).name.startswith("rolloutdb-"):
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "mkdir", mkdir_then_stop)
    with pytest.raises(KeyboardInterrupt):
        if owner == "sql":
            AttachedFiles({"small": trace})
        elif owner == "analysis":
            TraceAnalysis([trace])
        elif owner == "sqlite analysis":
            open_sqlite_analysis([trace])
        else:
            _open_private_copy(trace)
    monkeypatch.undo()
    assert list(scratch.iterdir()) == []
