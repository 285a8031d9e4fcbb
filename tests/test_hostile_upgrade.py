"""Hostile cases of `rolloutdb upgrade` and of the files a user hands to the store
commands by mistake: a writer that opens the file while an upgrade migrates it, the run
starting meanwhile, a run's trace file or a payload segment given to inspect/verify/upgrade,
`--out` naming the source's own side files or a read-only directory, a read-only file.

Real processes on copies of the committed fixtures; what is on disk is read afterwards
through a fresh connection. The race is made deterministic by pausing the upgrade at its
`upgrade.copied` point (a wrapper process replaces `faults.point` with a wait on stdin).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rolloutdb.store.sqlite.revision import head_revision, known_revisions

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HEAD = head_revision()
OLDEST = known_revisions()[0]
TIMEOUT_S = 240  # a hang detector, not a speed test: generous for a loaded machine


def rolloutdb(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutdb", *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def copy_fixture(directory: Path, name: str = "store.sqlite", journal_mode: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    shutil.copyfile(FIXTURES / f"store_{OLDEST}.sqlite", path)
    if journal_mode is not None:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute(f"PRAGMA journal_mode = {journal_mode}")
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(directory: Path) -> dict[str, tuple[str, int, int] | None]:
    """Every entry under `directory`: sha256, mode and mtime of files (None for others)."""
    out: dict[str, tuple[str, int, int] | None] = {}
    for p in sorted(directory.rglob("*")):
        st = p.lstat()
        out[p.relative_to(directory).as_posix()] = (sha256(p), st.st_mode, st.st_mtime_ns) if p.is_file() else None
    return out


def revision_of(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return conn.execute("SELECT version_num FROM alembic_version").fetchone()[0]


def one_error_line(result: subprocess.CompletedProcess, *words: str) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "unexpected " not in lines[0] and "Traceback" not in result.stderr, lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# ----------------------------------------------------------------------------- a writer during the upgrade

# `rolloutdb upgrade ARGS`, paused at fault point argv[1] until a line arrives on stdin.
PAUSED_UPGRADE = textwrap.dedent("""
    import sys
    from rolloutdb import cli
    from rolloutdb.store import faults
    real = faults.point
    def point(name):
        if name == sys.argv[1]:
            print("paused", flush=True)
            sys.stdin.readline()
        real(name)
    faults.point = point
    sys.exit(cli.main(["upgrade", *sys.argv[2:]]))
""")

# Opens the store, reads it, then commits one row (waiting up to 90 s for a lock), and
# keeps its connection until stdin closes: a run's pump, reduced to one commit.
WRITER = textwrap.dedent("""
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=90)
    conn.execute("SELECT count(*) FROM step_shortfall").fetchone()
    print("opened", flush=True)
    conn.execute("INSERT INTO step_shortfall (step, needed) VALUES (99, 7)")
    print("committed", flush=True)
    sys.stdin.read()
""")


@contextlib.contextmanager
def paused_upgrade(path: Path, point: str = "upgrade.copied"):
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_UPGRADE, point, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "paused", (line, proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def resume_and_finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    proc.stdin.write("\n")
    proc.stdin.flush()
    out, err = proc.communicate(timeout=TIMEOUT_S)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("journal_mode", ["WAL", "DELETE"])
def test_a_row_committed_by_a_writer_that_opens_the_file_during_an_upgrade_is_never_lost(tmp_path, journal_mode):
    path = copy_fixture(tmp_path / "run", journal_mode=journal_mode)
    with paused_upgrade(path) as upgrade:
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout.readline().strip() == "opened", writer.poll()
            result = resume_and_finish(upgrade)
            assert writer.stdout.readline().strip() == "committed", writer.poll()
        finally:
            writer.stdin.close()
            writer.wait(timeout=TIMEOUT_S)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        row = conn.execute("SELECT needed FROM step_shortfall WHERE step = 99").fetchone()
    assert row == (7,), f"the writer's committed row was lost (upgrade: {result.returncode} {result.stdout!r})"
    # The upgrade saw the writer under its lock and refused, changing nothing.
    one_error_line(result, "opened by another process during the upgrade", f"pid {writer.pid}", "nothing was changed")
    assert revision_of(path) == OLDEST
    assert not [p.name for p in path.parent.iterdir() if ".upgrade." in p.name]  # its copy removed


def make_run_dir(directory: Path) -> Path:
    store = copy_fixture(directory, "rollout_state.sqlite", journal_mode="WAL")
    (directory / "config.yaml").write_text("run:\n  name: upgrade-test\n")
    return store


TAKE_RUN_LOCK = textwrap.dedent("""
    import sys
    from pathlib import Path
    from rolloutdb.controller.run.run_dir import RunDir
    try:
        lock = RunDir(Path(sys.argv[1])).lock(create=False)
    except ValueError as e:
        print(f"refused: {e}", flush=True)
        sys.exit(0)
    print("locked", flush=True)
    sys.stdin.read()
    lock.undo()
""")


def test_a_run_cannot_start_in_its_directory_while_its_store_is_being_upgraded(tmp_path):
    """`rolloutdb train` takes the run lock before it opens the store; the upgrade of a
    run's live store holds that lock from its in-use check to its rename."""
    run_dir = tmp_path / "run"
    store = make_run_dir(run_dir)
    names = sorted(p.name for p in run_dir.iterdir())
    with paused_upgrade(store) as upgrade:
        second = subprocess.run([sys.executable, "-c", TAKE_RUN_LOCK, str(run_dir)], input="", capture_output=True,
                                text=True, timeout=TIMEOUT_S)
        result = resume_and_finish(upgrade)
    assert second.stdout.startswith("refused: "), f"a run took the lock during the upgrade: {second.stdout!r}"
    assert f"pid {upgrade.pid}" in second.stdout, second.stdout
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == names  # run.lock gone again, as before
    assert revision_of(store) == HEAD


def test_an_upgrade_of_a_store_whose_run_holds_the_run_lock_is_refused_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    store = make_run_dir(run_dir)
    holder = subprocess.Popen([sys.executable, "-c", TAKE_RUN_LOCK, str(run_dir)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked", holder.poll()
        before = tree(run_dir)
        result = rolloutdb("upgrade", store)
        after = tree(run_dir)
    finally:
        holder.stdin.close()
        holder.wait(timeout=TIMEOUT_S)
    one_error_line(result, f"pid {holder.pid}", "then upgrade")
    assert after == before
    assert revision_of(store) == OLDEST


# ----------------------------------------------------------------------------- files that are not stores


def make_trace(run_dir: Path) -> Path:
    from rolloutdb.store.trace.writer import open_trace_file

    return open_trace_file(run_dir / "logs" / "rollout_trace.sqlite")


# `inspect` reads a trace file too (tests/test_cli_run_dirs.py).
@pytest.mark.parametrize("command", ["verify", "upgrade"])
def test_a_trace_file_given_to_a_store_command_is_named_as_the_runs_trace_with_the_command_that_reads_it(
        tmp_path, command):
    run_dir = tmp_path / "run"
    trace = make_trace(run_dir)
    before = tree(run_dir)
    result = rolloutdb(command, trace)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "a run's trace file" in lines[0] and f"`rolloutdb trace {run_dir}`" in lines[0], lines[0]
    assert "upgrade rolloutdb" not in lines[0] and "not written by this rolloutdb" not in lines[0], lines[0]
    assert tree(run_dir) == before
    # The command it names reads the file.
    assert rolloutdb("trace", run_dir, "--out", tmp_path / "report").returncode == 0


def make_segment(checkpoint_dir: Path) -> Path:
    """A payload segment as sealing writes it (the store's own table definition)."""
    from rolloutdb.store.checkpoints.layout import SEGMENTS_DIR
    from rolloutdb.store.live.payload import SEGMENT_DDL, SEGMENT_FORMAT

    path = checkpoint_dir / SEGMENTS_DIR / "segment_1.sqlite"
    path.parent.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(f"PRAGMA user_version = {SEGMENT_FORMAT}")
        conn.execute(SEGMENT_DDL)
        # sample ids 3..8, each 4 tokens: 16 bytes of token ids and 16 of logprobs
        conn.executemany("INSERT INTO payload VALUES (?, ?, ?)", [(i, bytes(16), bytes(16)) for i in range(3, 9)])
        conn.commit()
    return path


def test_inspect_reads_a_payload_segment_file_as_the_readme_says(tmp_path):
    segment = make_segment(tmp_path / "checkpoints")
    before = tree(tmp_path)
    text = rolloutdb("inspect", segment)
    assert text.returncode == 0, text.stderr
    assert "payload segment" in text.stdout and "6 samples" in text.stdout and "ids 3..8" in text.stdout, text.stdout
    as_json = rolloutdb("inspect", segment, "--json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert (doc["kind"], doc["samples"], doc["first_sample_id"], doc["last_sample_id"]) == ("payload_segment", 6, 3, 8)
    assert doc["tokens"] == 24 and doc["payload_bytes"] == 192
    query = rolloutdb("inspect", segment, "--sql", "SELECT count(*) AS n, sum(length(token_ids)) AS b FROM payload")
    assert query.returncode == 0, query.stderr
    assert query.stdout.splitlines()[2].split() == ["6", "96"], query.stdout
    assert tree(tmp_path) == before


# ----------------------------------------------------------------------------- --out names and read-only places


@pytest.mark.parametrize("suffix", ["-wal", "-journal", "-shm"])
def test_upgrade_out_refuses_the_name_of_the_sources_own_side_file(tmp_path, suffix):
    path = copy_fixture(tmp_path / "run", journal_mode="DELETE")
    before = tree(path.parent)
    result = rolloutdb("upgrade", path, "--out", f"{path}{suffix}")
    one_error_line(result, f"{path}{suffix}", f"own {suffix} file")
    assert tree(path.parent) == before


def test_upgrade_out_refuses_a_name_with_a_stale_wal_beside_it(tmp_path):
    path = copy_fixture(tmp_path / "run")
    out = tmp_path / "up" / "new.sqlite"
    out.parent.mkdir()
    Path(f"{out}-wal").write_bytes(b"a WAL of an earlier new.sqlite")
    before = tree(tmp_path)
    one_error_line(rolloutdb("upgrade", path, "--out", out), f"{out}-wal exists")
    assert tree(tmp_path) == before


@contextlib.contextmanager
def mode(path: Path, bits: int):
    """chmod `path` for the test (the suite runs as root too: the refusal must come
    from the mode bits, not from a failing write), and back."""
    old = path.stat().st_mode
    path.chmod(bits)
    try:
        yield
    finally:
        path.chmod(old)


def test_upgrade_out_into_a_read_only_directory_names_the_directory(tmp_path):
    path = copy_fixture(tmp_path / "run")
    locked = tmp_path / "locked"
    locked.mkdir()
    with mode(locked, 0o555):
        result = rolloutdb("upgrade", path, "--out", locked / "new.sqlite")
    one_error_line(result, str(locked), "read-only")
    assert list(locked.iterdir()) == []


def test_a_read_only_file_is_not_replaced_in_place(tmp_path):
    path = copy_fixture(tmp_path / "run")
    with mode(path, 0o444):
        before = tree(path.parent)
        result = rolloutdb("upgrade", path)
        after = tree(path.parent)
    one_error_line(result, str(path), "read-only (mode 0444)", "--out")
    assert after == before
    assert revision_of(path) == OLDEST


def test_a_file_in_a_read_only_directory_is_not_upgraded_in_place(tmp_path):
    path = copy_fixture(tmp_path / "run")
    with mode(path.parent, 0o555):
        before = tree(path.parent)
        result = rolloutdb("upgrade", path)
        after = tree(path.parent)
    one_error_line(result, str(path), f"its directory {path.parent} is read-only")
    assert after == before
    assert revision_of(path) == OLDEST

