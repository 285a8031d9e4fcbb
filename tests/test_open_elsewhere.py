"""Who has a store file open, asked of SQLite's own locks without changing anything
(`rolloutdb.store.sqlite.inuse`), and the refusal to replace a file another process holds: a
restore must not swap the live store under a process that would go on committing into
the unlinked old file."""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rolloutdb.store.errors import StoreBusyError
from rolloutdb.store.sqlite.inuse import open_elsewhere

HOLDER = textwrap.dedent("""
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute(f"PRAGMA journal_mode = {sys.argv[2]}")
    for sql in sys.argv[3:]:
        conn.execute(sql)
    print("ready", flush=True)
    sys.stdin.read()
""")


@contextlib.contextmanager
def held(path: Path, mode: str, *statements: str):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), mode, *statements],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.poll()
        yield proc.pid
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def digest(path: Path) -> dict[str, tuple[str, int] | None]:
    out = {}
    for suffix in ("", "-wal", "-shm", "-journal"):
        p = Path(f"{path}{suffix}")
        out[suffix] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) if p.exists() else None
    return out


@pytest.fixture
def db(tmp_path) -> Path:
    path = tmp_path / "x.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.commit()
    return path


@pytest.mark.parametrize("mode, statements", [
    ("WAL", []),
    ("WAL", ["BEGIN", "SELECT * FROM t"]),
    ("WAL", ["BEGIN IMMEDIATE", "INSERT INTO t VALUES (1)"]),
    ("DELETE", ["BEGIN", "SELECT * FROM t"]),
    ("DELETE", ["BEGIN IMMEDIATE", "INSERT INTO t VALUES (1)"]),
])
def test_a_holder_is_seen_with_its_pid_and_asking_changes_nothing(db, mode, statements):
    with held(db, mode, *statements) as pid:
        before = digest(db)
        assert open_elsewhere(db) == pid
        assert digest(db) == before


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="idle holders are seen through /proc")
def test_an_idle_rollback_journal_connection_holding_no_lock_is_seen_through_its_descriptor(db):
    with held(db, "DELETE", "SELECT * FROM t") as pid:
        before = digest(db)
        assert open_elsewhere(db) == pid
        assert digest(db) == before


def test_nobody_is_seen_once_the_holders_are_gone(db):
    with held(db, "WAL", "SELECT * FROM t"):
        pass
    with held(db, "DELETE", "SELECT * FROM t"):
        pass
    assert open_elsewhere(db) is None


def test_a_restore_refuses_to_replace_a_live_store_another_process_holds(tmp_path):
    from test_restore import build_ledger_run, restore, tree_digest

    run = build_ledger_run(tmp_path)
    with held(run.live, "WAL", "SELECT count(*) FROM prompt_groups") as pid:
        live_before, snap_before = tree_digest(run.live.parent), tree_digest(run.snap)
        with pytest.raises(StoreBusyError, match=f"open in another process \\(pid {pid}\\)") as info:
            restore(run.snap, run.live)
        assert len(str(info.value).splitlines()) == 1
        assert tree_digest(run.live.parent) == live_before
        assert tree_digest(run.snap) == snap_before
