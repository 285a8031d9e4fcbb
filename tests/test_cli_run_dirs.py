"""`rolloutdb sql` and `rolloutdb inspect` over a real run (the crash harness's small config,
trace on). sql: every store, snapshot, segment and trace file attached under the documented
schema names, a query's result equal to what plain sqlite3 reads from the same file, in
every format, and the run directory byte for byte (and mtime for mtime) as it was, a live
writer's WAL included. inspect: a run directory, a snapshot directory and the trace file
(or the logs/ directory holding it) are summarised."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lost_ctrl_c
from train_cli import assert_one_error_line, digest, env, train


def sql(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutdb", "sql", *args], env=env(), capture_output=True,
                          text=True, timeout=120)


def untouched(root: Path) -> dict:
    """Contents and mtimes of everything under `root`."""
    return {"digest": digest(root),
            "mtimes": {p.as_posix(): p.stat().st_mtime_ns for p in sorted(root.rglob("*")) if p.is_file()}}


def sqlite_rows(path: Path, query: str) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)) as conn:
        return conn.execute(query).fetchall()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sql") / "run"
    # Every checkpoint and snapshot kept: the last ones may find nothing left in flight and
    # reference no segment, and retention then deletes every segment (a fresh-clone CI run
    # ended with snapshot_5 and snapshot_6 and no segment); the early ones, taken with
    # payload in flight, keep theirs.
    result = train(run, overrides=["checkpointing.keep_last=1000", "rollout_checkpointing.keep_last=1000"])
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def snapshot_dirs(run: Path) -> dict[str, Path]:
    return {p.name: p for p in (run / "checkpoints").glob("*/rollout_snapshots/snapshot_*")}


def test_without_a_query_it_lists_every_store_snapshot_segment_and_trace_under_its_documented_name(run_dir):
    before = untouched(run_dir)
    listed = sql(str(run_dir), "--format", "json")
    assert listed.returncode == 0, listed.stderr
    tables = {(r["schema"], r["table"]) for r in json.loads(listed.stdout)}
    segments = {p.stem for p in (run_dir / "checkpoints" / "payload_segments").glob("segment_*.sqlite")}
    snapshots = set(snapshot_dirs(run_dir))
    assert snapshots and segments, "the run published snapshots and sealed payload"
    assert {schema for schema, _ in tables} == {"live", "trace"} | snapshots | segments
    assert ("live", "prompt_groups") in tables and ("trace", "train_step") in tables
    assert all((s, "payload") in tables for s in segments)
    assert untouched(run_dir) == before


def test_a_query_prints_what_sqlite3_reads_from_the_same_file_as_a_table_csv_and_json(run_dir):
    before = untouched(run_dir)
    query = "SELECT group_id, state FROM {}prompt_groups ORDER BY group_id"
    # The snapshot holding the most groups (the last one, after the final step, holds none).
    name, snapshot = max(snapshot_dirs(run_dir).items(),
                         key=lambda kv: len(sqlite_rows(kv[1] / "rollout_state.sqlite", query.format(""))))
    expected = [(g, s) for g, s in sqlite_rows(snapshot / "rollout_state.sqlite", query.format(""))]
    assert expected, "a snapshot holds groups"
    as_csv = sql(str(run_dir), "-q", query.format(f"{name}."), "--format", "csv")
    assert as_csv.returncode == 0, as_csv.stderr
    assert [tuple(r) for r in csv.reader(io.StringIO(as_csv.stdout))] == [("group_id", "state")] + [
        (str(g), s) for g, s in expected]
    # The snapshot directory itself: unqualified names read its file.
    as_json = sql(str(snapshot), query.format(""), "--format", "json")
    assert json.loads(as_json.stdout) == [{"group_id": g, "state": s} for g, s in expected]
    as_table = sql(str(run_dir), query.format(f"{name}."))
    lines = as_table.stdout.splitlines()
    assert lines[0].split() == ["group_id", "state"] and lines[-1] == f"({len(expected)} rows)"
    assert [tuple(line.split()) for line in lines[2:-1]] == [(str(g), s) for g, s in expected]
    assert untouched(run_dir) == before


def test_one_query_joins_the_trace_with_the_live_store_and_a_snapshot_with_its_segments(run_dir):
    trace = run_dir / "logs" / "rollout_trace.sqlite"
    steps = sqlite_rows(trace, "SELECT step, count(*) FROM group_sealed GROUP BY step ORDER BY step")
    joined = sql(str(run_dir), "--format", "json", "-q",
                 "SELECT t.step, count(*) AS n, (SELECT count(*) FROM live.run_meta) AS metas "
                 "FROM trace.group_sealed t GROUP BY t.step ORDER BY t.step")
    assert joined.returncode == 0, joined.stderr
    assert [(r["step"], r["n"], r["metas"]) for r in json.loads(joined.stdout)] == [(s, n, 1) for s, n in steps]
    segment = next((run_dir / "checkpoints" / "payload_segments").glob("segment_*.sqlite"))
    ids = sqlite_rows(segment, "SELECT sample_id, length(token_ids) FROM payload ORDER BY sample_id")
    payload = sql(str(run_dir), "--format", "json", "-q",
                  f"SELECT sample_id, octet_length(token_ids) AS bytes FROM {segment.stem}.payload ORDER BY sample_id")
    assert [(r["sample_id"], r["bytes"]) for r in json.loads(payload.stdout)] == ids


def test_a_live_store_with_a_writer_holding_its_wal_is_read_through_a_copy_and_left_byte_identical(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    writer = sqlite3.connect(run / "rollout_state.sqlite", isolation_level=None)
    try:
        writer.execute("PRAGMA wal_autocheckpoint = 0")
        writer.execute("UPDATE run_meta SET config_fingerprint = 'changed-in-the-wal'")
        assert (run / "rollout_state.sqlite-wal").stat().st_size > 0
        before = untouched(run)
        read = sql(str(run), "--format", "csv", "-q", "SELECT config_fingerprint FROM run_meta")
        assert read.returncode == 0, read.stderr
        assert read.stdout.splitlines() == ["config_fingerprint", "changed-in-the-wal"]
        assert untouched(run) == before
    finally:
        writer.close()


def test_a_finished_runs_live_store_in_wal_mode_gets_no_wal_or_shm_beside_it(run_dir):
    assert not (run_dir / "rollout_state.sqlite-wal").exists()
    before = sorted(os.listdir(run_dir))
    read = sql(str(run_dir), "SELECT count(*) AS n FROM live.run_meta", "--format", "csv")
    assert read.stdout.splitlines() == ["n", "1"], read.stderr
    assert sorted(os.listdir(run_dir)) == before


@pytest.mark.parametrize("query, fragment", [
    ("COPY (SELECT 1) TO '{out}'", "file system operations are disabled"),
    ("ATTACH '{out}' AS other", "file system operations are disabled"),
    ("SELECT * FROM sqlite_scan('{live}', 'run_meta')", "sqlite_scan and sqlite_attach open files by path"),
    ("INSERT INTO live.discard_reasons VALUES (99, 'x')", "read-only"),
    ("SELEC 1", "syntax error"),
])
def test_a_query_that_would_write_or_open_another_file_is_refused_in_one_line_and_writes_nothing(
        run_dir, tmp_path, query, fragment):
    before = untouched(run_dir)
    out = tmp_path / "written.db"
    refused = sql(str(run_dir), query.format(out=out, live=run_dir / "rollout_state.sqlite"))
    assert_one_error_line(refused, fragment)
    assert not out.exists() and untouched(run_dir) == before


def test_a_path_that_holds_no_rolloutdb_file_is_refused_naming_it(tmp_path):
    assert_one_error_line(sql(str(tmp_path / "missing"), "SELECT 1"), "missing: no such file or directory")
    assert_one_error_line(sql(str(tmp_path), "SELECT 1"), f"{tmp_path}: no rolloutdb files in it")
    (tmp_path / "notes.sqlite").write_text("not a database")
    assert_one_error_line(sql(str(tmp_path / "notes.sqlite"), "SELECT 1"), "notes.sqlite: not a readable SQLite file")
    assert sorted(os.listdir(tmp_path)) == ["notes.sqlite"]


# ----------------------------------------------------------------------------- inspect


def inspect(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutdb", "inspect", *map(str, args)], env=env(),
                          capture_output=True, text=True, timeout=120)


def test_inspect_of_a_run_or_snapshot_directory_summarises_its_store_file(run_dir):
    before = untouched(run_dir)
    _, snapshot = sorted(snapshot_dirs(run_dir).items())[-1]
    for directory in (run_dir, snapshot):
        of_dir, of_file = inspect(directory, "--json"), inspect(directory / "rollout_state.sqlite", "--json")
        assert of_dir.returncode == 0, of_dir.stderr
        assert json.loads(of_dir.stdout) == json.loads(of_file.stdout)
    assert json.loads(inspect(snapshot, "--json").stdout)["manifest"]["sequence"] == int(snapshot.name.split("_")[1])
    assert inspect(run_dir).stdout == inspect(run_dir / "rollout_state.sqlite").stdout
    assert untouched(run_dir) == before


def test_inspect_of_the_trace_file_lists_its_runs_and_rows_per_table_as_sqlite3_reads_them(run_dir):
    before = untouched(run_dir)
    trace = run_dir / "logs" / "rollout_trace.sqlite"
    doc = json.loads(inspect(trace, "--json").stdout)
    assert doc["kind"] == "trace" and doc["revision_status"] == "head"
    runs = sqlite_rows(trace, "SELECT run, pid, last_seq FROM runs ORDER BY run")
    assert [(r["run"], r["pid"], r["last_seq"]) for r in doc["runs"]] == runs and len(runs) == 1
    for table in ("train_step", "group_sealed", "rollout_finished"):
        assert doc["row_counts"][table] == sqlite_rows(trace, f"SELECT count(*) FROM {table}")[0][0] > 0
    assert json.loads(inspect(run_dir / "logs", "--json").stdout) == doc
    text = inspect(trace)
    assert "a run's trace" in text.stdout and "rolloutdb trace RUN_DIR" in text.stdout, text.stdout
    steps = inspect(trace, "--sql", "SELECT count(*) AS n FROM train_step")
    assert steps.stdout.splitlines()[2].strip() == str(doc["row_counts"]["train_step"]), steps.stderr
    assert untouched(run_dir) == before


def test_inspect_of_a_directory_with_no_store_or_trace_in_it_is_refused_naming_what_to_pass(run_dir, tmp_path):
    for directory in (run_dir / "checkpoints", tmp_path):
        assert_one_error_line(inspect(directory), "is a directory with no rollout_state.sqlite", "a run directory")


RUNAWAY = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


def test_a_runaway_query_stops_at_the_timeout_with_one_line_naming_the_option_and_nothing_written(run_dir):
    before = untouched(run_dir)
    result = sql(str(run_dir), RUNAWAY, "--timeout", "1")
    assert_one_error_line(result, "1 s", "--timeout")
    assert untouched(run_dir) == before


@pytest.mark.parametrize("after_s", [0.0, 0.5, 3.0], ids=["while attaching", "as the query starts", "mid-query"])
@pytest.mark.parametrize(("signum", "code", "line"), [(signal.SIGINT, 130, "error: interrupted"),
                                                       (signal.SIGTERM, 143, "error: terminated (SIGTERM)")],
                         ids=["ctrl-c", "sigterm"])
def test_a_signal_at_any_moment_of_a_runaway_query_ends_it_with_one_line_and_nothing_left_behind(
        run_dir, tmp_path, signum, code, line, after_s):
    """DuckDB's client runs Python's signal handlers inside its execution loop; a handler
    that raised there (the CLI's, or Python's default) crossed DuckDB's frames: seen
    2026-12-04, "error: interrupted" then SIGSEGV at exit, and hangs deaf to any signal (one
    in a CI run). The signal now only interrupts DuckDB (store/trace/interrupts.py). The
    moments count from DuckDB's working directory appearing (the CLI's handlers are in
    place by then)."""
    before = untouched(run_dir)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "rolloutdb", "sql", str(run_dir), RUNAWAY, "--timeout", "60"],
                            env={**env(), "TMPDIR": str(scratch)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 60  # detects a start-up that never comes; not a speed test
        while not any(scratch.glob("rolloutdb-sql-*")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(after_s)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # never leave a runaway query behind (it holds every core)
            proc.kill()
            proc.communicate()
    assert (proc.returncode, err.strip().splitlines()) == (code, [line]), err
    assert out == ""
    assert list(scratch.iterdir()) == []  # its working directory (private copies, DuckDB's) removed
    assert untouched(run_dir) == before


# A Ctrl-C whose KeyboardInterrupt Python loses, planted while the live store is copied for DuckDB.
_LOST_CTRL_C = lost_ctrl_c.script("rolloutdb.store.trace.attached", "standalone")


def test_a_ctrl_c_whose_exception_python_lost_keeps_the_runaway_query_from_starting(run_dir):
    """Without the check (`stop=` of AttachedFiles.query) the query runs to its --timeout
    (600 s here: the run's 120 s limit fails the test first)."""
    proc = subprocess.run([sys.executable, "-c", _LOST_CTRL_C, "sql", str(run_dir), RUNAWAY, "--timeout", "600"],
                          env=env(), capture_output=True, text=True, timeout=120)
    assert "Exception ignored" in proc.stderr, proc.stderr  # the plant worked: the exception was lost
    assert (proc.returncode, proc.stderr.splitlines()[-1]) == (130, "error: interrupted"), proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_a_usage_error(run_dir, value):
    result = sql(str(run_dir), "SELECT 1", f"--timeout={value}")
    assert result.returncode == 2 and "--timeout" in result.stderr and "positive number of seconds" in result.stderr
