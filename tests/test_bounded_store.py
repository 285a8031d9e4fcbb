"""A bounded live store: settled groups leave it, and exactly-once stays provable.

A trained or discarded group leaves `prompt_groups` and its attempts leave `rollouts` in
the commit that settles it; its sampler position joins a `settled_steps` row, about one
per train step, the discards coded in a small blob (store/live/compaction.py), and its
(epoch, prompt id) sets a bit of its epoch's bitmap in `settled_prompts`. These tests drive the real Store (real SQLite files), read
what is persisted through a second connection, and compute what they expect by hand.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutdb.store import FinishedGeneration, IllegalTransition, Reservation, Store, check_invariants, pools, queries
from rolloutdb.store.restore.choice import audit_ledger

GROUPS_PER_STEP = 4
GENERATIONS = 2
ZERO = "zero_reward_variance"


def _gen(reward: float) -> FinishedGeneration:
    return FinishedGeneration([1, 2, 3], [-0.1, -0.2, -0.3], reward, [(0, 3)])


class Run:
    """A GRPO-shaped loop over the Store API: each step stamps GROUPS_PER_STEP groups,
    one step ahead of training (so one step's groups are always in flight), discards the
    positions listed in `discards` (and refills the step with the next position)."""

    def __init__(self, path: Path, discards: set[int] = frozenset()):
        self.store = Store.create(path, replay_capacity=64)
        self.discards = set(discards)
        self.seq = 0
        self.published: dict[int, list[int]] = {}

    def stamp(self, step: int) -> None:
        need = GROUPS_PER_STEP
        while need:
            seq = self.seq
            self.seq += 1
            (g,) = self.store.reserve([Reservation(seq, seq // 1000, seq % 1000)], num_generations=GENERATIONS,
                                      target_step=step)
            attempts = self.store.dispatch([g], policy_version=step - 1)
            self.store.abandon(attempts[:1], "deadline")  # a retried generation: two attempt rows
            with self.store.atomic() as tx:
                from rolloutdb.store import ledger
                (retry,) = ledger.start_attempts(tx, [(g, 0)], policy_version=step - 1)
            for i, a in enumerate([retry, *attempts[1:]]):
                self.store.finish(a, _gen(float(i)))
            if seq in self.discards:
                self.store.discard([g], reason=ZERO)
                continue
            self.store.seal([g])
            self.store.enter_replay([g])
            self.published.setdefault(step, []).append(g)
            need -= 1
        with self.store.atomic() as tx:
            pools.advance_cursor(tx, self.seq, self.seq // 1000)

    def train(self, step: int) -> None:
        self.store.mark_trained(self.published.pop(step), step=step)


def _counts(path: Path) -> dict[str, int]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in ("prompt_groups", "rollouts", "samples", "replay_groups", "settled_steps")}


def test_many_settles_keep_the_live_row_counts_bounded_by_what_is_in_flight(tmp_path):
    path = tmp_path / "live.sqlite"
    steps = 120
    discards = {seq for seq in range(0, steps * GROUPS_PER_STEP, 37)}  # a discard now and then
    run = Run(path, discards)
    run.stamp(1)
    peak: dict[str, int] = {}
    for step in range(1, steps + 1):
        run.stamp(step + 1)  # one step ahead: step + 1's groups are in flight while `step` trains
        run.train(step)
        counts = _counts(path)
        for table, n in counts.items():
            peak[table] = max(peak.get(table, 0), n)
        # Exactly what is in flight: step + 1's groups, 3 attempt rows each (a retry).
        assert counts["prompt_groups"] == GROUPS_PER_STEP
        assert counts["rollouts"] == GROUPS_PER_STEP * (GENERATIONS + 1)
        assert counts["samples"] == GROUPS_PER_STEP * GENERATIONS
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert check_invariants(conn).ok
        rows = conn.execute("SELECT seq_start, trained_step, length(others) FROM settled_steps "
                            "ORDER BY seq_start").fetchall()
        runs = queries.settled_runs(conn)
    # One row per step trained, plus one: position 0 is discarded before any step has a
    # row, so it starts a row of discards, which the later discards up to the next
    # trained row's start extend. Never a row per discard or per group.
    assert [t for _, t, _ in rows] == [None] + list(range(1, steps + 1))
    assert peak["settled_steps"] == steps + 1
    # A step's row holds its discards and open positions in a few bytes: at most two
    # entries of three one-byte varints (a discard inside the span; one past its end).
    assert max(n or 0 for *_, n in rows) <= 12
    # Every settled position once, by hand: positions below the in-flight step's, in order.
    settled = sorted(seq for r in runs for seq in range(r.start, r.end))
    assert settled == list(range(len(settled)))
    trained = {seq: r.trained_step for r in runs if r.outcome == "trained" for seq in range(r.start, r.end)}
    assert sorted(trained.values()) == [s for s in range(1, steps + 1) for _ in range(GROUPS_PER_STEP)]
    assert {seq for r in runs if r.outcome == "discarded" for seq in range(r.start, r.end)} == \
        {d for d in discards if d < len(settled)}


def test_a_group_settled_in_one_commit_leaves_no_row_and_its_position_joins_its_steps_row(tmp_path):
    path = tmp_path / "live.sqlite"
    run = Run(path)
    run.stamp(1)
    run.stamp(2)
    run.train(1)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT * FROM settled_steps").fetchall() == [(0, 4, 1, 1, None)]
    # Step 2's groups are positions 4..7; train them in two commits: the second joins the
    # first's row (still one row for the step).
    first, second = run.published[2][:2], run.published[2][2:]
    run.store.mark_trained(first, step=2)
    run.store.mark_trained(second, step=2)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT * FROM settled_steps ORDER BY seq_start").fetchall() == [
            (0, 4, 1, 1, None), (4, 8, 2, 2, None)]
        assert conn.execute("SELECT count(*) FROM prompt_groups").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM rollouts").fetchone()[0] == 0


def test_settling_a_position_already_settled_is_refused_and_changes_nothing(tmp_path):
    path = tmp_path / "live.sqlite"
    run = Run(path)
    run.stamp(1)
    run.train(1)
    # A sampler bug hands position 2 out again: the ledger takes it (its old row is gone)...
    (g,) = run.store.reserve([Reservation(2, 5, 5)], num_generations=1, target_step=2)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        report = check_invariants(conn)  # ...but the invariants see it at once
    assert report.invariants == [1]
    assert "position 2" in report.problems[0]
    before = _counts(path)
    with pytest.raises(IllegalTransition, match="sampler positions 2..2: already settled"):
        run.store.discard([g], reason=ZERO)
    assert _counts(path) == before


def test_scattered_discards_fill_a_row_up_to_64_blob_bytes_and_then_start_another(tmp_path):
    """Every other position discarded, one commit each, nothing trained: the discards
    extend one row (each adds an open entry and a discard entry, 3 one-byte varints
    each: 3 + 6 (k - 1) bytes for k discards) until its blob would pass 64 bytes, so a
    row holds 11 (63 bytes) and 50 discards make rows of 11, 11, 11, 11 and 6."""
    store = Store.create(tmp_path / "live.sqlite", replay_capacity=8)
    ids = store.reserve([Reservation(s, 0, s) for s in range(100)], num_generations=1, target_step=1)
    for seq in range(0, 100, 2):
        store.discard([ids[seq]], reason=ZERO)
    store.close()
    with contextlib.closing(sqlite3.connect(tmp_path / "live.sqlite")) as conn:
        rows = conn.execute("SELECT seq_start, seq_end, trained_step, length(others) FROM settled_steps "
                            "ORDER BY seq_start").fetchall()
        assert rows == [(0, 21, None, 63), (22, 43, None, 63), (44, 65, None, 63), (66, 87, None, 63),
                        (88, 99, None, 33)]
        assert check_invariants(conn).ok
        assert [(r.start, r.outcome, r.discard_reason) for r in queries.settled_runs(conn)] == [
            (seq, "discarded", ZERO) for seq in range(0, 100, 2)]


# ------------------------------------------------------------------ verify reads the record


def _run_dir(tmp_path: Path) -> Path:
    """A finished run of 3 steps with one zero-variance discard (position 5): positions
    0..3 trained at 1, 4 and 6..8 at 2, 9..12 at 3, 5 discarded. The discard (while
    step 2 is stamped) joins step 1's row, the only one then, which extends over 4 (open)
    to 5; step 2's row spans 4..8 with 5 open (BLOB_STEP_1, BLOB_STEP_2)."""
    run_dir = tmp_path / "run"
    run = Run(run_dir / "rollout_state.sqlite", {5})
    for step in (1, 2, 3):
        run.stamp(step)
        run.train(step)
    run.store.close()
    (run_dir / "config.yaml").write_text(f"algorithm:\n  groups_per_step: {GROUPS_PER_STEP}\n")
    return run_dir


# Varints (gap, length, code), code 0 = not settled in the row, 1 = the first discard
# reason coded (zero_reward_variance): by hand from schema.SettledStep's format.
BLOB_STEP_1 = bytes([4, 1, 0, 0, 1, 1])  # 0..3 trained, 4 open, 5 discarded
BLOB_STEP_2 = bytes([1, 1, 0])  # 4 trained, 5 open, 6..8 trained


def _verify(run_dir: Path) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(run_dir), "--json"],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout)


def _plant(run_dir: Path, sql: str) -> None:
    with contextlib.closing(sqlite3.connect(run_dir / "rollout_state.sqlite")) as conn:
        conn.execute(sql)
        conn.commit()


def test_verify_proves_exactly_once_from_the_compacted_record(tmp_path):
    run_dir = _run_dir(tmp_path)
    with contextlib.closing(sqlite3.connect(run_dir / "rollout_state.sqlite")) as conn:
        assert conn.execute("SELECT * FROM settled_steps ORDER BY seq_start").fetchall() == [
            (0, 6, 1, 1, BLOB_STEP_1), (4, 9, 2, 2, BLOB_STEP_2), (9, 13, 3, 3, None)]
        assert conn.execute("SELECT * FROM discard_reasons").fetchall() == [(1, ZERO)]
        assert conn.execute("SELECT count(*) FROM prompt_groups").fetchone()[0] == 0
    code, doc = _verify(run_dir)
    assert code == 0, doc["problems"]
    assert {k: doc[k] for k in ("trained", "discarded", "duplicated", "lost", "pending", "steps")} == {
        "trained": 12, "discarded": 1, "duplicated": 0, "lost": 0, "pending": 0, "steps": 3}


def test_a_settled_row_that_drops_a_position_is_reported_lost(tmp_path):
    run_dir = _run_dir(tmp_path)
    _plant(run_dir, "UPDATE settled_steps SET seq_end = 8 WHERE seq_start = 4")  # position 8 gone
    code, doc = _verify(run_dir)
    assert code == 1
    assert (doc["lost"], doc["duplicated"], doc["trained"]) == (1, 0, 11)
    assert any("neither in the ledger, the spare pool nor a settled range: 8" in p for p in doc["problems"])
    assert any("invariant 1" in p and "missing 1 of 13 positions" in p for p in doc["problems"])


def test_a_settled_row_that_doubles_a_position_is_reported_duplicated(tmp_path):
    run_dir = _run_dir(tmp_path)
    _plant(run_dir, "UPDATE settled_steps SET others = NULL WHERE seq_start = 4")  # 5 trained at 2 and discarded
    code, doc = _verify(run_dir)
    assert code == 1
    assert (doc["lost"], doc["duplicated"]) == (0, 1)
    assert any("positions 5..5 settled twice" in p for p in doc["problems"])
    assert any("invariant 1" in p and "overlap" in p for p in doc["problems"])
    assert any("step 2: 5" in p for p in doc["problems"])  # and step 2 trained one group too many


def test_a_trained_position_whose_step_is_off_by_one_fails_the_audit(tmp_path):
    run_dir = _run_dir(tmp_path)
    _plant(run_dir, "UPDATE settled_steps SET trained_step = 3 WHERE seq_start = 4")  # step 2's row says 3
    code, doc = _verify(run_dir)
    assert code == 1 and (doc["lost"], doc["duplicated"]) == (0, 0)
    assert any("stamped 2 trained 3" in p for p in doc["problems"])
    assert any("step 2: 0" in p and "step 3: 8" in p for p in doc["problems"])


def test_a_position_both_settled_and_live_is_reported_duplicated(tmp_path):
    run_dir = _run_dir(tmp_path)
    # A prompt no one settled (epoch 9), so only the position is doubled, not the prompt.
    _plant(run_dir, "INSERT INTO spare_prompts (sample_seq, epoch, prompt_id, added_at) VALUES (7, 9, 7, 0)")
    code, doc = _verify(run_dir)
    assert code == 1
    assert (doc["lost"], doc["duplicated"]) == (0, 1)
    assert any("position 7 settled and live" in p for p in doc["problems"])


def test_every_settled_group_sets_its_prompts_bit_in_its_epochs_bitmap(tmp_path):
    run_dir = _run_dir(tmp_path)
    with contextlib.closing(sqlite3.connect(f"file:{run_dir / 'rollout_state.sqlite'}?mode=ro", uri=True)) as conn:
        # Positions 0..12 settled, each the prompt seq % 1000 of epoch 0: prompts 0..12,
        # bits 0..7 of byte 0 and 0..4 of byte 1.
        assert conn.execute("SELECT epoch, chunk, bits, settles FROM settled_prompts").fetchall() == [
            (0, 0, bytes([0xFF, 0x1F]), 13)]


def _prompt_rows(path: Path) -> dict[tuple[int, int], tuple[bytes, int]]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return {(e, c): (b, n) for e, c, b, n in conn.execute("SELECT epoch, chunk, bits, settles FROM settled_prompts")}


@pytest.mark.parametrize("spread", [1, 4096], ids=["80 prompts", "330k prompts"])
def test_a_settle_rewrites_one_bounded_chunk_of_the_bitmap_whatever_the_dataset_size(tmp_path, spread):
    """80 groups settled over prompt ids 0..79 or over 0..~330k, then one more: the settle
    changes exactly one `settled_prompts` row, of at most 512 bytes, in both
    datasets (read through a second connection). Planted: one whole-epoch bitmap (a chunk
    of 1 << 40 ids) -> the 330k case rewrites a 40 KB row and fails."""
    path = tmp_path / "rollout_state.sqlite"
    store = Store.create(path, replay_capacity=64)
    first = store.reserve([Reservation(k, 0, k * spread + 1) for k in range(80)], num_generations=1, target_step=1)
    store.discard(first, reason=ZERO)
    before = _prompt_rows(path)
    (g,) = store.reserve([Reservation(80, 0, 70 * spread + 7)], num_generations=1, target_step=1)
    store.discard([g], reason=ZERO)
    store.close()
    after = _prompt_rows(path)
    changed = {key: row for key, row in after.items() if before.get(key) != row}
    assert len(changed) == 1
    ((_, (bits, _)),) = changed.items()
    assert len(bits) <= 512  # a page-sized row: 4096 prompt ids
    assert sum(n for _, n in after.values()) == 81


def test_a_prompt_handed_out_again_and_settled_twice_in_an_epoch_is_reported_duplicated(tmp_path):
    run_dir = tmp_path / "run"
    run = Run(run_dir / "rollout_state.sqlite")
    run.stamp(1)
    run.train(1)
    # A sampler bug hands prompt 2 of epoch 0 out again at a new position (4), after its
    # first group settled: the ledger's UNIQUE (epoch, prompt_id) cannot see it.
    (g,) = run.store.reserve([Reservation(4, 0, 2)], num_generations=1, target_step=2)
    with run.store.atomic() as tx:
        pools.advance_cursor(tx, 5, 0)
    with contextlib.closing(sqlite3.connect(run_dir / "rollout_state.sqlite")) as conn:
        report = check_invariants(conn)
    assert report.invariants == [1] and "epoch 0 prompt 2 x2" in report.problems[0]
    run.store.discard([g], reason=ZERO)  # settled twice now: bit 2 already set, settles 5 for 4 bits
    run.store.close()
    (run_dir / "config.yaml").write_text(f"algorithm:\n  groups_per_step: {GROUPS_PER_STEP}\n")
    with contextlib.closing(sqlite3.connect(run_dir / "rollout_state.sqlite")) as conn:
        assert conn.execute("SELECT bits, settles FROM settled_prompts WHERE epoch = 0").fetchone() == (bytes([0x0F]), 5)
    code, doc = _verify(run_dir)
    assert code == 1
    assert (doc["trained"], doc["discarded"], doc["duplicated"], doc["lost"]) == (4, 1, 1, 0)
    assert any("epoch 0: 1 prompt(s) settled twice" in p for p in doc["problems"])


def test_a_settle_that_left_no_prompt_bit_breaks_invariant_1(tmp_path):
    run_dir = _run_dir(tmp_path)
    _plant(run_dir, "UPDATE settled_prompts SET settles = 12")  # one settled position without its prompt
    with contextlib.closing(sqlite3.connect(run_dir / "rollout_state.sqlite")) as conn:
        report = check_invariants(conn)
    assert report.invariants == [1]
    assert "differ by 1" in report.problems[0]


def test_an_audit_of_a_store_older_than_the_compaction_reads_its_ledger_rows(tmp_path):
    """A v1_3_a fixture (settled groups still rows) is audited as it is: no ranges table."""
    src = Path(__file__).parent / "fixtures" / "store_v1_3_a.sqlite"
    path = tmp_path / "old.sqlite"
    path.write_bytes(src.read_bytes())
    audit = audit_ledger(path, groups_per_step=4)
    # By hand from make_fixture.PLAN: 17 trained, 4 discarded (2 for reasons not owned).
    assert (audit.trained, audit.discarded, audit.duplicated, audit.discarded_not_owned) == (17, 4, 0, 2)


# ------------------------------------------------------------ an exported key of a settled group


def test_a_settled_groups_episode_key_is_told_apart_from_a_key_the_ledger_never_handed_out(tmp_path):
    """An agent server's export can name an attempt whose group settled after the export:
    its rows are gone, so the ledger alone reads it as unknown. Group ids are
    AUTOINCREMENT: one at or under the sequence's high water without a row has settled."""
    path = tmp_path / "live.sqlite"
    run = Run(path, {1})
    run.stamp(1)
    run.stamp(2)
    run.train(1)
    # By hand: one group per position, ids from 1. Step 1 took positions 0..4 (groups
    # 1..5, position 1 = group 2 discarded), step 2 positions 5..8 (groups 6..9, live).
    keys = ["1.0-a1", "2.1-a0", "5.1-a0", "6.0-a0", "9.1-a0", "10.0-a0", "0.0-a0", "x.0-a0", "3.0", "-1.0-a0"]
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        assert queries.settled_episode_keys(conn, keys) == {"1.0-a1", "2.1-a0", "5.1-a0"}
    run.train(2)  # every group settled: the live store has no row left to compare with
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        assert conn.execute("SELECT count(*) FROM prompt_groups").fetchone()[0] == 0
        assert queries.settled_episode_keys(conn, keys) == {"1.0-a1", "2.1-a0", "5.1-a0", "6.0-a0", "9.1-a0"}
    with run.store.read() as conn:  # the same through the store's own (SQLAlchemy) connection
        assert queries.settled_episode_keys(conn, ["9.0-a0", "10.0-a0"]) == {"9.0-a0"}
    run.store.close()


def test_a_store_that_never_wrote_a_group_has_no_settled_key(tmp_path):
    store = Store.create(tmp_path / "live.sqlite", replay_capacity=8)
    with store.read() as conn:
        assert queries.settled_episode_keys(conn, ["1.0-a0"]) == set()
    store.close()


# ------------------------------------------------------------------ per-event cost vs the run

_SETTLED = ("settled_steps", "settled_prompts")


@contextlib.contextmanager
def _statements(monkeypatch):
    """Every statement run on a connection opened inside the block (the Store's own,
    through SQLAlchemy's driver, included), with its parameters filled in."""
    seen: list[str] = []
    real = sqlite3.connect

    def connect(*args, **kwargs):
        conn = real(*args, **kwargs)
        conn.set_trace_callback(seen.append)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)
    monkeypatch.setattr(sqlite3.dbapi2, "connect", connect)
    yield seen
    monkeypatch.undo()


def _scans(path: Path, statements: list[str]) -> list[str]:
    """The statements touching the settled record whose plan (EXPLAIN QUERY PLAN, on a
    second connection) reads a settled table whole instead of searching its key."""
    out = []
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        for sql in statements:
            if not any(t in sql for t in _SETTLED) or not sql.lstrip().upper().startswith(("SELECT", "UPDATE", "INSERT",
                                                                                              "DELETE")):
                continue
            plan = [r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql)]
            if any(p.startswith(f"SCAN {t}") for p in plan for t in _SETTLED):
                out.append(f"{sql} -> {plan}")
    return out


def test_a_settle_searches_the_settled_record_by_key_and_never_reads_it_whole(tmp_path, monkeypatch):
    """After 200 steps (201 settled_steps rows), a train step's settle and a discard's:
    every statement on `settled_steps` / `settled_prompts` is a key search (EXPLAIN QUERY
    PLAN on a second connection), so the settle costs the same at step 3000 as at step 30
    (BENCHMARKS.md, "Per-event costs against the run's length"). Planted: `_ROW_AT`'s
    `seq_start <= ?` as `seq_start + 0 <= ?` (no usable key) -> the row probe is a SCAN
    of settled_steps and this fails."""
    path = tmp_path / "live.sqlite"
    with _statements(monkeypatch) as seen:  # the Store opens its connections here
        run = Run(path, discards={801, 802})
        run.stamp(1)
        for step in range(1, 200):
            run.stamp(step + 1)
            run.train(step)
        del seen[:]
        run.stamp(201)  # discards positions 801 and 802 on the way
        run.train(200)
        run.store.close()
    assert any("settled_steps" in s for s in seen) and any("settled_prompts" in s for s in seen)
    assert _scans(path, seen) == []


def test_a_snapshots_copy_check_decodes_the_settled_record_once(tmp_path, monkeypatch):
    """`check_invariants` (which a snapshot's publish runs on its copy: copy_problems)
    reads `settled_steps` whole once: the decode is the one part of the check that grows
    with the run (~20 ms at 3000 steps). Planted: `audit_prompts` decoding again (as
    before) -> two reads and this fails."""
    path = tmp_path / "live.sqlite"
    run = Run(path, discards={5})
    run.stamp(1)
    for step in range(1, 20):
        run.stamp(step + 1)
        run.train(step)
    run.store.close()
    with _statements(monkeypatch) as seen:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
            assert check_invariants(conn).ok
    assert len([s for s in seen if "FROM settled_steps" in s and "WHERE" not in s]) == 1
