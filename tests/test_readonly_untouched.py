"""Read-only means read-only: `inspect`, `verify` and `trace` on a file that a live
process holds open (so its -wal and -shm exist) change no byte and no mtime of the file,
its -wal or its -shm; a stray -wal beside a published snapshot file is not read, and
that is said in one line on stderr."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rolloutdb.store import Store
from rolloutdb.store.checkpoints.manifest import KIND_SNAPSHOT, Manifest, describe_files
from rolloutdb.store.sqlite.revision import head_revision

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
HEAD = head_revision()
DEADLINE_S = 60


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutdb", *map(str, args)], capture_output=True, text=True,
                          timeout=180, cwd=cwd)


def three_files(path: Path) -> dict[str, tuple[str, int, int]]:
    """sha256, size and mtime of the file, its -wal and its -shm."""
    out = {}
    for suffix in ("", "-wal", "-shm"):
        p = Path(f"{path}{suffix}")
        st = p.stat()
        out[suffix or "main"] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_size, st.st_mtime_ns)
    return out


# A writer that commits, then sits idle with its connection (and so the -wal and -shm)
# open until its stdin closes. No checkpoint runs, so the WAL holds the commits.
HOLDER = textwrap.dedent("""
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    for sql in sys.argv[2:]:
        conn.execute(sql)
    print("ready", flush=True)
    sys.stdin.read()
""")


class Holder:
    def __init__(self, path: Path, *statements: str):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), *statements],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()  # returns at EOF too: a dead holder fails here
        assert line == "ready", f"holder did not start (exit {self.proc.poll()})"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=DEADLINE_S)


@pytest.fixture
def live_store(tmp_path):
    """A store file held open by another process with committed rows only in its WAL."""
    path = tmp_path / "run" / "live.sqlite"
    Store.create(path, replay_capacity=8).close()
    holder = Holder(path, "INSERT INTO step_shortfall (step, needed) VALUES (41, 3)",
                    "INSERT INTO step_shortfall (step, needed) VALUES (42, 5)")
    assert Path(f"{path}-wal").stat().st_size > 0 and Path(f"{path}-shm").exists()
    yield path
    holder.close()


@pytest.mark.parametrize("args", [["inspect"], ["inspect", "--sql", "SELECT step, needed FROM step_shortfall"],
                                  ["verify"]])
def test_inspect_and_verify_of_a_live_store_change_no_byte_or_mtime_of_its_three_files(live_store, args):
    before = three_files(live_store)
    time.sleep(0.05)  # an mtime written now would differ from the one recorded
    result = cli(*args, live_store)
    assert result.returncode == 0, result.stderr
    assert three_files(live_store) == before
    if "--sql" in args:  # the committed rows in the WAL were read
        assert "41" in result.stdout and "42" in result.stdout


def test_inspect_of_a_store_whose_writer_keeps_committing_reads_a_consistent_state(tmp_path):
    """The private copy of file + WAL is taken while a writer commits and checkpoints:
    every read sees whole transactions (the pair of rows each one writes)."""
    path = tmp_path / "live.sqlite"
    Store.create(path, replay_capacity=8).close()
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sqlite3, sys
        conn = sqlite3.connect({str(path)!r}, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA wal_autocheckpoint = 20")
        print("ready", flush=True)
        i = 0
        while True:
            i += 1
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO step_shortfall (step, needed) VALUES (?, 1)", (2 * i,))
            conn.execute("INSERT INTO step_shortfall (step, needed) VALUES (?, 1)", (2 * i + 1,))
            conn.execute("COMMIT")
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        for _ in range(5):
            result = cli("inspect", "--json", "--sql", "SELECT count(*) AS n FROM step_shortfall", path)
            assert result.returncode == 0, result.stderr
            assert json.loads(result.stdout)["rows"][0][0] % 2 == 0
    finally:
        writer.kill()
        writer.wait(timeout=DEADLINE_S)


def test_trace_of_a_live_trace_file_changes_no_byte_or_mtime_of_its_three_files(tmp_path):
    """The run's own Tracer writes the trace and stays open (as in a training run), its
    background checkpoints stopped so that only the command under test could change a
    byte."""
    run_dir = tmp_path / "run"
    trace = run_dir / "logs" / "rollout_trace.sqlite"
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_trace_analysis import write_run_a
        tracer = write_run_a({str(trace)!r})
        assert tracer.flush()
        # Quiet from here on: no background checkpoint changes the files while we compare.
        tracer._db._checkpointer.stop()
        print("ready", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready", writer.poll()
        before = three_files(trace)
        time.sleep(0.05)
        result = cli("trace", run_dir, "--out", tmp_path / "plots")
        assert result.returncode == 0, result.stderr
        assert three_files(trace) == before
    finally:
        writer.stdin.close()
        writer.wait(timeout=DEADLINE_S)


# ----------------------------------------------------------------------------- a stray WAL


def published_snapshot(tmp_path: Path) -> Path:
    """A snapshot directory holding a store file and a manifest listing it."""
    snap = tmp_path / "snapshot_1"
    snap.mkdir()
    db = snap / "rollout_state.sqlite"
    shutil.copyfile(FIXTURES / f"store_{HEAD}.sqlite", db)
    manifest = Manifest(kind=KIND_SNAPSHOT, anchor="bootstrap", sequence=1, files=describe_files(snap),
                        schema_revision=HEAD, cut_time=1.0)
    (snap / "manifest.json").write_bytes(manifest.to_json())
    return db


def stray_wal(db: Path, tmp_path: Path) -> None:
    """A WAL made for another copy of the same file, holding a row the published file lacks."""
    other = tmp_path / "other.sqlite"
    shutil.copyfile(db, other)
    holder = Holder(other, "INSERT INTO step_shortfall (step, needed) VALUES (777, 1)")
    try:
        shutil.copyfile(f"{other}-wal", f"{db}-wal")
    finally:
        holder.proc.kill()
        holder.proc.wait(timeout=DEADLINE_S)


def test_a_stray_wal_beside_a_published_snapshot_is_ignored_by_inspect_and_said_so_in_one_line(tmp_path):
    db = published_snapshot(tmp_path)
    stray_wal(db, tmp_path)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in db.parent.iterdir()}
    result = cli("inspect", db, "--sql", "SELECT count(*) FROM step_shortfall WHERE step = 777")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("warning: ") and f"{db}-wal: ignored" in lines[0] and "published" in lines[0]
    assert result.stdout.split()[-3] == "0"  # the WAL's row was not read
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in db.parent.iterdir()} == before


def test_verify_of_a_published_snapshot_with_a_stray_wal_ignores_it_for_reading_and_fails_on_it(tmp_path):
    """verify reads the published file as published, and the extra file in the snapshot
    is a problem (a restore refuses a snapshot with an unlisted file too)."""
    db = published_snapshot(tmp_path)
    stray_wal(db, tmp_path)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in db.parent.iterdir()}
    result = cli("verify", db)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len([line for line in lines if line.startswith("warning: ") and "ignored" in line]) == 1, result.stderr
    assert any(line.startswith(f"error: {db}-wal: not listed in the manifest") for line in lines), result.stderr
    assert "Traceback" not in result.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in db.parent.iterdir()} == before
