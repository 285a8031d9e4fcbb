"""`rolloutdb upgrade PATH`, run as a real process on copies of the committed fixtures and
on damaged copies of them. A refused file keeps its bytes and gains no side files."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rolloutdb.store.live.invariants import check_invariants
from rolloutdb.store.sqlite.revision import head_revision, known_revisions

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
HEAD = head_revision()
OLDEST = known_revisions()[0]


def rolloutdb(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutdb", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def copy_fixture(revision: str, directory: Path) -> Path:
    directory.mkdir(exist_ok=True)
    dst = directory / f"store_{revision}.sqlite"
    shutil.copyfile(FIXTURES / f"store_{revision}.sqlite", dst)
    return dst


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def revision_of(path: Path) -> str:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute("SELECT version_num FROM alembic_version").fetchone()[0]


# ----------------------------------------------------------------------------- good files


def test_help_describes_the_command_and_names_head():
    result = rolloutdb("upgrade", "--help")
    assert result.returncode == 0
    assert "usage: rolloutdb upgrade" in result.stdout
    assert f"head: {HEAD}" in result.stdout
    assert "exactly one known revision" in result.stdout and "--out COPY" in result.stdout


@pytest.mark.parametrize("revision", [r for r in known_revisions() if r != HEAD])
def test_an_old_fixture_is_upgraded_in_place_and_says_so(tmp_path, revision):
    path = copy_fixture(revision, tmp_path / "run")
    result = rolloutdb("upgrade", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{path}: upgraded {revision} -> {HEAD}\n"
    assert result.stderr == ""
    assert revision_of(path) == HEAD
    assert listing(path.parent) == [path.name]
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.execute("BEGIN")
        assert check_invariants(conn).ok


def test_a_file_at_head_is_reported_up_to_date_and_left_byte_for_byte(tmp_path):
    path = copy_fixture(HEAD, tmp_path / "run")
    digest = sha256(path)
    result = rolloutdb("upgrade", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{path}: up to date ({HEAD})\n"
    assert sha256(path) == digest
    assert listing(path.parent) == [path.name]


def test_a_second_upgrade_of_an_upgraded_file_changes_nothing(tmp_path):
    path = copy_fixture(OLDEST, tmp_path / "run")
    assert rolloutdb("upgrade", str(path)).returncode == 0
    digest = sha256(path)
    result = rolloutdb("upgrade", str(path))
    assert result.stdout == f"{path}: up to date ({HEAD})\n"
    assert sha256(path) == digest


def test_a_relative_path_from_another_directory_works(tmp_path):
    path = copy_fixture(OLDEST, tmp_path / "run")
    result = rolloutdb("upgrade", path.name, cwd=path.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{path.name}: upgraded {OLDEST} -> {HEAD}\n"
    assert revision_of(path) == HEAD


def test_an_upgrade_through_a_symlink_replaces_the_target_and_keeps_the_link(tmp_path):
    path = copy_fixture(OLDEST, tmp_path / "run")
    link = tmp_path / "link.sqlite"
    link.symlink_to(path)
    assert rolloutdb("upgrade", str(link)).returncode == 0
    assert link.is_symlink()
    assert revision_of(path) == HEAD
    assert listing(path.parent) == [path.name]


def test_a_wal_file_left_by_a_killed_writer_keeps_its_wal_rows(tmp_path):
    """A writer commits into the WAL and is SIGKILLed before any checkpoint: the upgrade
    must carry the committed rows, fold the WAL away and leave no side files."""
    path = copy_fixture(OLDEST, tmp_path / "run")
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sqlite3, sys, time
        conn = sqlite3.connect({str(path)!r}, isolation_level=None)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("INSERT INTO step_shortfall (step, needed) VALUES (99, 7)")
        print("committed", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "committed"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert Path(f"{path}-wal").stat().st_size > 0

    result = rolloutdb("upgrade", str(path))
    assert result.returncode == 0, result.stderr
    assert listing(path.parent) == [path.name]
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT needed FROM step_shortfall WHERE step = 99").fetchone() == (7,)
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == (HEAD,)
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


# ----------------------------------------------------------------------------- bad input


def _flip_bytes_in_a_table_page(path: Path, table: str = "prompt_groups") -> None:
    """XOR 16 bytes in the middle of the cell content of `table`'s first leaf page."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()
    data = bytearray(path.read_bytes())
    start = (root - 1) * page_size
    assert data[start] == 0x0D, "expected a leaf table page; the fixture changed shape"
    content = int.from_bytes(data[start + 5:start + 7], "big")
    middle = start + (content + page_size) // 2
    for i in range(middle - 8, middle + 8):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _sqlite_finds_damage(path: Path) -> bool:
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)) as conn:
            return conn.execute("PRAGMA integrity_check").fetchone()[0] != "ok"
    except sqlite3.DatabaseError:
        return True


def _make_missing(d: Path) -> Path:
    return d / "missing.sqlite"


def _make_directory(d: Path) -> Path:
    (d / "snapshot_3").mkdir()
    return d / "snapshot_3"


def _make_not_sqlite(d: Path) -> Path:
    path = d / "notes.sqlite"
    path.write_text("step,loss\n1,0.5\n" * 20)
    return path


def _make_empty(d: Path) -> Path:
    path = d / "empty.sqlite"
    path.write_bytes(b"")
    return path


def _make_truncated(d: Path) -> Path:
    path = copy_fixture(OLDEST, d)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _make_bit_flipped(d: Path) -> Path:
    path = copy_fixture(OLDEST, d)
    _flip_bytes_in_a_table_page(path)
    assert _sqlite_finds_damage(path)
    return path


def _make_newer_revision(d: Path) -> Path:
    path = copy_fixture(OLDEST, d)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("UPDATE alembic_version SET version_num = 'v9_9_z'")
        conn.commit()
    return path


def _make_plain_sqlite(d: Path) -> Path:
    path = d / "other.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.commit()
    return path


BAD_INPUTS = {
    "missing path": (_make_missing, "no such file"),
    "directory": (_make_directory, "is a directory"),
    "not SQLite": (_make_not_sqlite, "not a SQLite database"),
    "empty file": (_make_empty, "not a SQLite database"),
    "truncated": (_make_truncated, "truncated"),
    "bit-flipped page": (_make_bit_flipped, "damaged"),
    "unknown revision": (_make_newer_revision, "unknown schema revision v9_9_z (known: "),
    "SQLite but not a store": (_make_plain_sqlite, "not a rolloutdb store"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_gets_one_error_line_a_nonzero_exit_and_no_change_on_disk(tmp_path, case):
    make, expected = BAD_INPUTS[case]
    directory = tmp_path / "run"
    directory.mkdir()
    path = make(directory)
    before = {p.name: (sha256(p) if p.is_file() else None) for p in directory.iterdir()}

    result = rolloutdb("upgrade", str(path))

    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert expected in lines[0]
    assert str(path) in lines[0]
    after = {p.name: (sha256(p) if p.is_file() else None) for p in directory.iterdir()}
    assert after == before  # same bytes, and no -wal, -shm or temporary file left


def test_an_unknown_revision_is_refused_with_advice_to_upgrade_rolloutdb_if_a_newer_one_wrote_it(tmp_path):
    path = _make_newer_revision(tmp_path)
    result = rolloutdb("upgrade", str(path))
    assert result.returncode != 0
    assert "v9_9_z" in result.stderr and "upgrade rolloutdb" in result.stderr
    assert revision_of(path) == "v9_9_z"


# ----------------------------------------------------------------------------- files in use


def three_files(path: Path) -> dict[str, tuple[str, int] | None]:
    """sha256 and mtime of the file, its -wal and its -shm (None where absent)."""
    out = {}
    for suffix in ("", "-wal", "-shm"):
        p = Path(f"{path}{suffix}")
        out[suffix or "main"] = (sha256(p), p.stat().st_mtime_ns) if p.exists() else None
    return out


# A process that opens the file, runs its statements and then holds the connection (and
# any transaction they left open) until its stdin closes.
HOLDER = textwrap.dedent("""
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute(f"PRAGMA journal_mode = {sys.argv[2]}")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    for sql in sys.argv[3:]:
        conn.execute(sql)
    print("ready", flush=True)
    sys.stdin.read()
""")

HOLDS = {
    "an idle WAL connection": ("WAL", ["INSERT INTO step_shortfall (step, needed) VALUES (99, 7)"]),
    "an open WAL write transaction": ("WAL", ["INSERT INTO step_shortfall (step, needed) VALUES (99, 7)",
                                              "BEGIN IMMEDIATE",
                                              "INSERT INTO step_shortfall (step, needed) VALUES (98, 1)"]),
    "an open WAL read transaction": ("WAL", ["BEGIN", "SELECT count(*) FROM samples"]),
    "an open rollback-journal write transaction": ("DELETE", ["BEGIN IMMEDIATE",
                                                              "INSERT INTO step_shortfall (step, needed) VALUES (98, 1)"]),
}


@pytest.mark.parametrize("hold", list(HOLDS))
def test_a_file_another_process_holds_open_is_refused_naming_its_pid_and_no_byte_changes(tmp_path, hold):
    path = copy_fixture(OLDEST, tmp_path / "run")
    mode, statements = HOLDS[hold]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), mode, *statements],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready", holder.poll()
        before, names = three_files(path), listing(path.parent)
        result = rolloutdb("upgrade", str(path))
        assert result.returncode == 2
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert "open in another process" in lines[0] and f"pid {holder.pid}" in lines[0], lines[0]
        assert three_files(path) == before
        assert listing(path.parent) == names
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    # The holder's own commits were not lost under it.
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() == (OLDEST,)
        if "WAL" in hold and "read" not in hold:
            assert conn.execute("SELECT needed FROM step_shortfall WHERE step = 99").fetchone() == (7,)


# ----------------------------------------------------------------------------- published snapshots


def published_snapshot(directory: Path, revision: str = OLDEST) -> Path:
    from rolloutdb.store.checkpoints.manifest import KIND_SNAPSHOT, Manifest, describe_files

    directory.mkdir(parents=True)
    db = directory / "rollout_state.sqlite"
    shutil.copyfile(FIXTURES / f"store_{revision}.sqlite", db)
    manifest = Manifest(kind=KIND_SNAPSHOT, anchor="bootstrap", sequence=1, files=describe_files(directory),
                        schema_revision=revision, cut_time=1.0)
    (directory / "manifest.json").write_bytes(manifest.to_json())
    return db


def tree(directory: Path) -> dict[str, tuple[str, int]]:
    return {p.relative_to(directory).as_posix(): (sha256(p), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_file_inside_a_published_snapshot_is_refused_and_the_way_to_upgrade_a_copy_is_named(tmp_path):
    db = published_snapshot(tmp_path / "snapshot_1")
    before = tree(tmp_path)
    result = rolloutdb("upgrade", str(db))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "published snapshot" in lines[0] and "--out" in lines[0], lines[0]
    assert tree(tmp_path) == before
    assert rolloutdb("verify", str(db.parent)).returncode == 0


def test_verify_advises_upgrading_a_copy_of_an_old_published_snapshot_and_following_it_works(tmp_path):
    db = published_snapshot(tmp_path / "snapshot_1")
    result = rolloutdb("verify", str(db))
    assert result.returncode == 0, result.stderr
    advice = [line for line in result.stdout.splitlines() if "older than head" in line]
    assert len(advice) == 1 and "--out" in advice[0] and "restore upgrades a copy" in advice[0], result.stdout
    before = tree(db.parent)
    copy = tmp_path / "copy.sqlite"
    result = rolloutdb("upgrade", str(db), "--out", str(copy))
    assert result.returncode == 0, result.stderr
    assert str(copy) in result.stdout
    assert tree(db.parent) == before  # the published bytes never change
    assert revision_of(copy) == HEAD and revision_of(db) == OLDEST
    assert rolloutdb("verify", str(db.parent)).returncode == 0
    assert rolloutdb("verify", str(copy)).returncode == 0


def test_upgrade_out_refuses_an_existing_target_and_a_target_inside_a_snapshot(tmp_path):
    db = published_snapshot(tmp_path / "snapshot_1")
    existing = tmp_path / "there.sqlite"
    existing.write_bytes(b"keep me")
    before = tree(tmp_path)
    for out, words in ((existing, "already exists"), (db.parent / "up.sqlite", "inside a snapshot directory"),
                       (db, "already exists")):
        result = rolloutdb("upgrade", str(db), "--out", str(out))
        assert result.returncode == 2
        assert len(result.stderr.splitlines()) == 1 and words in result.stderr, result.stderr
    assert tree(tmp_path) == before


# ----------------------------------------------------------------------------- leftovers, free pages


def test_leftovers_of_a_killed_upgrade_are_removed_by_the_next_upgrade_of_that_file(tmp_path):
    path = copy_fixture(OLDEST, tmp_path / "run")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftovers = [path.with_name(f".{path.name}.upgrade.{dead.pid}.tmp{s}") for s in ("", "-journal")]
    for p in leftovers:
        p.write_bytes(b"half a copy")
    other = path.with_name(f".other.sqlite.upgrade.{dead.pid}.tmp")  # another file's: not ours to remove
    other.write_bytes(b"x")
    result = rolloutdb("upgrade", str(path))
    assert result.returncode == 0, result.stderr
    assert listing(path.parent) == sorted([path.name, other.name])


@pytest.mark.parametrize("point", ["upgrade.copied", "upgrade.migrated"])
def test_an_upgrade_killed_midway_leaves_the_file_as_it_was_and_the_next_upgrade_cleans_up(tmp_path, point):
    import os

    path = copy_fixture(OLDEST, tmp_path / "run")
    before = sha256(path)
    killed = subprocess.run([sys.executable, "-m", "rolloutdb", "upgrade", str(path)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "ROLLOUTDB_FAULT": point})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sha256(path) == before
    assert any(name.startswith(f".{path.name}.upgrade.") for name in listing(path.parent))  # what it left
    result = rolloutdb("upgrade", str(path))
    assert result.returncode == 0, result.stderr
    assert listing(path.parent) == [path.name]
    assert revision_of(path) == HEAD


def test_a_refused_upgrade_leaves_the_leftovers_of_a_killed_one_alone(tmp_path):
    path = copy_fixture(OLDEST, tmp_path / "run")
    _make_newer_revision(tmp_path / "run")
    leftover = path.with_name(f".{path.name}.upgrade.999999999.tmp")
    leftover.write_bytes(b"half a copy")
    assert rolloutdb("upgrade", str(path)).returncode == 2
    assert leftover.exists()


def test_an_upgraded_file_has_no_free_pages(tmp_path):
    path = copy_fixture(OLDEST, tmp_path / "run")
    assert rolloutdb("upgrade", str(path)).returncode == 0
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        assert conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
