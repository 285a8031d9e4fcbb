"""The settled record keeps the recent steps (revision v1_12_a): every FOLD_EVERY train
steps the `settled_steps` rows older than the kept steps, wholly below every live
position, fold into the counts of `settled_prefix`, so the record's rows (what each
snapshot copies and each check decodes) stay bounded however long the run.

The run is the GRPO-shaped loop of tests/test_bounded_store.py through the real Store
(real SQLite files), with a small fold interval and few kept steps; what is persisted is
read through a second connection and what it must be is computed here from the loop's
own hand-outs: which positions each step trained and which were discarded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutdb.store import FinishedGeneration, IllegalTransition, RecordDamaged, Reservation, RestoreError, check_invariants, keep_steps_for
from rolloutdb.store import rewind_live_store, rewind_problem
from rolloutdb.store.live import ledger as ledger_module
from rolloutdb.store.restore.choice import audit_ledger
from test_bounded_store import GROUPS_PER_STEP, ZERO, Run, _verify

KEEP = 4  # steps whose rows the record keeps
EVERY = 8  # a step that is a multiple of this folds


@pytest.fixture(autouse=True)
def fold_every_8_steps(monkeypatch):
    monkeypatch.setattr(ledger_module, "FOLD_EVERY", EVERY)


class FoldingRun(Run):
    """Run, recording by hand which positions each step trained and which were discarded."""

    def __init__(self, path: Path, discards=frozenset()):
        super().__init__(path, discards)
        self.positions: dict[int, list[int]] = {}  # step -> positions it trains

    def stamp(self, step: int) -> None:
        first = self.seq
        super().stamp(step)
        self.positions[step] = [s for s in range(first, self.seq) if s not in self.discards]

    def train(self, step: int) -> None:
        self.store.mark_trained(self.published.pop(step), step=step, keep_steps=KEEP)


def _read(path: Path, sql: str, *args) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return conn.execute(sql, args).fetchall()


def _run(path: Path, steps: int, discards=frozenset(), check_each_step: bool = False) -> FoldingRun:
    run = FoldingRun(path, discards)
    run.stamp(1)
    for step in range(1, steps + 1):
        run.stamp(step + 1)  # one step ahead: step + 1's groups are in flight while `step` trains
        run.train(step)
        if check_each_step:
            (n,) = _read(path, "SELECT count(*) FROM settled_steps")[0]
            through = _read(path, "SELECT through_step FROM settled_prefix")
            assert n <= KEEP + EVERY + 1, f"step {step}: {n} rows"
            # every step a rewind to a checkpoint KEEP steps back needs is still a row
            assert not through or through[0][0] <= step - KEEP
    return run


DISCARDS = frozenset(range(5, 400, 37))


def test_a_long_run_keeps_rows_for_the_recent_steps_only_and_counts_the_rest(tmp_path):
    path = tmp_path / "live.sqlite"
    run = _run(path, 40, DISCARDS, check_each_step=True)
    # Step 40 folds every position below the first row of a step after 40 - KEEP = 36:
    # step 37's, which starts at its first position. A row below it gives up what it
    # settles below that: position 153, discarded while step 38 was stamped (before step
    # 37 had a row), joined step 36's row, which now keeps only it (a row of discards).
    end = min(run.positions[37])
    assert 153 in DISCARDS and end == 148
    trained = sum(len(run.positions[s]) for s in range(1, 37))
    assert trained == 36 * GROUPS_PER_STEP
    discarded = len([d for d in DISCARDS if d < end])
    assert _read(path, "SELECT id, seq_end, trained, discarded, through_step FROM settled_prefix") == [
        (1, end, trained, json.dumps({ZERO: discarded}), 36)]
    assert end == trained + discarded
    assert _read(path, "SELECT seq_start, trained_step FROM settled_steps ORDER BY seq_start") == [
        (148, 37), (152, 38), (153, None), (157, 39), (161, 40)]
    assert _read(path, "SELECT seq_end, others FROM settled_steps WHERE seq_start = 153") == [(154, bytes([0, 1, 1]))]
    assert _read(path, "SELECT min(seq_start) FROM settled_steps") == [(end,)]
    run.store.close()
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        assert check_invariants(conn).ok
    audit = audit_ledger(path, groups_per_step=GROUPS_PER_STEP)
    assert audit.problems == []
    cursor = run.seq
    assert (audit.trained, audit.discarded, audit.steps) == (160, len([d for d in DISCARDS if d < cursor]), 40)
    assert audit.pending == GROUPS_PER_STEP  # step 41's groups, in flight


def test_an_old_steps_row_reaching_past_the_fold_keeps_its_later_positions_as_a_row_of_its_step(tmp_path):
    """Positions 0..9, one group each; step s trains position s - 1, except step 3, which
    also trains position 9 (a group that finished early). Step 8 folds through step 4:
    the first row of a later step (5) starts at 4, so positions 0..3 fold (4 trained,
    through step 4), and step 3's row keeps position 9 as a row of step 3 starting there."""
    from rolloutdb.store import Store
    path = tmp_path / "live.sqlite"
    store = Store.create(path, replay_capacity=16)
    trains = {1: [0], 2: [1], 3: [2, 9], 4: [3], 5: [4], 6: [5], 7: [6], 8: [7]}
    step_of = {seq: step for step, seqs in trains.items() for seq in seqs}
    ids = {}
    for seq in range(10):
        (ids[seq],) = store.reserve([Reservation(seq, 0, seq)], num_generations=1, target_step=step_of.get(seq, 9))
        (attempt,) = store.dispatch([ids[seq]], policy_version=0)
        store.finish(attempt, FinishedGeneration([1, 2], [-0.1, -0.2], 1.0, [(0, 2)]))
        store.seal([ids[seq]])
        store.enter_replay([ids[seq]])
    for step, seqs in trains.items():
        store.mark_trained([ids[s] for s in seqs], step=step, keep_steps=KEEP)
    store.close()
    assert _read(path, "SELECT seq_end, trained, discarded, through_step FROM settled_prefix") == [(4, 4, "{}", 4)]
    assert _read(path, "SELECT seq_start, seq_end, trained_step, target_step, others FROM settled_steps "
                       "ORDER BY seq_start") == [(4, 5, 5, 5, None), (5, 6, 6, 6, None), (6, 7, 7, 7, None),
                                                 (7, 8, 8, 8, None), (9, 10, 3, 3, None)]
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        assert check_invariants(conn).ok
    # The audit counts step 3's kept position with the folded steps: 5 groups in steps
    # 1..4 (step 3 trained two, as this scenario did on purpose).
    audit = audit_ledger(path, groups_per_step=1)
    assert (audit.trained, audit.steps) == (9, 8)
    assert audit.problems == ["train steps 1..4 (folded into settled_prefix) trained 5 groups, not 4 x groups_per_step=1"]


def test_the_kept_steps_cover_every_kept_trainer_checkpoint():
    assert keep_steps_for(5, 2) == 256  # the default config: never fewer than KEEP_STEPS
    assert keep_steps_for(100, 3) == 400  # checkpoints 100 steps apart, 3 kept: 400 steps of rows


def test_a_rewind_to_a_step_after_the_fold_works_and_one_before_it_is_refused_with_nothing_changed(tmp_path):
    path = tmp_path / "live.sqlite"
    run = _run(path, 40, DISCARDS)
    run.store.close()
    problem = rewind_problem(path, 30)
    assert problem is not None and "only after step 36" in problem and "settled_prefix" in problem
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    position = lambda seq: Reservation(seq, seq // 1000, seq % 1000)  # noqa: E731  Run's hand-outs
    kwargs = dict(position=position, config_fingerprint="", dataset_fingerprint="", forest_training={},
                  ledger_dispatch=True)
    with pytest.raises(RestoreError, match="only after step 36"):
        rewind_live_store(path, step=30, **kwargs)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    rewound = rewind_live_store(path, step=38, **kwargs)
    assert rewound.trained_after == 2 * GROUPS_PER_STEP  # steps 39 and 40, handed out again
    assert sorted(r[0] for r in _read(path, "SELECT sample_seq FROM spare_prompts")) == sorted(
        run.positions[39] + run.positions[40] + run.positions[41])
    assert _read(path, "SELECT seq_end, through_step FROM settled_prefix") == [(min(run.positions[37]), 36)]


def test_settling_a_position_below_the_fold_is_refused_and_changes_nothing(tmp_path):
    path = tmp_path / "live.sqlite"
    run = _run(path, 16)
    # A sampler bug hands folded position 3 out again (another prompt, so only the position clashes).
    (g,) = run.store.reserve([Reservation(3, 77, 3)], num_generations=1, target_step=17)
    before = _read(path, "SELECT * FROM settled_prefix") + _read(path, "SELECT * FROM settled_steps")
    with pytest.raises(IllegalTransition, match="sampler positions 3..3: already settled .folded"):
        run.store.discard([g], reason=ZERO)
    assert _read(path, "SELECT * FROM settled_prefix") + _read(path, "SELECT * FROM settled_steps") == before
    assert _read(path, "SELECT state FROM prompt_groups WHERE sample_seq = 3") == [("reserved",)]


def test_a_fold_over_a_gap_in_the_record_refuses_the_settle_and_changes_nothing(tmp_path):
    path = tmp_path / "live.sqlite"
    run = _run(path, 15)
    assert _read(path, "SELECT through_step FROM settled_prefix") == [(4,)]  # step 8 folded steps 1..4
    with contextlib.closing(sqlite3.connect(path)) as conn:  # step 10's row lost
        conn.execute("DELETE FROM settled_steps WHERE trained_step = 10")
        conn.commit()
    run.stamp(17)
    before = _read(path, "SELECT * FROM settled_prefix")
    with pytest.raises(RecordDamaged, match="cannot fold the positions below .*: positions .* are not settled"):
        run.train(16)
    assert _read(path, "SELECT * FROM settled_prefix") == before
    assert _read(path, "SELECT count(*) FROM prompt_groups WHERE state = 'published' AND target_step = 16") == [
        (GROUPS_PER_STEP,)]


def _run_dir(tmp_path: Path) -> tuple[Path, FoldingRun]:
    run_dir = tmp_path / "run"
    run = _run(run_dir / "rollout_state.sqlite", 16, DISCARDS)
    run.store.close()
    (run_dir / "config.yaml").write_text(f"algorithm:\n  groups_per_step: {GROUPS_PER_STEP}\n")
    return run_dir, run


def _plant(run_dir: Path, sql: str) -> None:
    with contextlib.closing(sqlite3.connect(run_dir / "rollout_state.sqlite")) as conn:
        conn.execute(sql)
        conn.commit()


def test_verify_counts_the_folded_steps_and_passes_a_sound_run(tmp_path):
    run_dir, run = _run_dir(tmp_path)
    assert _read(run_dir / "rollout_state.sqlite", "SELECT through_step FROM settled_prefix") == [(12,)]
    code, doc = _verify(run_dir)
    assert code == 0, doc["problems"]
    assert (doc["trained"], doc["steps"], doc["lost"], doc["duplicated"]) == (64, 16, 0, 0)


def test_a_prefix_whose_counts_do_not_add_up_is_refused_in_one_line_naming_it(tmp_path):
    run_dir, _ = _run_dir(tmp_path)
    _plant(run_dir, "UPDATE settled_prefix SET trained = trained - 1")
    proc = subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(run_dir), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    line = proc.stderr.strip()
    assert "\n" not in line and "settled_prefix row id=1: 47 trained and 2 discarded positions do not add up to its " \
        "50 positions" in line, line


def test_a_prefix_that_swaps_a_trained_group_for_a_discard_fails_the_step_audit(tmp_path):
    run_dir, _ = _run_dir(tmp_path)
    (discarded,) = _read(run_dir / "rollout_state.sqlite", "SELECT discarded FROM settled_prefix")[0]
    more = json.dumps({ZERO: json.loads(discarded)[ZERO] + 1})
    _plant(run_dir, f"UPDATE settled_prefix SET trained = trained - 1, discarded = '{more}'")
    code, doc = _verify(run_dir)
    assert code == 1
    assert any("train steps 1..12 (folded into settled_prefix) trained 47 groups, not 12 x groups_per_step=4" in p
               for p in doc["problems"])


def test_a_live_position_below_the_fold_is_reported_duplicated(tmp_path):
    run_dir, _ = _run_dir(tmp_path)
    _plant(run_dir, "INSERT INTO spare_prompts (sample_seq, epoch, prompt_id, added_at) VALUES (2, 9, 2, 0)")
    code, doc = _verify(run_dir)
    assert code == 1
    assert (doc["lost"], doc["duplicated"]) == (0, 1)
    assert any("position 2 settled and live" in p for p in doc["problems"])


# The child: FoldingRun to step 15, then step 16, whose settle folds (the second fold of
# the run) and is killed by ROLLOUTDB_FAULT between deleting the folded rows and writing
# the prefix's counts.
_CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from rolloutdb.store.live import ledger
ledger.FOLD_EVERY = {every}
import test_settled_prefix as t
run = t._run(Path({path!r}), 15)
run.stamp(17)
run.train(16)
print("not killed")
"""


def test_a_kill_inside_a_fold_leaves_the_record_as_the_last_committed_settle_left_it(tmp_path):
    path = tmp_path / "live.sqlite"
    code = _CHILD.format(tests=str(Path(__file__).parent), every=EVERY, path=str(path))
    env = {**os.environ, "ROLLOUTDB_FAULT": "settle.rows_folded@2"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "not killed" not in proc.stdout
    # Step 8's fold (through step 4) committed; step 16's settle and fold did not.
    assert _read(path, "SELECT through_step FROM settled_prefix") == [(4,)]
    assert [r[0] for r in _read(path, "SELECT DISTINCT trained_step FROM settled_steps WHERE trained_step IS NOT NULL "
                                      "ORDER BY 1")] == list(range(5, 16))
    assert _read(path, "SELECT count(*) FROM prompt_groups WHERE state = 'published' AND target_step = 16") == [
        (GROUPS_PER_STEP,)]
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        assert check_invariants(conn).ok
    # The run goes on: step 16 trains and folds through step 12.
    from rolloutdb.store import Store
    store = Store.open(path)
    (ids,) = zip(*_read(path, "SELECT group_id FROM prompt_groups WHERE target_step = 16 AND state = 'published'"))
    store.mark_trained(list(ids), step=16, keep_steps=KEEP)
    store.close()
    assert _read(path, "SELECT through_step FROM settled_prefix") == [(12,)]
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        assert check_invariants(conn).ok


def test_inspect_counts_the_folded_groups_and_says_where_the_fold_ends(tmp_path):
    run_dir, run = _run_dir(tmp_path)
    path = run_dir / "rollout_state.sqlite"
    (end,) = _read(path, "SELECT seq_end FROM settled_prefix")[0]
    text = subprocess.run([sys.executable, "-m", "rolloutdb", "inspect", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert text.returncode == 0, text.stderr
    assert (f"settled record    positions below {end} folded into counts (steps 1-12; settled_prefix), later steps "
            "one row each (settled_steps)") in text.stdout
    doc = json.loads(subprocess.run([sys.executable, "-m", "rolloutdb", "inspect", str(path), "--json"],
                                    capture_output=True, text=True, timeout=120).stdout)
    assert doc["settled_prefix"] == {"folded_below": end, "through_step": 12}
    assert doc["groups"]["trained"] == 16 * GROUPS_PER_STEP  # the folded ones counted with the rows'
    assert doc["groups"]["discarded"] == len([d for d in DISCARDS if d < run.seq])  # each settled when discarded
