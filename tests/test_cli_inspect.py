"""`rolloutdb inspect`, run as a real process on store files built through the store API,
on snapshot files captured from them, on the committed old-revision fixture, and on
damaged copies. Whatever happens, the inspected file keeps its bytes and its directory
gains no file (no -wal, no -shm)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import lost_ctrl_c
from rolloutdb.store import FinishedGeneration, Reservation, Store, pools
from rolloutdb.store.sqlite.revision import head_revision, known_revisions

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
HEAD = head_revision()
OLDEST = known_revisions()[0]


def inspect(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rolloutdb.cli", "inspect", *map(str, args)],
        capture_output=True, text=True, timeout=120, env=env,
    )


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def assert_one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _gen(n=3, version=0):
    return FinishedGeneration(list(range(n)), [-0.25] * n, 1.0, [(version, n)])


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A closed store with groups in every state but trained, abandoned attempts with
    two reasons, spare prompts, a shortfall and a chunk. Tests inspect copies of it."""
    path = tmp_path_factory.mktemp("built") / "live.sqlite"
    with Store.create(path, replay_capacity=8) as s:
        gids = s.reserve([Reservation(i, 0, 100 + i) for i in range(6)], num_generations=2, target_step=1)
        attempts = s.dispatch(gids[:4], policy_version=3)
        for a in attempts[:4]:  # groups 0 and 1 complete
            s.finish(a, _gen())
        s.seal(gids[:2])
        s.enter_replay(gids[:2])
        s.mark_trained([gids[0]], step=1)
        s.abandon([attempts[4]], "restart")
        s.abandon([attempts[5]], "deadline")
        s.discard([gids[3]], reason="zero_reward_variance")
        with s.atomic() as tx:
            pools.push_spare(tx, [Reservation(6, 0, 106), Reservation(7, 0, 107)])
            pools.advance_cursor(tx, 8, 0)
            pools.set_shortfall(tx, 2, 5)
        s.record_snapshot_attempt("skipped_unchanged", anchor="bootstrap")
    return path


@pytest.fixture
def store_file(built, tmp_path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    shutil.copyfile(built, d / "live.sqlite")
    return d / "live.sqlite"


def _direct(path: Path, sql: str):
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)) as conn:
        return conn.execute(sql).fetchall()


# ----------------------------------------------------------------------------- help


def test_help_explains_the_summary_the_query_mode_and_that_nothing_is_written():
    result = inspect("--help")
    assert result.returncode == 0
    out = result.stdout
    assert "usage: rolloutdb inspect" in out
    for words in ("--sql", "--json", "--no-check", "read-only", "manifest.json", "rolloutdb upgrade", "<blob N bytes>", "error:"):
        assert words in out, words


# ----------------------------------------------------------------------------- the summary


def test_the_json_summary_matches_the_file_as_read_by_another_connection(store_file):
    before, files = sha256(store_file), listing(store_file.parent)
    result = inspect(store_file, "--json")
    assert result.returncode == 0, result.stderr
    s = json.loads(result.stdout)
    assert (s["revision"], s["revision_status"], s["head_revision"]) == (HEAD, "head", HEAD)
    tables = [r[0] for r in _direct(store_file, "SELECT name FROM sqlite_master WHERE type='table' "
                                                "AND name NOT LIKE 'sqlite_%' AND name != 'alembic_version'")]
    assert set(s["row_counts"]) == set(tables)
    for table, n in s["row_counts"].items():
        assert n == _direct(store_file, f"SELECT count(*) FROM {table}")[0][0], table
    assert s["groups"] == {"reserved": 2, "dispatched": 1, "sealed": 0, "published": 1, "trained": 1, "discarded": 1}
    # The trained and the discarded group are settled ranges (v1_4_a), counted in `groups`
    # above; their attempts left with them: group 1's two finished ones remain, and the two
    # group 2 abandoned by hand (the discard's two abandoned attempts went with group 3).
    assert s["rollouts"] == {"running": 0, "finished": 2, "abandoned": 2}
    assert s["abandon_reasons"] == {"restart": 1, "deadline": 1, "error": 0}
    assert s["replay_permits"] == {"used": 1, "capacity": 8}
    assert s["sampler"] == {"next_seq": 8, "epoch": 0, "seed": 0, "stamping": "target_step"}
    assert s["mutation_counter"] == _direct(store_file, "SELECT mutation_counter FROM run_meta")[0][0] > 0
    assert s["manifest"] is None and s["notes"] == []
    assert sha256(store_file) == before and listing(store_file.parent) == files


def test_the_text_summary_names_every_section(store_file):
    result = inspect(store_file)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"schema revision   {HEAD} (head)" in out
    assert "ledger groups     reserved 2, dispatched 1, sealed 0, published 1, trained 1, discarded 1" in out
    assert "rollouts          running 0, finished 2, abandoned 2 (restart 1, deadline 1)" in out
    assert "replay permits    1 used of 8" in out
    assert "sampler cursor    next_seq 8, epoch 0" in out
    assert "mutation counter  " in out
    assert any(line.split() == ["spare_prompts", "2"] for line in out.splitlines())
    assert any(line.split() == ["snapshot_attempts", "1"] for line in out.splitlines())
    assert "note:" not in out


def _snapshot_dir(store_file: Path, tmp_path: Path, manifest) -> tuple[Path, object]:
    snap = tmp_path / "ckpt" / "step_3" / "rollout_snapshots" / "snapshot_7"
    snap.mkdir(parents=True)
    with Store.open(store_file) as s:
        cap = s.capture(snap / "rollouts.sqlite")
    if manifest is not None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest(cap))
        (snap / "manifest.json").write_text(text)
    return snap, cap


def test_a_snapshot_shows_the_anchor_and_the_cut_time_of_the_manifest_beside_it_in_iso_8601_utc(store_file, tmp_path):
    def manifest(cap):
        return {"format_version": 1, "kind": "rollout_snapshot", "anchor": "step_3", "sequence": 7,
                "cut_time": 1767225600.25, "schema_revision": cap.revision, "mutation_counter": cap.mutation_counter,
                "files": [{"path": "rollouts.sqlite", "size": 1, "sha256": "0" * 64}]}

    snap, cap = _snapshot_dir(store_file, tmp_path, manifest)
    before, files = sha256(snap / "rollouts.sqlite"), listing(snap)
    text = inspect(snap / "rollouts.sqlite")
    assert text.returncode == 0, text.stderr
    assert "manifest          rollout_snapshot #7, anchor step_3" in text.stdout
    assert "cut time          2026-01-01T00:00:00.250Z (" in text.stdout
    assert "note:" not in text.stdout
    data = json.loads(inspect(snap / "rollouts.sqlite", "--json").stdout)
    assert data["manifest"]["anchor"] == "step_3" and data["manifest"]["sequence"] == 7
    assert data["manifest"]["cut_time"] == "2026-01-01T00:00:00.250Z"  # ISO-8601 UTC, never an epoch float
    assert data["mutation_counter"] == cap.mutation_counter
    assert data["row_counts"] == cap.row_counts
    assert sha256(snap / "rollouts.sqlite") == before and listing(snap) == files


@pytest.mark.parametrize(
    "manifest, note",
    [
        ("{not json", "unreadable manifest"),
        ("[1, 2, 3]", "not a JSON object"),
        ('{"kind": "rollout_snapshot", "sequence": 1}', "manifest lacks anchor, cut_time"),
        ('{"kind": "rollout_snapshot", "anchor": "bootstrap", "sequence": 1, "cut_time": "noon"}', "is not a number"),
        ('{"kind": "rollout_snapshot", "anchor": "bootstrap", "sequence": 1, "cut_time": 1.0, '
         '"schema_revision": "v0_0_x"}', "manifest says schema revision v0_0_x"),
    ],
    ids=["not_json", "not_an_object", "missing_keys", "cut_time_not_a_number", "other_revision"],
)
def test_a_broken_manifest_is_a_note_and_the_summary_still_prints(store_file, tmp_path, manifest, note):
    snap, _cap = _snapshot_dir(store_file, tmp_path, manifest)
    result = inspect(snap / "rollouts.sqlite")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "ledger groups" in result.stdout
    assert any(line.startswith("note: ") and note in line for line in result.stdout.splitlines()), result.stdout


def test_a_broken_manifest_is_listed_in_the_json_notes(store_file, tmp_path):
    snap, _cap = _snapshot_dir(store_file, tmp_path, "{not json")
    result = inspect(snap / "rollouts.sqlite", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["manifest"] is None
    assert len(data["notes"]) == 1 and "unreadable manifest" in data["notes"][0]


def test_an_old_revision_is_inspected_and_the_upgrade_command_is_named(tmp_path):
    path = tmp_path / f"store_{OLDEST}.sqlite"
    shutil.copyfile(FIXTURES / f"store_{OLDEST}.sqlite", path)
    before, files = sha256(path), listing(tmp_path)
    result = inspect(path)
    assert result.returncode == 0, result.stderr
    assert f"schema revision   {OLDEST} (old; head is {HEAD})" in result.stdout
    assert f"run `rolloutdb upgrade {path}`" in result.stdout
    data = json.loads(inspect(path, "--json").stdout)
    assert data["revision_status"] == "old"
    assert data["row_counts"]["prompt_groups"] == _direct(path, "SELECT count(*) FROM prompt_groups")[0][0] > 0
    query = inspect(path, "--sql", "SELECT count(*) AS n FROM samples")
    assert query.returncode == 0 and query.stdout.splitlines()[2].strip() == str(_direct(path, "SELECT count(*) FROM samples")[0][0])
    assert sha256(path) == before and listing(tmp_path) == files


# ----------------------------------------------------------------------------- --sql


def test_sql_prints_an_aligned_table_with_nulls_and_blob_sizes(store_file):
    result = inspect(store_file, "--sql", "SELECT 7 AS n, 'ab' AS word, NULL AS missing, x'010203' AS payload")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "n  word  missing  payload",
        "-  ----  -------  --------------",
        "7  ab       NULL  <blob 3 bytes>",
        "(1 row)",
    ]


def test_sql_over_real_rows_aligns_every_column(store_file):
    result = inspect(store_file, "--sql", "SELECT sample_id, group_id, token_ids FROM samples ORDER BY sample_id")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "(2 rows)"
    header, rule, rows = lines[0], lines[1], lines[2:-1]
    starts = [i for i, ch in enumerate(rule) if ch == "-" and (i == 0 or rule[i - 1] == " ")]
    assert len(starts) == 3 and len(rows) == 2
    for row in rows:
        assert row[starts[2]:] == "<blob 12 bytes>"
    assert header[starts[1]:].startswith("group_id")


def test_sql_json_gives_columns_and_rows(store_file):
    result = inspect(store_file, "--json", "--sql",
                     "SELECT group_id, state, discard_reason, x'00ff' AS b FROM prompt_groups ORDER BY group_id")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["columns"] == ["group_id", "state", "discard_reason", "b"]
    expected = _direct(store_file, "SELECT group_id, state, discard_reason FROM prompt_groups ORDER BY group_id")
    assert [tuple(r[:3]) for r in data["rows"]] == expected
    assert {r[3] for r in data["rows"]} == {"<blob 2 bytes>"}
    assert data["row_count"] == 4 and data["revision"] == HEAD  # 6 groups, 2 of them settled


def test_read_only_pragmas_and_table_valued_pragmas_are_allowed(store_file):
    result = inspect(store_file, "--sql", "SELECT name FROM pragma_table_info('run_meta') WHERE name = 'mutation_counter'")
    assert result.returncode == 0, result.stderr
    assert "mutation_counter" in result.stdout
    assert inspect(store_file, "--sql", "PRAGMA user_version").returncode == 0


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO spare_prompts VALUES (99, 0, 99, 0.0)",
        "UPDATE run_meta SET mutation_counter = 0",
        "DELETE FROM prompt_groups",
        "DROP TABLE samples",
        "CREATE TABLE extra (x)",
        "CREATE TEMP TABLE extra (x)",
        "ATTACH DATABASE '{dir}/other.sqlite' AS other",
        "PRAGMA user_version = 5",
        "PRAGMA journal_mode = DELETE",
        "VACUUM",
        "VACUUM INTO '{dir}/copy.sqlite'",
        "REINDEX",
        "SELECT 1; DELETE FROM samples",
    ],
)
def test_a_statement_that_writes_is_refused_with_one_error_line(store_file, sql):
    before, files = sha256(store_file), listing(store_file.parent)
    result = inspect(store_file, "--sql", sql.format(dir=store_file.parent))
    assert_one_error_line(result)
    assert "refused" in result.stderr or "exactly one SQL statement" in result.stderr
    assert sha256(store_file) == before and listing(store_file.parent) == files


def test_a_query_that_fails_says_why_in_one_line(store_file):
    assert_one_error_line(inspect(store_file, "--sql", "SELECT * FROM no_such_table"), "no such table: no_such_table")
    assert_one_error_line(inspect(store_file, "--sql", "  ;  "), "empty query")


# ----------------------------------------------------------------------------- bad input


def _flip_a_page_type_byte(path: Path) -> None:
    """Flip one bit in the b-tree page header of the ledger's root page: a damage that
    SQLite's own checks see (unlike a flip inside a stored value)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'prompt_groups'").fetchone()[0]
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    data = bytearray(path.read_bytes())
    data[(root - 1) * page_size] ^= 0x01
    path.write_bytes(bytes(data))


def _make_bad(kind: str, built: Path, d: Path) -> Path:
    target = d / "bad.sqlite"
    if kind == "missing":
        return d / "nothing_here.sqlite"
    if kind == "directory":
        (d / "a_dir").mkdir()
        return d / "a_dir"
    if kind == "not_sqlite":
        target.write_text("step,reward\n1,0.5\n" * 50)
    elif kind == "empty":
        target.write_bytes(b"")
    elif kind == "truncated":
        target.write_bytes(built.read_bytes()[: built.stat().st_size // 2])
    elif kind == "bit_flipped":
        shutil.copyfile(built, target)
        _flip_a_page_type_byte(target)
    elif kind == "newer_revision":
        shutil.copyfile(built, target)
        with contextlib.closing(sqlite3.connect(target)) as conn:
            conn.execute("UPDATE alembic_version SET version_num = 'v9_9_z'")
            conn.commit()
            conn.execute("PRAGMA journal_mode = DELETE")
    elif kind == "not_a_store":
        with contextlib.closing(sqlite3.connect(target)) as conn:
            conn.execute("CREATE TABLE t (x)")
            conn.commit()
    return target


BAD = {
    "missing": "no such file",
    "directory": "is a directory",
    "not_sqlite": "not a SQLite database",
    "empty": "not a SQLite database",
    "truncated": "truncated",
    "bit_flipped": "damaged",
    "newer_revision": "upgrade rolloutdb",
    "not_a_store": "not a rolloutdb store",
}


# --json takes the summary's path through every check, so two modes cover all three.
@pytest.mark.parametrize("mode", [[], ["--sql", "SELECT count(*) FROM prompt_groups"]], ids=["summary", "sql"])
@pytest.mark.parametrize("kind", list(BAD))
def test_bad_input_gets_one_error_line_and_leaves_every_byte_as_it_was(built, tmp_path, kind, mode):
    d = tmp_path / "d"
    d.mkdir()
    target = _make_bad(kind, built, d)
    files = listing(d)
    before = sha256(target) if target.is_file() else None
    result = inspect(target, *mode)
    assert_one_error_line(result, BAD[kind])
    assert listing(d) == files
    if before is not None:
        assert sha256(target) == before


# ----------------------------------------------------------------------------- WAL files


def test_a_closed_wal_mode_store_is_read_without_creating_side_files(store_file):
    assert store_file.read_bytes()[18:20] == b"\x02\x02", "the store file is in WAL mode"
    before, files = sha256(store_file), listing(store_file.parent)
    assert files == ["live.sqlite"]
    for args in ([], ["--json"], ["--sql", "SELECT count(*) FROM rollouts"]):
        assert inspect(store_file, *args).returncode == 0
        assert listing(store_file.parent) == files
    assert sha256(store_file) == before


@contextlib.contextmanager
def _live_writer(path: Path):
    """Another connection that has committed a row which so far lives only in the WAL."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO spare_prompts VALUES (500, 1, 500, 0.0)")
        conn.execute("COMMIT")
        yield conn
    finally:
        conn.close()


def test_a_store_open_in_a_live_writer_is_read_with_its_wal_and_the_wal_is_left_as_it_was(store_file):
    with _live_writer(store_file):
        wal = Path(f"{store_file}-wal")
        files = listing(store_file.parent)
        assert files == ["live.sqlite", "live.sqlite-shm", "live.sqlite-wal"]
        main_before, wal_before = sha256(store_file), sha256(wal)
        result = inspect(store_file, "--sql", "SELECT count(*) AS n FROM spare_prompts WHERE sample_seq = 500")
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[2].strip() == "1", "the row committed to the WAL is seen"
        summary = json.loads(inspect(store_file, "--json").stdout)
        assert summary["row_counts"]["spare_prompts"] == 3
        assert listing(store_file.parent) == files
        assert sha256(store_file) == main_before and sha256(wal) == wal_before


def test_a_wal_without_its_shm_is_read_from_a_private_copy(store_file, tmp_path):
    copied = tmp_path / "copied"
    copied.mkdir()
    with _live_writer(store_file):
        shutil.copyfile(store_file, copied / "live.sqlite")
        shutil.copyfile(f"{store_file}-wal", copied / "live.sqlite-wal")
    files = listing(copied)
    hashes = {name: sha256(copied / name) for name in files}
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch))
    result = inspect(copied / "live.sqlite", "--sql", "SELECT count(*) FROM spare_prompts WHERE sample_seq = 500", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[2].strip() == "1"
    assert listing(copied) == files and {n: sha256(copied / n) for n in files} == hashes
    assert list(scratch.iterdir()) == [], "the private copy is removed"


# ----------------------------------------------------------------------------- --sql: bounded, interruptible, pure

RUNAWAY = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"


def test_a_runaway_query_stops_at_the_timeout_with_one_line_naming_the_option(store_file):
    before, files = sha256(store_file), listing(store_file.parent)
    result = subprocess.run([sys.executable, "-m", "rolloutdb.cli", "inspect", str(store_file), "--sql", RUNAWAY,
                             "--timeout", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert_one_error_line(result, "1 s", "--timeout")
    assert sha256(store_file) == before and listing(store_file.parent) == files


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "x"])
def test_a_timeout_that_is_not_a_positive_number_is_a_usage_error(store_file, value):
    result = inspect(store_file, "--sql", "SELECT 1", f"--timeout={value}")
    assert result.returncode == 2
    assert_one_error_line(result, "--timeout")


def _wal_without_shm(store_file: Path, tmp_path: Path) -> Path:
    """A copy of the store with a WAL and no -shm: inspect reads it through a private copy."""
    copied = tmp_path / "copied"
    copied.mkdir()
    with _live_writer(store_file):
        shutil.copyfile(store_file, copied / "live.sqlite")
        shutil.copyfile(f"{store_file}-wal", copied / "live.sqlite-wal")
    return copied / "live.sqlite"


def _start_runaway(path: Path, scratch: Path) -> subprocess.Popen:
    """Start the runaway query on a private copy made in `scratch`, and return once the
    copy exists (the command is past start-up, in the part that reads the file)."""
    import time

    proc = subprocess.Popen([sys.executable, "-m", "rolloutdb.cli", "inspect", str(path), "--sql", RUNAWAY,
                             "--timeout", "300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TMPDIR=str(scratch)))
    deadline = time.monotonic() + 60
    while not list(scratch.iterdir()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the private copy never appeared"
        time.sleep(0.05)
    time.sleep(0.5)  # from the copy to the query: well under this
    assert proc.poll() is None, proc.communicate()
    return proc


def test_ctrl_c_stops_a_runaway_query_with_one_error_line(store_file, tmp_path):
    import signal

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = _start_runaway(_wal_without_shm(store_file, tmp_path), scratch)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)  # before the fix SIGINT was ignored: this timed out
    assert proc.returncode == 130
    assert err.splitlines() == [err.strip()] and err.startswith("error: ") and "interrupted" in err
    assert "Traceback" not in err
    assert list(scratch.iterdir()) == [], "the private copy is removed"


# A Ctrl-C whose KeyboardInterrupt Python loses (tests/lost_ctrl_c.py), planted at the
# start-up's quick check.
_LOST_CTRL_C = lost_ctrl_c.script("rolloutdb.store", "quick_check")


@pytest.mark.parametrize("query", [RUNAWAY, None], ids=["runaway query", "summary"])
def test_ctrl_c_whose_exception_python_lost_still_stops_inspect(store_file, tmp_path, query):
    extra = ["--sql", query, "--timeout", "30"] if query else []
    proc = subprocess.run([sys.executable, "-c", _LOST_CTRL_C, "inspect", str(store_file), *extra],
                          capture_output=True, text=True, timeout=120)
    assert "Exception ignored" in proc.stderr, proc.stderr  # the plant worked: the exception was lost
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines()[-1] == "error: interrupted", proc.stderr
    if query:
        assert proc.stdout == ""  # stopped, not run to its --timeout (a summary is printed before the check)


def test_sigterm_during_a_query_on_a_private_copy_removes_the_copy(store_file, tmp_path):
    import signal

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = _start_runaway(_wal_without_shm(store_file, tmp_path), scratch)
    assert len(list(scratch.iterdir())) == 1, "the private copy exists while the query runs"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143
    assert err.splitlines() == [err.strip()] and err.startswith("error: ") and "terminated" in err
    assert list(scratch.iterdir()) == [], "the private copy is removed"


@pytest.mark.parametrize("sql", [
    "SELECT fts3_tokenizer('simple', x'0000000000000000')",
    "SELECT fts3_tokenizer('simple')",
    "SELECT load_extension('/nonexistent')",
    "SELECT sqlite_log(1, 'x')",
    "SELECT rtreenode(2, x'00')",
])
def test_functions_not_known_to_be_pure_are_refused_naming_the_function(store_file, sql):
    before, files = sha256(store_file), listing(store_file.parent)
    result = inspect(store_file, "--sql", sql)
    assert result.returncode == 2
    name = sql.split("SELECT ")[1].split("(")[0]
    assert_one_error_line(result, "refused", name)
    assert sha256(store_file) == before and listing(store_file.parent) == files


def test_ordinary_functions_still_work_under_the_allow_list(store_file):
    sql = ("SELECT count(*), max(group_id), hex(x'ab'), json_extract('{\"a\": 1}', '$.a'), printf('%d', 3), "
           "abs(-1), coalesce(NULL, 2), typeof(1.5), round(2.5), length('abc'), group_concat(state), "
           "row_number() OVER () FROM prompt_groups")
    result = inspect(store_file, "--sql", sql)
    assert result.returncode == 0, result.stderr
    assert inspect(store_file, "--sql", "SELECT key FROM json_each('[1,2]')").returncode == 0
