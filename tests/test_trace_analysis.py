"""The trace figures on a small hand-built job, with every answer worked out by hand.

The job: run A (run_no 1) is killed at t=110 after a snapshot cut at t=106; run B
(run_no 2) starts at t=200, restores that snapshot and finishes. The baseline is the same
job run once without a stop, starting at t=1000. Events are written through the real
Tracer with explicit times (its clock sets the run_started event).

TODO(controller): when the controller lands, add a test on a real quickstart run that was
SIGKILLed and resumed, against its never-stopped twin (same config and seed).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rolloutdb.cli import main
from rolloutdb.commands import trace as trace_cli
from rolloutdb.store.trace import queries as trace_queries
from rolloutdb.store.trace.analysis import TraceAnalysis, open_sqlite_analysis, sqlite_query
from rolloutdb.store.trace.writer import TRACE_FILENAME, TraceError, Tracer

HERE = Path(__file__).resolve().parent


def write_run_a(path) -> Tracer:
    """Run A, t=100..110. Groups g1 (prompt 10), g2 (20), g3 (30) reserved at 100; two
    generations each. g1 is sealed and published at 105 (30 tokens of version 0); the
    snapshot is cut at 106; after the cut (all lost with the kill): step 1 is trained,
    g2 is sealed and published, prompts 40 and 50 are reserved. g7 (prompt 60), reserved
    at 100, is discarded at 104.5 for zero reward variance: settled before the cut."""
    tr = Tracer(path, clock=lambda: 100.0)
    e = tr.emit
    for g, p in ((1, 10), (2, 20), (3, 30)):
        e("group_reserved", t=100, group_id=g, prompt_id=p, step=1, policy_version=0)
    for p, g, gi, a, t in ((10, 1, 0, 0, 101), (10, 1, 1, 0, 101), (20, 2, 0, 0, 102), (20, 2, 1, 0, 102.5),
                           (30, 3, 0, 0, 103), (30, 3, 1, 0, 103)):
        e("attempt_dispatched", t=t, group_id=g, prompt_id=p, generation_index=gi, attempt=a, policy_version=0)
    # A deadline abandonment is not thrown-away time; its generation gets attempt 1.
    e("attempt_abandoned", t=103.5, group_id=3, prompt_id=30, generation_index=1, attempt=0, reason="deadline")
    e("attempt_dispatched", t=104, group_id=3, prompt_id=30, generation_index=1, attempt=1, policy_version=0)
    e("group_reserved", t=100, group_id=7, prompt_id=60, step=1, policy_version=0)
    e("attempt_dispatched", t=100.5, group_id=7, prompt_id=60, generation_index=0, attempt=0, policy_version=0)
    e("attempt_dispatched", t=100.5, group_id=7, prompt_id=60, generation_index=1, attempt=0, policy_version=0)
    e("rollout_finished", t=104, group_id=7, prompt_id=60, generation_index=0, attempt=0, tokens=3, reward=0.0)
    e("rollout_finished", t=104, group_id=7, prompt_id=60, generation_index=1, attempt=0, tokens=3, reward=0.0)
    e("group_discarded", t=104.5, group_id=7, prompt_id=60, step=1, policy_version=0, reason="zero_variance")
    e("rollout_finished", t=104, group_id=1, prompt_id=10, generation_index=0, attempt=0, tokens=15, version_token_counts={0: 15})
    e("rollout_finished", t=104, group_id=1, prompt_id=10, generation_index=1, attempt=0, tokens=15, version_token_counts={0: 15})
    e("group_sealed", t=105, group_id=1, prompt_id=10)
    e("group_published", t=105, group_id=1, prompt_id=10, version_token_counts={0: 30})
    e("snapshot_cut", t=106.2, cut_time=106, snapshot_seq=1, anchor="bootstrap")
    e("train_step", t=107, step=1, policy_version=0, group_ids=[1], batch_age=0.0)
    e("refit", t=107, step=1, old_version=0, new_version=1, policy_version=1, running=[])
    e("group_reserved", t=108, group_id=4, prompt_id=40, step=2, policy_version=1)
    e("attempt_dispatched", t=108.5, group_id=4, prompt_id=40, generation_index=0, attempt=0, policy_version=1)
    e("group_sealed", t=109, group_id=2, prompt_id=20)
    e("group_published", t=109, group_id=2, prompt_id=20, version_token_counts={0: 12, 1: 8})
    e("group_reserved", t=109.5, group_id=6, prompt_id=50, step=2, policy_version=1)
    e("rollout_finished", t=110, group_id=3, prompt_id=30, generation_index=0, attempt=0, tokens=5)
    return tr


def write_run_b(path) -> Tracer:
    """Run B, t=200..210: abandons the four attempts that were running at the cut,
    restores snapshot 1 (cut_time 106), reserves prompt 40 again, seals g2, g3, g5 and
    trains steps 1, 2, 3."""
    tr = Tracer(path, clock=lambda: 200.0)
    e = tr.emit
    for p, g, gi, a in ((20, 2, 0, 0), (20, 2, 1, 0), (30, 3, 0, 0), (30, 3, 1, 1)):
        e("attempt_abandoned", t=201, group_id=g, prompt_id=p, generation_index=gi, attempt=a, reason="restart")
    e("restore_done", t=202, snapshot_seq=1, cut_time=106, anchor="bootstrap", groups_restored=3, replay_restored=1)
    e("group_reserved", t=203, group_id=5, prompt_id=40, step=2, policy_version=0)
    for p, g, gi, a in ((20, 2, 0, 1), (20, 2, 1, 1), (30, 3, 0, 1), (30, 3, 1, 2), (40, 5, 0, 0)):
        e("attempt_dispatched", t=203, group_id=g, prompt_id=p, generation_index=gi, attempt=a, policy_version=0)
    e("train_step", t=204, step=1, policy_version=0, group_ids=[1], batch_age=0.0)
    e("refit", t=204, step=1, old_version=0, new_version=1, policy_version=1,
      running=[{"prompt_id": 20, "generation_index": 0, "attempt": 1, "tokens": 5}])
    e("group_sealed", t=206, group_id=2, prompt_id=20)
    e("group_published", t=206, group_id=2, prompt_id=20, version_token_counts={0: 5, 1: 15})
    e("group_sealed", t=207, group_id=3, prompt_id=30)
    e("group_published", t=207, group_id=3, prompt_id=30, version_token_counts={1: 20})
    e("group_sealed", t=208, group_id=5, prompt_id=40)
    # -1: environment tokens, which have no policy version and do not count.
    e("group_published", t=208, group_id=5, prompt_id=40, version_token_counts={1: 10, -1: 7})
    e("train_step", t=209, step=2, policy_version=1, group_ids=[2, 3], batch_age=0.125)
    e("train_step", t=210, step=3, group_ids=[5], batch_age=1.0)  # no policy_version: step - 1 = 2
    return tr


def write_baseline(path) -> Tracer:
    """The same prompts, never stopped, from t=1000: sealed at effective times
    10: 5, 20: 9, 30: 11, 40: 13. Prompt 50 is never sealed."""
    tr = Tracer(path, clock=lambda: 1000.0)
    e = tr.emit
    for g, p in ((1, 10), (2, 20), (3, 30)):
        e("group_reserved", t=1000, group_id=g, prompt_id=p)
    e("group_sealed", t=1005, group_id=1, prompt_id=10)
    e("group_reserved", t=1008, group_id=4, prompt_id=40)
    e("group_sealed", t=1009, group_id=2, prompt_id=20)
    e("group_sealed", t=1011, group_id=3, prompt_id=30)
    e("group_sealed", t=1013, group_id=4, prompt_id=40)
    return tr


@pytest.fixture
def job(tmp_path):
    run, base = tmp_path / "run" / "logs" / TRACE_FILENAME, tmp_path / "base" / "logs" / TRACE_FILENAME
    write_run_a(run).close()
    write_run_b(run).close()
    write_baseline(base).close()
    return run, base


def test_runs_are_ordered_and_their_downtime_removed_from_the_effective_timeline(job):
    run, base = job
    with TraceAnalysis([run], [base]) as a:
        got = a.query("SELECT job, run_no, started, ended, downtime_before, downtime_until FROM runs ORDER BY job DESC, run_no").rows
        # Run B's first event (200) minus run A's last (110): 90 s down.
        assert got == [("run", 1, 100.0, 110.0, 0.0, 0.0), ("run", 2, 200.0, 210.0, 90.0, 90.0),
                       ("baseline", 1, 1000.0, 1013.0, 0.0, 0.0)]
        # Effective time: t - 100 in run A, t - 100 - 90 in run B.
        sealed = a.query("SELECT t, effective_t, kept FROM group_timeline WHERE job = 'run' AND event = 'group_sealed' ORDER BY t").rows
        # g2's seal at 109 came after the cut at 106: lost with the kill, not kept.
        assert sealed == [(105.0, 5.0, 1), (109.0, 9.0, 0), (206.0, 16.0, 1), (207.0, 17.0, 1), (208.0, 18.0, 1)]


def test_thrown_away_time_per_attempt_and_per_stop_match_the_hand_worked_answer(job):
    run, base = job
    with TraceAnalysis([run], [base]) as a:
        attempts = a.query("thrown_away_by_attempt").rows
        per_stop = a.query("thrown_away_per_stop").as_dicts()
    # cut_time 106 minus each attempt's last dispatch at or before it:
    #   prompt 20 gen 0 attempt 0: 106 - 102   = 4
    #   prompt 20 gen 1 attempt 0: 106 - 102.5 = 3.5
    #   prompt 30 gen 0 attempt 0: 106 - 103   = 3
    #   prompt 30 gen 1 attempt 1: 106 - 104   = 2   (attempt 0 ended by deadline: not counted)
    # No turn was committed (group-level recovery): committed_at is NULL.
    assert attempts == [
        (1, 20, 0, 0, 2, 102.0, None, 106.0, 4.0),
        (1, 20, 1, 0, 2, 102.5, None, 106.0, 3.5),
        (1, 30, 0, 0, 3, 103.0, None, 106.0, 3.0),
        (1, 30, 1, 1, 3, 104.0, None, 106.0, 2.0),
    ]
    # One stop: 4 attempts, 4 + 3.5 + 3 + 2 = 12.5 s; downtime 200 - 110 = 90 s.
    assert len(per_stop) == 1
    assert {k: per_stop[0][k] for k in ("stop_no", "attempts", "thrown_away_s", "downtime", "snapshot_seq", "cut_time")} == {
        "stop_no": 1, "attempts": 4, "thrown_away_s": 12.5, "downtime": 90.0, "snapshot_seq": 1, "cut_time": 106.0}


def test_lost_progress_against_the_baseline_matches_the_hand_worked_answer(job):
    run, base = job
    with TraceAnalysis([run], [base]) as a:
        groups = a.query("lost_progress_by_group").rows
        per_stop = a.query("lost_progress_per_stop").rows
    # Running at the stop (latest reservation in run A not sealed by the cut at 106):
    # prompts 20, 30 (in flight at the cut; 20's seal at 109 was after it), 40 and 50
    # (reserved after the cut). Prompt 10 was sealed at 105 and prompt 60 discarded at
    # 104.5, both before the cut: settled, not running (prompt 60 will never be sealed).
    # Sealed after the stop on the effective timeline (t - 190): 20 at 206 -> 16,
    # 30 at 207 -> 17, 40 at 208 -> 18; the baseline (t - 1000): 9, 11, 13.
    # Lost: 16 - 9 = 7, 17 - 11 = 6, 18 - 13 = 5. Prompt 50 was never sealed: unmatched.
    assert groups == [
        (1, 20, 1, 16.0, 9.0, 7.0),
        (1, 30, 1, 17.0, 11.0, 6.0),
        (1, 40, 1, 18.0, 13.0, 5.0),
        (1, 50, None, None, None, None),
    ]
    # 4 running, 3 matched, 7 + 6 + 5 = 18 in total, mean 6, largest 7.
    assert per_stop == [(1, 4, 3, 18.0, 6.0, 7.0)]


def test_a_prompt_seen_in_several_epochs_is_matched_occurrence_by_occurrence(tmp_path):
    run, base = tmp_path / "run.sqlite", tmp_path / "base.sqlite"
    with Tracer(run, clock=lambda: 0.0) as a:  # epoch 0 of prompt 7 sealed at 2, epoch 1 reserved at 3
        a.emit("group_reserved", t=1, group_id=1, prompt_id=7, epoch=0)
        a.emit("group_sealed", t=2, group_id=1, prompt_id=7)
        a.emit("group_reserved", t=3, group_id=2, prompt_id=7, epoch=1)
        a.emit("group_reserved", t=4, group_id=3, prompt_id=8, epoch=1)
    with Tracer(run, clock=lambda: 10.0) as b:  # 6 s down; no snapshot restored: cut = 4
        b.emit("group_sealed", t=12, group_id=2, prompt_id=7)
    with Tracer(base, clock=lambda: 0.0) as c:
        c.emit("group_sealed", t=2, group_id=1, prompt_id=7)
        c.emit("group_sealed", t=5, group_id=2, prompt_id=7)
    with TraceAnalysis([run], [base]) as an:
        # Prompt 7's second seal: effective 12 - 0 - 6 = 6 against the baseline's second, 5.
        # Prompt 8 is running but never sealed.
        assert an.query("lost_progress_by_group").rows == [(1, 7, 2, 6.0, 5.0, 1.0), (1, 8, None, None, None, None)]
        # No restore_done: the stop has no snapshot and no thrown-away attempts.
        assert an.query("thrown_away_per_stop").rows[0][3:] == (6.0, None, None, 0, 0.0)


def test_two_groups_of_one_prompt_running_at_a_stop_are_two_rows_matched_to_its_next_two_seals(tmp_path):
    """Epoch 1 drew prompt 7 while its epoch-0 group still ran: both groups were running at
    the stop. Keyed by the prompt's latest reservation, the epoch-0 group went uncounted
    (and the epoch-1 group was matched with the earlier of the two seals)."""
    run, base = tmp_path / "run.sqlite", tmp_path / "base.sqlite"
    with Tracer(run, clock=lambda: 0.0) as a:
        a.emit("group_reserved", t=1, group_id=1, prompt_id=7, epoch=0)
        a.emit("group_reserved", t=3, group_id=2, prompt_id=7, epoch=1)
    with Tracer(run, clock=lambda: 10.0) as b:  # 7 s down (a ran 0..3); no snapshot: cut = 3
        b.emit("group_sealed", t=12, group_id=1, prompt_id=7)
        b.emit("group_sealed", t=14, group_id=2, prompt_id=7)
    with Tracer(base, clock=lambda: 0.0) as c:
        c.emit("group_sealed", t=2, group_id=1, prompt_id=7)
        c.emit("group_sealed", t=5, group_id=2, prompt_id=7)
    with TraceAnalysis([run], [base]) as an:
        # Effective seals 12 - 0 - 7 = 5 and 14 - 7 = 7, against the baseline's 2 and 5.
        assert an.query("lost_progress_by_group").rows == [(1, 7, 1, 5.0, 2.0, 3.0), (1, 7, 2, 7.0, 5.0, 2.0)]
        assert an.query("lost_progress_per_stop").rows == [(1, 2, 2, 5.0, 2.5, 3.0)]
        conn = open_sqlite_analysis([run], [base])
        try:
            assert sqlite_query(conn, "lost_progress_by_group").rows == an.query("lost_progress_by_group").rows
        finally:
            conn.close()


def test_a_group_reserved_again_after_a_rewind_counts_once_at_the_next_stop(tmp_path):
    """A resume that rewinds to a trainer checkpoint (no snapshot) hands the groups it held
    back to the spare pool without an event, and the resumed run reserves their prompts
    again in the same epoch: at its own stop the prompt is one group running, not two."""
    run, base = tmp_path / "run.sqlite", tmp_path / "base.sqlite"
    with Tracer(run, clock=lambda: 0.0) as a:  # stop 1 at 2: prompt 7 (epoch 0) running
        a.emit("group_reserved", t=1, group_id=1, prompt_id=7, epoch=0)
        a.emit("group_reserved", t=2, group_id=2, prompt_id=8, epoch=0)
    with Tracer(run, clock=lambda: 10.0) as b:  # rewound: prompt 7 reserved again; stop 2 at 12
        b.emit("group_reserved", t=11, group_id=1, prompt_id=7, epoch=0)
        b.emit("group_reserved", t=12, group_id=3, prompt_id=9, epoch=0)
    with Tracer(run, clock=lambda: 20.0) as c:
        c.emit("group_sealed", t=21, group_id=1, prompt_id=7)
    with Tracer(base, clock=lambda: 0.0) as d:
        d.emit("group_sealed", t=3, group_id=1, prompt_id=7)
    with TraceAnalysis([run], [base]) as an:
        # Stop 1: prompts 7 and 8 running. Stop 2: prompt 7 once (its reservation at 11),
        # prompt 8 (held since run 1: kept, no snapshot), prompt 9. Prompt 7's seal at 21:
        # effective 21 - 8 - 8 = 5 (downtime 8 + 8), the baseline's 3.
        rows = an.query("lost_progress_by_group").rows
        assert [(r[0], r[1]) for r in rows] == [(1, 7), (1, 8), (2, 7), (2, 8), (2, 9)]
        assert rows[0] == (1, 7, 1, 5.0, 3.0, 2.0) and rows[2] == (2, 7, 1, 5.0, 3.0, 2.0)
        assert [r[:3] for r in an.query("lost_progress_per_stop").rows] == [(1, 2, 1), (2, 3, 1)]


def test_a_group_a_rewind_withdrew_is_not_running_at_the_next_stop_though_its_prompt_waits(tmp_path):
    """The rewinding resume records each group it withdrew (`group_discarded`, reason
    `rewind`): prompt 8's group, withdrawn and not reserved again before the next stop,
    is not running there (without the event it was: reserved, kept, never settled)."""
    run, base = tmp_path / "run.sqlite", tmp_path / "base.sqlite"
    with Tracer(run, clock=lambda: 0.0) as a:  # stop 1 at 2: prompts 7 and 8 running
        a.emit("group_reserved", t=1, group_id=1, prompt_id=7, epoch=0)
        a.emit("group_reserved", t=2, group_id=2, prompt_id=8, epoch=0)
    with Tracer(run, clock=lambda: 10.0) as b:  # rewound: both withdrawn; prompt 7 reserved again
        b.emit("group_discarded", t=10.5, group_id=1, prompt_id=7, reason="rewind")
        b.emit("group_discarded", t=10.5, group_id=2, prompt_id=8, reason="rewind")
        b.emit("group_reserved", t=11, group_id=3, prompt_id=7, epoch=0)
        b.emit("group_reserved", t=12, group_id=4, prompt_id=9, epoch=0)
    with Tracer(run, clock=lambda: 20.0) as c:
        c.emit("group_sealed", t=21, group_id=3, prompt_id=7)
    with Tracer(base, clock=lambda: 0.0) as d:
        d.emit("group_sealed", t=3, group_id=1, prompt_id=7)
    with TraceAnalysis([run], [base]) as an:
        # Stop 1 as before the rewind; stop 2: prompt 7's new group and prompt 9 only.
        # Prompt 7's seal at 21: effective 21 - 8 - 8 = 5, the baseline's 3.
        rows = an.query("lost_progress_by_group").rows
        assert rows == [(1, 7, 1, 5.0, 3.0, 2.0), (1, 8, None, None, None, None),
                        (2, 7, 1, 5.0, 3.0, 2.0), (2, 9, None, None, None, None)]
        conn = open_sqlite_analysis([run], [base])
        try:
            assert sqlite_query(conn, "lost_progress_by_group").rows == rows
        finally:
            conn.close()


def test_batch_age_per_step_matches_the_hand_worked_answer_and_the_logged_value(job):
    run, base = job
    with TraceAnalysis([run], [base]) as a:
        steps = a.query("batch_age_per_step").rows
    # (run_no, step, t, trained_version, groups, tokens, batch_age, logged)
    # Step 1 (both runs): g1's 30 tokens of version 0, trained with version 0: age 0.
    # Step 2 (run B): trained with version 1. g2's latest publish before t=209 is run B's
    #   (v0: 5, v1: 15), not run A's lost one (v0: 12, v1: 8); g3 has v1: 20.
    #   (1 * 5 + 0 * 15 + 0 * 20) / 40 = 0.125.
    # Step 3: no policy_version, so step - 1 = 2; g5 has v1: 10 (and 7 environment
    #   tokens, not counted): (2 - 1) * 10 / 10 = 1.0.
    assert steps == [
        (1, 1, 107.0, 0, 1, 30, 0.0, 0.0),
        (2, 1, 204.0, 0, 1, 30, 0.0, 0.0),
        (2, 2, 209.0, 1, 2, 40, 0.125, 0.125),
        (2, 3, 210.0, 2, 1, 10, 1.0, 1.0),
    ]


def write_misreported_job(path) -> Tracer:
    """One run whose trainer logged a wrong batch age at two of three steps. Versions
    and tokens: g1 publishes v0: 10, v1: 30; g2 publishes v1: 20 at t=3, then again at
    t=6 (after step 1, so step 1 reads the t=3 publish) with v1: 5, v2: 15, and -1: 9
    environment tokens; g3 publishes v0: 4."""
    tr = Tracer(path, clock=lambda: 0.0)
    e = tr.emit
    e("group_published", t=2, group_id=1, prompt_id=1, version_token_counts={0: 10, 1: 30})
    e("group_published", t=3, group_id=2, prompt_id=2, version_token_counts={1: 20})
    e("group_published", t=4, group_id=3, prompt_id=3, version_token_counts={0: 4})
    # Step 1 trained with version 2: g1 (10 tokens 2 behind, 30 tokens 1 behind) and g2's
    # t=3 publish (20 tokens 1 behind): (2 * 10 + 1 * 30 + 1 * 20) / 60 = 70 / 60. Logged: 0.5.
    e("train_step", t=5, step=1, policy_version=2, group_ids=[1, 2], batch_age=0.5)
    e("group_published", t=6, group_id=2, prompt_id=2, version_token_counts={1: 5, 2: 15, -1: 9})
    # Step 2 trained with version 3: g2's t=6 publish (5 tokens 2 behind, 15 tokens 1
    # behind; environment tokens do not count) and g3 (4 tokens 3 behind):
    # (2 * 5 + 1 * 15 + 3 * 4) / 24 = 37 / 24. Logged right.
    e("train_step", t=7, step=2, policy_version=3, group_ids=[2, 3], batch_age=37 / 24)
    # Step 3 without policy_version: trained with step - 1 = 2; g3: (2 - 0) * 4 / 4 = 2. Logged: 0.
    e("train_step", t=8, step=3, group_ids=[3], batch_age=0.0)
    return tr


def test_batch_age_is_recomputed_from_the_tokens_even_where_the_trainer_logged_a_wrong_value(tmp_path, capsys):
    run = tmp_path / "run" / "logs" / TRACE_FILENAME
    write_misreported_job(run).close()
    with TraceAnalysis([run]) as a:
        rows = a.query("batch_age_per_step").rows
    # (run_no, step, t, trained_version, groups, tokens, batch_age, logged)
    assert [r[:6] for r in rows] == [(1, 1, 5.0, 2, 2, 60), (1, 2, 7.0, 3, 2, 24), (1, 3, 8.0, 2, 1, 4)]
    assert [r[6] for r in rows] == pytest.approx([70 / 60, 37 / 24, 2.0], rel=1e-12)
    assert [r[7] for r in rows] == pytest.approx([0.5, 37 / 24, 0.0])
    assert main(["trace", str(run.parent.parent), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "recomputed value differs from the logged one at 2 of 3 steps (steps 1, 3)" in printed
    assert "equal to the logged value" not in printed


def _generated_job(path, seed: int) -> list[tuple[int, float | None]]:
    """A random single-run trace: groups published (some twice, the second time possibly
    after the step that trains them), steps with and without policy_version, and a
    logged batch age that is always wrong. Returns (step, batch age) computed here in
    plain Python from what was written, by the definition in docs/trace.md."""
    rng = random.Random(seed)
    tr = Tracer(path, clock=lambda: 0.0)
    t, published, expected = 1.0, {}, []
    group_ids = list(range(1, 13))
    for step in range(1, 7):
        for g in rng.sample(group_ids, 3):
            counts = {v: rng.randrange(1, 50) for v in rng.sample(range(-1, step + 1), rng.randrange(1, 4))}
            tr.emit("group_published", t=t, group_id=g, prompt_id=100 + g, version_token_counts=counts)
            published.setdefault(g, []).append((t, counts))
            t += 1.0
        trained = rng.sample(sorted(published), min(2, len(published)))
        version = None if rng.random() < 0.3 else step + rng.randrange(0, 2)
        tv = step - 1 if version is None else version
        tokens = weighted = 0
        for g in trained:
            counts = max((p for p in published[g] if p[0] <= t), key=lambda p: p[0])[1]
            for v, n in counts.items():
                if v >= 0:
                    tokens += n
                    weighted += (tv - v) * n
        age = weighted / tokens if tokens else None
        fields = {} if version is None else {"policy_version": version}
        tr.emit("train_step", t=t, step=step, group_ids=trained, batch_age=-7.0 - step, **fields)
        expected.append((step, age))
        t += 1.0
    tr.close()
    return expected


@pytest.mark.parametrize("seed", range(4))
def test_batch_age_equals_an_independent_computation_on_generated_traces(tmp_path, seed):
    path = tmp_path / TRACE_FILENAME
    expected = _generated_job(path, seed)
    with TraceAnalysis([path]) as a:
        rows = a.query("SELECT step, batch_age, logged_batch_age FROM batch_age_steps WHERE job = 'run' ORDER BY t").rows
    assert [r[0] for r in rows] == [s for s, _ in expected]
    for (step, age, logged), (_, want) in zip(rows, expected):
        assert logged == -7.0 - step
        assert (age is None and want is None) or age == pytest.approx(want, rel=1e-12, abs=1e-12), (step, age, want)


def test_every_named_query_gives_the_same_answer_in_duckdb_and_in_sqlite(job):
    run, base = job
    conn = open_sqlite_analysis([run], [base])
    try:
        with TraceAnalysis([run], [base]) as a:
            for name in trace_queries.QUERIES:
                assert a.query(name).rows == sqlite_query(conn, name).rows, name
    finally:
        conn.close()


def test_a_job_resumed_into_another_directory_reads_as_one_job(tmp_path, job):
    _, base = job
    first, second = tmp_path / "a" / TRACE_FILENAME, tmp_path / "b" / TRACE_FILENAME
    write_run_a(first).close()
    write_run_b(second).close()
    with TraceAnalysis([first, second], [base]) as a:
        assert a.query("thrown_away_per_stop").rows[0][-2:] == (4, 12.5)
        assert a.query("lost_progress_per_stop").rows == [(1, 4, 3, 18.0, 6.0, 7.0)]
        assert [r[-2] for r in a.query("batch_age_per_step").rows] == [0.0, 0.0, 0.125, 1.0]


_ANALYSE = textwrap.dedent(
    """
    import sys
    from rolloutdb.store.trace.analysis import TraceAnalysis
    with TraceAnalysis([sys.argv[1]], [sys.argv[2]]) as a:
        print(a.query("thrown_away_per_stop").rows[0][-1])
    """
)


def test_duckdb_reads_the_traces_offline_without_writing_to_home_or_beside_them(job, tmp_path):
    run, base = job
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    before = {p: p.read_bytes() for p in (run, base)}
    listing = sorted(os.listdir(run.parent)), sorted(os.listdir(base.parent))
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp), "XDG_CACHE_HOME": str(home / ".cache"),
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    out = subprocess.run([sys.executable, "-c", _ANALYSE, str(run), str(base)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "12.5"
    assert list(home.rglob("*")) == []  # no ~/.duckdb, no extension installed anywhere
    assert list(tmp.rglob("*")) == []  # its working directory is removed afterwards
    assert {p: p.read_bytes() for p in (run, base)} == before
    assert (sorted(os.listdir(run.parent)), sorted(os.listdir(base.parent))) == listing


def test_a_file_that_is_not_a_trace_is_refused_in_one_line(tmp_path):
    bogus = tmp_path / TRACE_FILENAME
    with contextlib.closing(sqlite3.connect(bogus)) as conn:
        conn.execute("CREATE TABLE something_else (x)")
    with pytest.raises(TraceError, match="not a readable trace file"):
        TraceAnalysis([bogus])


# --------------------------------------------------------------------------- the command

_KILLED_RUN_A = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[2])
    from test_trace_analysis import write_run_a
    tracer = write_run_a(sys.argv[1])
    tracer.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # killed, like a preempted run: no close()
    """
)


def test_rolloutdb_trace_on_a_killed_and_resumed_run_prints_the_figures_and_writes_the_plots(tmp_path, capsys):
    run_dir, base_dir = tmp_path / "run", tmp_path / "base"
    trace = run_dir / "logs" / TRACE_FILENAME
    killed = subprocess.run([sys.executable, "-c", _KILLED_RUN_A, str(trace), str(HERE)], timeout=120)
    assert killed.returncode == -signal.SIGKILL
    assert Path(f"{trace}-wal").exists()  # left as a killed run leaves it
    write_run_b(trace).close()
    write_baseline(base_dir / "logs" / TRACE_FILENAME).close()

    assert main(["trace", str(run_dir), "--baseline", str(base_dir)]) == 0
    printed = capsys.readouterr().out
    assert "Thrown-away time per stop" in printed and "12.500" in printed
    assert "Lost progress per stop" in printed and "18.000" in printed
    assert "equal to the logged value at all 4 steps" in printed
    plots = run_dir / "plots"
    assert sorted(p.name for p in plots.iterdir()) == sorted([
        "thrown_away_per_stop.csv", "thrown_away_by_attempt.csv", "lost_progress_per_stop.csv",
        "lost_progress_by_group.csv", "batch_age_per_step.csv", "kept_per_stop.csv", "kept_by_attempt.csv",
        "fallbacks_per_stop.csv", "trace_report.json", "kept.png", "thrown_away.png", "lost_progress.png", "batch_age.png"])
    for png in plots.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads((plots / "trace_report.json").read_text())
    assert report["thrown_away_per_stop"][0]["thrown_away_s"] == 12.5
    assert report["lost_progress_per_stop"][0]["lost_s_total"] == 18.0
    assert [r["batch_age"] for r in report["batch_age_per_step"]] == [0.0, 0.0, 0.125, 1.0]
    assert (plots / "lost_progress_per_stop.csv").read_text().splitlines() == [
        "stop_no,groups_running,groups_matched,lost_s_total,lost_s_mean,lost_s_max", "1,4,3,18.0,6.0,7.0"]


def test_rolloutdb_trace_writes_where_out_says_and_reads_a_log_directory(job, tmp_path, capsys):
    run, _ = job
    out = tmp_path / "elsewhere"
    assert main(["trace", str(run.parent), "--out", str(out)]) == 0
    assert "pass --baseline RUN_DIR" in capsys.readouterr().out
    assert (out / "batch_age.png").is_file()
    assert not (run.parent.parent / "plots").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trace", "{tmp}/missing"], "no such directory"),
        (["trace", "{tmp}/empty"], "no trace file"),
        (["trace", "{run}", "--baseline", "{tmp}/empty"], "no trace file"),
        (["trace", "{run}", "--out", "{tmp}/a_file"], "is a file; pass a directory with --out"),
    ],
)
def test_rolloutdb_trace_refuses_bad_input_in_one_line_and_writes_nothing(job, tmp_path, capsys, argv, message):
    run, _ = job
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("x")
    argv = [a.format(tmp=tmp_path, run=run.parent.parent) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not (run.parent.parent / "plots").exists()


def test_rolloutdb_trace_json_prints_the_document_that_trace_report_json_holds(job, capsys):
    run, _ = job
    assert main(["trace", str(run.parent.parent), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((run.parent.parent / "plots" / "trace_report.json").read_text())
    assert printed["traces"] == [str(run)] and len(printed["batch_age_per_step"]) == 4


def _long_trace(path, steps: int) -> None:
    """A trace whose printed report is far longer than a pipe holds (64 KiB)."""
    tr = Tracer(path, clock=lambda: 0.0)
    for step in range(1, steps + 1):
        tr.emit("group_published", t=step, group_id=step, prompt_id=step, version_token_counts={step - 1: 10})
        tr.emit("train_step", t=step + 0.5, step=step, policy_version=step, group_ids=[step], batch_age=1.0)
    tr.close()


def test_rolloutdb_trace_piped_into_a_reader_that_leaves_after_one_line_still_writes_every_file(tmp_path):
    run = tmp_path / "run"
    _long_trace(run / "logs" / TRACE_FILENAME, 2500)
    # `rolloutdb trace RUN_DIR | head -1`, unbuffered so that every line reaches the pipe at once.
    proc = subprocess.Popen([sys.executable, "-u", "-m", "rolloutdb", "trace", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"trace: ")
    proc.stdout.close()
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    written = sorted(p.name for p in (run / "plots").iterdir())
    assert written == sorted([f"{name}.csv" for name, _ in trace_cli.TABLES]
                             + ["trace_report.json", "kept.png", "thrown_away.png", "lost_progress.png",
                                "batch_age.png"])
    assert len(json.loads((run / "plots" / "trace_report.json").read_text())["batch_age_per_step"]) == 2500


def test_rolloutdb_trace_writes_points_in_time_as_iso_8601_utc_in_its_text_csv_and_json(job, capsys):
    run, base = job
    run_dir = run.parent.parent
    # --steps: the per-step table, where the step times are printed
    assert main(["trace", str(run_dir), "--baseline", str(base.parent.parent), "--steps"]) == 0
    printed = capsys.readouterr().out
    assert "1970-01-01T00:01:46Z" in printed and "1970-01-01T00:01:47Z" in printed  # cut_time 106, step 1 at t=107
    assert "106.000" not in printed and "107.000" not in printed
    doc = json.loads((run_dir / "plots" / "trace_report.json").read_text())
    assert doc["thrown_away_per_stop"][0]["cut_time"] == "1970-01-01T00:01:46Z"
    assert doc["batch_age_per_step"][0]["t"] == "1970-01-01T00:01:47Z"
    assert doc["thrown_away_per_stop"][0]["thrown_away_s"] == 12.5  # a duration stays seconds
    csv_text = (run_dir / "plots" / "thrown_away_by_attempt.csv").read_text()
    assert "1970-01-01T00:01:46Z" in csv_text and ",106.0" not in csv_text
    assert "1970-01-01T00:01:47Z" in (run_dir / "plots" / "batch_age_per_step.csv").read_text()
