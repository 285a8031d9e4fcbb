"""Schema versions: every committed fixture upgrades to head, keeps its data and resumes a
run; head files are left alone; the migrated schema is the ORM's; downgrade works.

Every fixture is a real store file made at its revision by tests/fixtures/make_fixture.py.
Each test works on a copy in tmp_path and reads results through fresh connections.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from rolloutdb.store import FinishedGeneration, Reservation, Store, codec, queries
from rolloutdb.store.live.invariants import audit_prompts, check_invariants
from rolloutdb.store.sqlite.revision import head_revision, known_revisions, run_migrations
from rolloutdb.store.sqlite.upgrade import upgrade_file
from rolloutdb.store.live.schema import metadata

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
REVISIONS = known_revisions()
HEAD = head_revision()


def fixture_path(revision: str) -> Path:
    return FIXTURES / f"store_{revision}.sqlite"


@pytest.fixture(params=REVISIONS)
def fixture_copy(request, tmp_path) -> tuple[str, Path]:
    """A copy of the committed fixture of one revision. Fails (does not skip) when a
    revision has no fixture: every new revision must commit one."""
    revision = request.param
    src = fixture_path(revision)
    assert src.is_file(), (
        f"revision {revision} has no fixture; run "
        f"`python tests/fixtures/make_fixture.py {revision} {src.relative_to(REPO)}` and commit it"
    )
    dst = tmp_path / "store" / src.name
    dst.parent.mkdir()
    shutil.copyfile(src, dst)
    return revision, dst


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def _connect(path: Path):
    with contextlib.closing(sqlite3.connect(path)) as conn:
        yield conn


def _tables(conn: sqlite3.Connection) -> list[str]:
    return [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]


def _content(conn: sqlite3.Connection, table: str, columns: list[str]) -> list[tuple]:
    cols = ", ".join(columns)
    return conn.execute(f"SELECT {cols} FROM {table} ORDER BY {cols}").fetchall()


def _invariant_problems(path: Path) -> list[str]:
    with _connect(path) as conn:
        conn.execute("BEGIN")
        return check_invariants(conn).problems


def _load_make_fixture():
    spec = importlib.util.spec_from_file_location("make_fixture", FIXTURES / "make_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- fixtures


def test_every_known_revision_has_a_committed_fixture_and_no_fixture_is_stray():
    on_disk = {p.name for p in FIXTURES.glob("store_*.sqlite")}
    assert on_disk == {fixture_path(r).name for r in REVISIONS}


def _before(revision: str, other: str) -> bool:
    """Whether `revision` comes before `other` in the chain (ids do not sort as text: v1_10_a)."""
    return REVISIONS.index(revision) < REVISIONS.index(other)


def test_each_fixture_is_at_its_own_revision_sound_and_standalone(fixture_copy):
    revision, path = fixture_copy
    with _connect(path) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(revision,)]
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        states = dict(conn.execute("SELECT state, count(*) FROM prompt_groups GROUP BY state"))
        reasons = {r for (r,) in conn.execute("SELECT DISTINCT abandon_reason FROM rollouts WHERE abandon_reason IS NOT NULL")}
        for table in ("samples", "replay_groups", "spare_prompts", "step_shortfall",
                      "token_chunks", "env_episodes", "snapshot_attempts", "run_meta", "sampler_state"):
            assert conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] > 0, table
        if _before(revision, "v1_7_a"):  # the table's last revision: rows to drop on upgrade
            assert conn.execute("SELECT count(*) FROM finalizer_results").fetchone()[0] > 0
    if not _before(revision, "v1_4_a"):  # settled groups are a record, not rows (make_fixture._settled_ranges, _settled_steps)
        with _connect(path) as conn:
            states.update(queries.settled_counts(conn))
    assert set(states) == {"reserved", "dispatched", "sealed", "published", "trained", "discarded"}
    assert reasons == {"restart", "deadline", "error"}
    assert _invariant_problems(path) == []
    assert path.stat().st_size < 512 * 1024


def test_each_committed_fixture_equals_a_fresh_run_of_its_generator(fixture_copy, tmp_path):
    """The generator and its frozen writers still make exactly the committed file's content
    (compared as SQL, sorted: SQLAlchemy creates a table's indexes in set order)."""
    revision, path = fixture_copy
    fresh = _load_make_fixture().make_fixture(revision, tmp_path / "fresh.sqlite")
    with _connect(path) as committed, _connect(fresh) as regenerated:
        assert sorted(regenerated.iterdump()) == sorted(committed.iterdump())


# ----------------------------------------------------------------------------- upgrade


def test_each_fixture_upgrades_to_head_keeping_every_row(fixture_copy):
    revision, path = fixture_copy
    with _connect(path) as before:
        tables = _tables(before)
        old = {t: (_columns(before, t), _content(before, t, _columns(before, t))) for t in tables}
        counts = {t: before.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables}
        blobs = before.execute("SELECT sample_id, token_ids, logprobs FROM samples ORDER BY sample_id").fetchall()

    assert upgrade_file(path) == (revision, HEAD)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no tmp, -wal, -shm

    settled_rows = old.get("settled_ranges", ([], []))[1]
    old_groups = old["prompt_groups"]
    if "settled_ranges" not in old and "settled_steps" not in old:
        # v1_4_a: settled groups and their attempts leave; expect the ranges computed here
        # from the old rows, and every other row kept.
        group_cols = old["prompt_groups"][0]
        at = {c: i for i, c in enumerate(group_cols)}
        settled = sorted((r[at["sample_seq"]], r[at["state"]], r[at["trained_step"]], r[at["target_step"]],
                          r[at["discard_reason"]], r[at["group_id"]]) for r in old["prompt_groups"][1]
                         if r[at["state"]] in ("trained", "discarded"))
        gone = {g for *_, g in settled}
        expected_ranges: list[list] = []
        for seq, *key, _g in settled:
            if expected_ranges and expected_ranges[-1][1] == seq and expected_ranges[-1][2:] == key:
                expected_ranges[-1][1] = seq + 1
            else:
                expected_ranges.append([seq, seq + 1, *key])
        settled_rows = [tuple(r) for r in expected_ranges]
        assert gone and settled_rows
        keep = {"prompt_groups": lambda r: r[at["group_id"]] not in gone,
                "rollouts": lambda r: r[old["rollouts"][0].index("group_id")] not in gone}
        for table, test in keep.items():
            columns, rows = old[table]
            old[table] = (columns, [r for r in rows if test(r)])
            counts[table] = len(old[table][1])
    # Each settled position's outcome, from the old rows or ranges: (outcome, trained
    # step, stamped step, reason); v1_5_a keeps the stamped step of trained positions only.
    outcomes = {seq: (o, t, s if o == "trained" else None, r) for a, b, o, t, s, r in settled_rows for seq in range(a, b)}
    if "settled_steps" in old:
        outcomes = None  # already at v1_5_a: its rows must be kept as they are (checked with the others)
    old.pop("settled_ranges", None)
    old.pop("finalizer_results", None)  # v1_7_a: the table goes with its rows (nothing wrote or read them)
    transcripts = None
    columns, rows = old["env_episodes"]
    if "token_ids" in columns:
        # v1_11_a: each transcript leaves its row for episode_tokens; the rest of the row stays.
        at = {c: i for i, c in enumerate(columns)}
        transcripts = {r[at["attempt_id"]]: tuple(r[at[c]] for c in ("token_ids", "logprobs", "version_token_counts"))
                       for r in rows}
        kept = [c for c in columns if c not in ("token_ids", "logprobs", "version_token_counts")]
        old["env_episodes"] = (kept, sorted(tuple(r[at[c]] for c in kept) for r in rows))
    with _connect(path) as after:
        assert after.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD,)]
        assert after.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        # v1_5_a: settled_steps instead of settled_ranges; v1_7_a: no finalizer_results
        assert set(_tables(after)) >= set(tables) - {"settled_ranges", "finalizer_results"}
        assert "finalizer_results" not in _tables(after)
        for table, (columns, rows) in old.items():
            if table == "alembic_version":
                continue
            assert after.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == counts[table], table
            assert _content(after, table, columns) == rows, table
        if transcripts is not None:
            assert transcripts, "the fixture has no episodes"
            for attempt_id, (tokens, logprobs, runs) in transcripts.items():
                n = after.execute("SELECT transcript_tokens FROM env_episodes WHERE attempt_id = ?",
                                  (attempt_id,)).fetchone()[0]
                pieces = after.execute("SELECT first_token, token_ids, logprobs, version_token_counts FROM "
                                       "episode_tokens WHERE attempt_id = ? ORDER BY first_token", (attempt_id,)).fetchall()
                if tokens is None or logprobs is None or runs is None:  # no transcript: none after
                    assert (n, pieces) == (None, [])
                    continue
                assert n == len(tokens) // 4
                assert pieces == ([(0, tokens, logprobs, runs)] if tokens else [])
        if outcomes is not None:
            got = {seq: (r.outcome, r.trained_step, r.target_step, r.discard_reason)
                   for r in queries.settled_runs(after) for seq in range(r.start, r.end)}
            assert got == outcomes
        # v1_5_a: one row per trained step, the discards coded inside: the rows make_fixture
        # writes out by hand for PLAN, whatever revision the file came from.
        # v1_12_a: a file that was already there folded the rows below FOLDED_BELOW into
        # settled_prefix (kept as they were: checked with the other tables); an older file
        # upgrades with nothing folded.
        fixture = _load_make_fixture()
        steps, reasons = fixture._settled_steps()
        below = fixture.FOLDED_BELOW if "settled_prefix" in old else 0
        assert after.execute("SELECT seq_start, seq_end, trained_step, target_step, others FROM settled_steps "
                             "ORDER BY seq_start").fetchall() == [tuple(r.values()) for r in steps if r["seq_start"] >= below]
        if "settled_prefix" not in old:
            assert after.execute("SELECT count(*) FROM settled_prefix").fetchone()[0] == 0
        assert after.execute("SELECT code, reason FROM discard_reasons ORDER BY code").fetchall() == [
            tuple(r.values()) for r in reasons]
        if "settled_prompts" not in old:
            # v1_4_a: each epoch's settled prompt ids as a bitmap (bit p % 8 of byte p // 8)
            # and its count of settled groups, written out here from the old rows.
            group_cols = old_groups[0]
            at = {c: i for i, c in enumerate(group_cols)}
            want: dict[int, tuple[bytearray, int]] = {}
            for r in old_groups[1]:
                if r[at["state"]] in ("trained", "discarded"):
                    bits, n = want.get(r[at["epoch"]], (bytearray(), 0))
                    p = r[at["prompt_id"]]
                    bits.extend(bytes(max(0, p // 8 + 1 - len(bits))))
                    bits[p // 8] |= 1 << (p % 8)
                    want[r[at["epoch"]]] = (bits, n + 1)
            # v1_9_a: the fixtures' 32 prompts are all in chunk 0 of their epoch.
            assert after.execute("SELECT epoch, chunk, bits, settles FROM settled_prompts ORDER BY epoch").fetchall() == [
                (e, 0, bytes(b), n) for e, (b, n) in sorted(want.items())]
        assert counts["samples"] > 0
        for sample_id, tokens, logprobs in blobs:
            t2, l2 = after.execute("SELECT token_ids, logprobs FROM samples WHERE sample_id = ?", (sample_id,)).fetchone()
            assert codec.decode_tokens(t2).tolist() == codec.decode_tokens(tokens).tolist()
            assert codec.decode_logprobs(l2).tobytes() == codec.decode_logprobs(logprobs).tobytes()
        runs = after.execute("SELECT policy_version, num_tokens, version_token_counts FROM samples").fetchall()
    if "version_token_counts" not in old["samples"][0]:
        # The data migration: every old sample's tokens all count under its one version.
        assert all(json.loads(vtc) == [[v, n]] for v, n, vtc in runs)
    assert all(sum(n for _, n in json.loads(vtc)) == total for _, total, vtc in runs)
    assert _invariant_problems(path) == []


def test_a_run_resumes_from_each_upgraded_fixture(fixture_copy):
    """Open the upgraded file as a live store and drive every transition through the API:
    sealed groups enter replay, replay groups are trained, an in-flight group finishes
    its running attempts (their prefix chunks go) and is sealed and published, in-flight
    groups holding environment episodes are discarded, a reserved group goes all the way
    to replay, and the sampler hands out a new prompt."""
    _, path = fixture_copy
    upgrade_file(path)
    with _connect(path) as conn:
        by_state: dict[str, list[int]] = {}
        seqs: dict[int, int] = {}
        for gid, state, seq in conn.execute("SELECT group_id, state, sample_seq FROM prompt_groups ORDER BY group_id"):
            by_state.setdefault(state, []).append(gid)
            seqs[gid] = seq
        with_episodes = {g for (g,) in conn.execute(
            "SELECT DISTINCT a.group_id FROM env_episodes e JOIN rollouts a USING (attempt_id)")}
        in_flight = [g for g in by_state["dispatched"] if g not in with_episodes]
        running = [a for (a,) in conn.execute(
            f"SELECT attempt_id FROM rollouts WHERE state = 'running' AND group_id IN ({','.join(map(str, in_flight))})")]
        cursor, epoch = conn.execute("SELECT next_seq, epoch FROM sampler_state").fetchone()
        taken = {p for (p,) in conn.execute(
            "SELECT prompt_id FROM prompt_groups WHERE epoch = ?1 UNION SELECT prompt_id FROM spare_prompts WHERE epoch = ?1",
            (epoch,))}
        counter = conn.execute("SELECT mutation_counter FROM run_meta").fetchone()[0]
        replay_before = conn.execute("SELECT count(*) FROM replay_groups").fetchone()[0]
    assert in_flight and running and with_episodes, "the fixture lacks in-flight work to resume"

    gen = FinishedGeneration([5, 6, 7], [-0.25, -0.5, -1.0], 1.0, [(5, 2), (6, 1)])
    reserved = by_state["reserved"][:1]
    with Store.open(path) as store:
        store.enter_replay(by_state["sealed"])
        store.mark_trained(by_state["published"], step=6)
        for attempt_id in running:
            store.finish(attempt_id, gen)
        store.seal(in_flight)
        store.enter_replay(in_flight)
        store.discard(sorted(with_episodes), reason="resume_check")
        for attempt_id in store.dispatch(reserved, policy_version=6):
            store.finish(attempt_id, gen)
        store.seal(reserved)
        store.enter_replay(reserved)
        new_prompt = min(set(range(10_000)) - taken)
        (new_gid,) = store.reserve([Reservation(cursor, epoch, new_prompt)], num_generations=2, target_step=9)

    with _connect(path) as conn:
        states = dict(conn.execute("SELECT group_id, state FROM prompt_groups"))
        # Trained and discarded groups left the ledger; their positions are in the settled record.
        assert not set(states) & set(by_state["published"] + sorted(with_episodes))
        settled = {seq: (r.outcome, r.trained_step, r.discard_reason)
                   for r in queries.settled_runs(conn) for seq in range(r.start, r.end)}
        assert {settled[seqs[g]] for g in by_state["published"]} == {("trained", 6, None)}
        assert {settled[seqs[g]] for g in with_episodes} == {("discarded", None, "resume_check")}
        assert {states[g] for g in by_state["sealed"] + in_flight + reserved} == {"published"}
        assert states[new_gid] == "reserved"
        assert conn.execute("SELECT next_seq FROM sampler_state").fetchone()[0] == cursor + 1
        assert conn.execute("SELECT mutation_counter FROM run_meta").fetchone()[0] > counter
        replay_after = conn.execute("SELECT count(*) FROM replay_groups").fetchone()[0]
        assert replay_after == replay_before - len(by_state["published"]) + len(by_state["sealed"] + in_flight + reserved)
        assert conn.execute("SELECT count(*) FROM token_chunks WHERE attempt_id IN "
                            f"({','.join(map(str, running))})").fetchone()[0] == 0
    assert _invariant_problems(path) == []


def test_upgrading_a_file_already_at_head_changes_nothing(tmp_path):
    path = tmp_path / "head.sqlite"
    shutil.copyfile(fixture_path(HEAD), path)
    digest = _sha256(path)
    assert upgrade_file(path) == (HEAD, HEAD)
    assert _sha256(path) == digest
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_upgrading_an_upgraded_file_again_changes_nothing(tmp_path):
    path = tmp_path / "old.sqlite"
    shutil.copyfile(fixture_path(REVISIONS[0]), path)
    upgrade_file(path)
    digest = _sha256(path)
    assert upgrade_file(path) == (HEAD, HEAD)
    assert _sha256(path) == digest


# ----------------------------------------------------------------------------- schema


def _diff_with_metadata(path: Path) -> list:
    engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            return compare_metadata(ctx, metadata)
    finally:
        engine.dispose()


def _split_top_level(body: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in body:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    parts.append("".join(current).strip())
    return parts


def _normalised_schema(path: Path) -> dict[tuple[str, str], object]:
    """sqlite_master DDL with quoting and whitespace normalised; a table's columns and
    constraints compared as a set (batch migrations append columns at the end)."""
    out = {}
    with _connect(path) as conn:
        for kind, name, sql in conn.execute("SELECT type, name, sql FROM sqlite_master WHERE tbl_name != 'alembic_version'"):
            if sql is None:  # automatic indexes of UNIQUE / PRIMARY KEY: named by position
                out[(kind, name)] = None
                continue
            sql = re.sub(r"\s+", " ", sql.replace('"', "")).strip()
            if kind == "table":
                head, body = sql.split("(", 1)
                out[(kind, name)] = (head.strip(), frozenset(_split_top_level(body.rsplit(")", 1)[0])))
            else:
                out[(kind, name)] = sql
    return out


def test_a_freshly_migrated_file_matches_the_orm_metadata(tmp_path):
    path = tmp_path / "migrated.sqlite"
    run_migrations(path)
    assert _diff_with_metadata(path) == []


def test_the_migrated_ddl_equals_the_orm_ddl_including_check_constraints(tmp_path):
    """compare_metadata ignores CHECK constraints; compare the DDL SQLite stores."""
    migrated, built = tmp_path / "migrated.sqlite", tmp_path / "built.sqlite"
    run_migrations(migrated)
    engine = create_engine(f"sqlite:///{built}", poolclass=NullPool)
    metadata.create_all(engine)
    engine.dispose()
    a, b = _normalised_schema(migrated), _normalised_schema(built)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key] == b[key], key
    assert any("CHECK" in clause for _, clauses in (v for k, v in a.items() if k[0] == "table") for clause in clauses)


def test_an_upgraded_fixture_matches_the_orm_metadata(fixture_copy):
    _, path = fixture_copy
    upgrade_file(path)
    assert _diff_with_metadata(path) == []


def test_downgrade_to_base_leaves_only_alembic_version_and_upgrade_works_again(fixture_copy):
    _, path = fixture_copy
    upgrade_file(path)
    run_migrations(path, "base", downgrade=True)
    with _connect(path) as conn:
        # sqlite_sequence (AUTOINCREMENT ids, v1_4_a) is SQLite's own and cannot be dropped.
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE name NOT LIKE 'sqlite_autoindex_alembic%' "
                                            "AND name != 'sqlite_sequence'")}
        assert names == {"alembic_version"}
        assert conn.execute("SELECT count(*) FROM alembic_version").fetchone()[0] == 0
    run_migrations(path)
    with _connect(path) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD,)]
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert _diff_with_metadata(path) == []


def test_each_step_down_and_up_again_keeps_the_schema_equal_to_head(tmp_path):
    path = tmp_path / "steps.sqlite"
    run_migrations(path)
    for revision in reversed(REVISIONS[:-1]):
        run_migrations(path, revision, downgrade=True)
        with _connect(path) as conn:
            assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(revision,)]
    run_migrations(path)
    assert _diff_with_metadata(path) == []


def test_the_alembic_command_line_upgrades_a_copy_of_the_oldest_fixture(tmp_path):
    path = tmp_path / "cli.sqlite"
    shutil.copyfile(fixture_path(REVISIONS[0]), path)
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "-x", f"db={path}", "upgrade", "head"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    with _connect(path) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD,)]
        assert conn.execute("SELECT count(*) FROM samples WHERE version_token_counts IS NULL").fetchone()[0] == 0
    assert _invariant_problems(path) == []


def test_v1_9_a_cuts_each_epoch_bitmap_into_chunks_and_a_downgrade_joins_them_again(tmp_path):
    """An epoch bitmap spanning three chunks of 4096 prompt ids, with one prompt settled
    twice (settles one above its set bits), becomes its non-empty chunks; the excess stays
    with the epoch (its first chunk), so verify still counts the duplicate."""
    path = tmp_path / "store.sqlite"
    run_migrations(path, "v1_8_a")
    bits = bytearray(9001 // 8 + 1)
    for p in (5, 9000):  # chunks 0 and 2; chunk 1 (ids 4096..8191) stays empty
        bits[p // 8] |= 1 << (p % 8)
    with _connect(path) as conn, conn:
        conn.execute("INSERT INTO settled_prompts (epoch, bits, settles) VALUES (0, ?, 3), (1, x'', 0)", (bytes(bits),))
    run_migrations(path, "v1_9_a")
    with _connect(path) as conn:
        rows = conn.execute("SELECT epoch, chunk, bits, settles FROM settled_prompts ORDER BY epoch, chunk").fetchall()
        assert rows == [(0, 0, bytes([0x20]), 2), (0, 2, bytes(101) + bytes([0x01]), 1), (1, 0, b"", 0)]
        assert audit_prompts(conn).twice == ["epoch 0: 1 prompt(s) settled twice"]
    run_migrations(path, "v1_8_a", downgrade=True)
    with _connect(path) as conn:
        assert conn.execute("SELECT epoch, bits, settles FROM settled_prompts ORDER BY epoch").fetchall() == [
            (0, bytes(bits), 3), (1, b"", 0)]


def test_v1_11_a_downgrade_joins_each_transcripts_pieces_into_its_row_and_upgrade_cuts_it_again(tmp_path):
    """The v1_11_a fixture's transcripts are one piece per turn; a downgrade to v1_10_a
    joins them into the row (tokens and logprobs end to end, the version runs merged
    where two pieces meet on one version), and an upgrade makes each one piece again."""
    path = tmp_path / "store.sqlite"
    shutil.copyfile(FIXTURES / "store_v1_11_a.sqlite", path)
    with _connect(path) as conn:
        pieces: dict[int, list[tuple]] = {}
        for a, first, t, lp, runs in conn.execute("SELECT attempt_id, first_token, token_ids, logprobs, "
                                                  "version_token_counts FROM episode_tokens ORDER BY attempt_id, first_token"):
            pieces.setdefault(a, []).append((first, t, lp, json.loads(runs)))
    assert any(len(p) > 1 for p in pieces.values()), "the fixture should hold transcripts of several pieces"
    want = {}
    for a, ps in pieces.items():
        versions = [v for *_, runs in ps for v, n in runs for _ in range(n)]
        want[a] = (b"".join(p[1] for p in ps), b"".join(p[2] for p in ps), versions)
    run_migrations(path, "v1_10_a", downgrade=True)
    with _connect(path) as conn:
        got = {a: (t, lp, [v for v, n in json.loads(runs) for _ in range(n)])
               for a, t, lp, runs in conn.execute("SELECT attempt_id, token_ids, logprobs, version_token_counts "
                                                  "FROM env_episodes WHERE token_ids IS NOT NULL")}
        merged = [json.loads(r) for (r,) in conn.execute("SELECT version_token_counts FROM env_episodes")]
    assert got == want
    assert all(a[0] != b[0] for runs in merged for a, b in zip(runs, runs[1:]))  # adjacent runs of one version merged
    run_migrations(path)
    with _connect(path) as conn:
        assert {a: (t, lp) for a, first, t, lp in conn.execute(
            "SELECT attempt_id, first_token, token_ids, logprobs FROM episode_tokens")} == {
            a: w[:2] for a, w in want.items()}
        assert conn.execute("SELECT count(*) FROM episode_tokens WHERE first_token != 0").fetchone() == (0,)


def test_v1_12_a_downgrade_writes_the_folded_prefix_back_as_one_row_settling_each_position_once(tmp_path):
    """The v1_12_a fixture folded positions 0..7 (steps 1 and 2: 7 trained, position 5
    discarded for zero reward variance). v1_11_a has no counts, so a downgrade writes
    them as one `settled_steps` row from 0, by hand: the 7 trained first at step 2, then
    the discard (varints gap 7, length 1, code 3 = zero_reward_variance). Which step
    trained which position is gone; every position stays settled once."""
    path = tmp_path / "store.sqlite"
    shutil.copyfile(FIXTURES / "store_v1_12_a.sqlite", path)
    with _connect(path) as conn:
        assert conn.execute("SELECT seq_end, trained, discarded, through_step FROM settled_prefix").fetchall() == [
            (8, 7, '{"zero_reward_variance": 1}', 2)]
        kept = conn.execute("SELECT * FROM settled_steps ORDER BY seq_start").fetchall()
    run_migrations(path, "v1_11_a", downgrade=True)
    with _connect(path) as conn:
        assert "settled_prefix" not in _tables(conn)
        assert conn.execute("SELECT * FROM settled_steps ORDER BY seq_start").fetchall() == [
            (0, 8, 2, None, bytes([7, 1, 3]))] + kept
        assert conn.execute("SELECT code FROM discard_reasons WHERE reason = 'zero_reward_variance'").fetchone() == (3,)
    assert _invariant_problems(path) == []
    run_migrations(path)
    assert _invariant_problems(path) == []
