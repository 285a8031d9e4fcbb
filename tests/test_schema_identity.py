"""Strict schema identification: a store file is at revision X only when alembic_version
holds exactly one row, X is one of our revisions, and the file's schema is the one the
migrations build for X. Every refusal is one line naming what is wrong, from verify,
inspect, upgrade and restore alike, and changes nothing on disk."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutdb.store.sqlite.identity import revision_fingerprints, schema_fingerprint
from rolloutdb.store.sqlite.revision import head_revision, known_revisions
from rolloutdb.store.sqlite.upgrade import upgrade_file

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
REVISIONS = known_revisions()
HEAD = head_revision()
OLDEST = REVISIONS[0]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rolloutdb", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def state(directory: Path) -> dict[str, tuple[str, int]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(directory.iterdir())}


def fingerprint_of(path: Path):
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)) as conn:
        return schema_fingerprint(conn)


# ----------------------------------------------------------------------------- fingerprints


@pytest.mark.parametrize("revision", REVISIONS)
def test_every_committed_fixture_has_the_schema_the_migrations_build_for_its_revision(revision):
    assert fingerprint_of(FIXTURES / f"store_{revision}.sqlite") == revision_fingerprints()[revision]


def test_no_two_revisions_share_a_fingerprint():
    prints = revision_fingerprints()
    assert list(prints) == REVISIONS
    assert len({repr(p) for p in prints.values()}) == len(REVISIONS)


@pytest.mark.parametrize("revision", REVISIONS)
def test_each_fixture_upgraded_to_head_has_the_head_fingerprint(revision, tmp_path):
    path = tmp_path / "s.sqlite"
    shutil.copyfile(FIXTURES / f"store_{revision}.sqlite", path)
    upgrade_file(path)
    assert fingerprint_of(path) == revision_fingerprints()[HEAD]


def test_the_fingerprint_ignores_sqlite_internal_tables(tmp_path):
    path = tmp_path / "s.sqlite"
    shutil.copyfile(FIXTURES / f"store_{HEAD}.sqlite", path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("ANALYZE")  # creates sqlite_stat1
        conn.commit()
    assert fingerprint_of(path) == revision_fingerprints()[HEAD]


def test_the_cli_starts_without_running_the_migrations():
    code = ("import rolloutdb.cli as c, rolloutdb.store.sqlite.identity as i; c.build_parser(); "
            "print(i.revision_fingerprints.cache_info().currsize)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0", out.stderr


# ----------------------------------------------------------------------------- mislabelled files


def _sql(statement: str):
    def make(path: Path) -> None:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.executescript(statement)
    return make


# (how the file is made from a copy of the fixture of `revision`, the words of the refusal)
BAD = {
    "two rows": (HEAD, _sql(f"INSERT INTO alembic_version VALUES ('{OLDEST}x')"), "alembic_version holds 2 rows"),
    "empty table": (HEAD, _sql("DELETE FROM alembic_version"), "alembic_version is empty"),
    "NULL version": (HEAD, _sql(
        "CREATE TABLE av2 (version_num VARCHAR(32)); INSERT INTO av2 VALUES (NULL); DROP TABLE alembic_version; "
        "ALTER TABLE av2 RENAME TO alembic_version"), "alembic_version holds a NULL"),
    "old schema labelled head": (OLDEST, _sql(f"UPDATE alembic_version SET version_num = '{HEAD}'"),
                                 f"schema does not match revision {HEAD}"),
    "unknown id": (HEAD, _sql("UPDATE alembic_version SET version_num = 'v9_9_z'"),
                   f"unknown schema revision v9_9_z (known: {', '.join(REVISIONS)})"),
    "no version table": (HEAD, _sql("DROP TABLE alembic_version"), "no alembic_version table"),
    "an extra table": (HEAD, _sql("CREATE TABLE notes (x TEXT)"), f"schema does not match revision {HEAD}"),
}


def _make_bad(case: str, tmp_path: Path) -> Path:
    revision, make, _ = BAD[case]
    directory = tmp_path / "files"
    directory.mkdir(parents=True)
    path = directory / "s.sqlite"
    shutil.copyfile(FIXTURES / f"store_{revision}.sqlite", path)
    make(path)
    return path


@pytest.mark.parametrize("command", ["verify", "inspect", "upgrade"])
@pytest.mark.parametrize("case", list(BAD))
def test_a_mislabelled_file_is_refused_in_one_precise_line_and_left_as_it_is(case, command, tmp_path):
    path = _make_bad(case, tmp_path)
    before = state(path.parent)
    result = cli(command, path)
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert BAD[case][2] in lines[0], lines[0]
    assert str(path) in lines[0]
    assert "Traceback" not in result.stderr
    assert state(path.parent) == before


def test_an_old_schema_labelled_head_is_told_which_revision_it_matches(tmp_path):
    path = _make_bad("old schema labelled head", tmp_path)
    result = cli("verify", path)
    assert f"its schema is that of {OLDEST}" in result.stderr
    # The first two differences are named, the rest counted: v1_11_a's
    # env_episodes.transcript_tokens and episode_tokens table (v1_2_a's three episode
    # columns are gone again at head), v1_1_a's samples.version_token_counts, v1_3_a's token_chunks.logprobs,
    # v1_4_a's settled_prompts table, v1_5_a's settled_steps and discard_reasons tables,
    # v1_12_a's settled_prefix table and
    # v1_6_a's payload_segments table and samples' segment reference (its column, index and
    # constraints) are missing (v1_4_a's settled_ranges is gone again at head), and v1_0_a's
    # finalizer_results table is unexpected (v1_7_a drops it); so is v1_8_a's segment
    # reference of token_chunks (its columns and constraints), and rollouts' indexes on
    # group_id and state (v1_13_a drops them), and its partial index of abandoned attempts.
    assert ("table discard_reasons is missing; column env_episodes.transcript_tokens is missing; and 19 more"
            in result.stderr)


def test_only_a_missing_table_is_called_no_alembic_version_table(tmp_path):
    for case in ("two rows", "empty table", "NULL version"):
        path = _make_bad(case, tmp_path / case.replace(" ", "_"))
        assert "no alembic_version table" not in cli("inspect", path).stderr


@pytest.mark.parametrize("case", ["two rows", "empty table", "NULL version", "old schema labelled head"])
def test_restore_refuses_a_mislabelled_snapshot_and_changes_nothing(case, tmp_path):
    from test_restore import SnapshotDamaged, assert_refused_and_unchanged, build_ledger_run, rewrite_snapshot

    run = build_ledger_run(tmp_path)
    if case == "old schema labelled head":
        statement = f"ALTER TABLE samples DROP COLUMN version_token_counts; UPDATE alembic_version SET version_num = '{HEAD}';"
    else:
        statement = {"two rows": f"INSERT INTO alembic_version VALUES ('{OLDEST}');",
                     "empty table": "DELETE FROM alembic_version;",
                     "NULL version": "UPDATE alembic_version SET version_num = NULL;"}[case]
    if case == "NULL version":
        statement = ("CREATE TABLE av2 (version_num VARCHAR(32)); INSERT INTO av2 VALUES (NULL); "
                     "DROP TABLE alembic_version; ALTER TABLE av2 RENAME TO alembic_version;")
    db = run.snap / "rollout_state.sqlite"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.executescript(statement)
    rewrite_snapshot(run.snap, "SELECT 1;") if case == "old schema labelled head" else _reseal(run.snap)
    expected = {"two rows": "alembic_version holds 2 rows", "empty table": "alembic_version is empty",
                "NULL version": "alembic_version holds a NULL", "old schema labelled head": "schema does not match"}[case]
    assert_refused_and_unchanged(run, SnapshotDamaged, expected)


def _reseal(snap: Path) -> None:
    from rolloutdb.store.checkpoints.manifest import describe_files, read_manifest

    manifest = read_manifest(snap)
    manifest.files = describe_files(snap)
    (snap / "manifest.json").write_bytes(manifest.to_json())
