"""What a stop kept: the per-stop and per-attempt figures on hand-built traces, every
answer worked out by hand in the comments.

The turn-level job: one group (g1, prompt 10, two generations) of a multi-turn task,
stopped twice.
  Run A, t=100..110, snapshot cut at 106, killed.
    gen 0 attempt 0, dispatched 101: turns 0 and 1 finish (20, 15 tokens) and commit
      (102.5, 104.5) before the cut; turn 2 finishes (12 tokens) at 107 and commits at
      107.5, after the cut.
    gen 1 attempt 0, dispatched 101.5: turn 0 finishes (9 tokens) at 105.5 but its
      commit batch lands at 106.5, after the cut: no committed turn at the cut.
  Run B, t=200..207: abandons both (restart), restores cut 106; gen 0 attempt 1 continues
    from turn 2 with 35 tokens kept, gen 1 attempt 1 starts over. gen 0: turn 2 (12) at
    204, committed 204.5; gen 1: turn 0 (9) at 204.5, committed 204.75; snapshot cut at
    205; gen 0 turn 3 (8) at 206, not committed by the cut; killed at 207.
  Run C, t=300..: abandons both, restores cut 205; gen 0 attempt 2 continues from turn 3
    with 47 tokens, gen 1 attempt 2 from turn 1 with 9.
"""

from __future__ import annotations

import contextlib
import csv
import json
import sqlite3
import subprocess
import sys

import pytest

from rolloutdb.cli import main
from rolloutdb.store.trace.analysis import TraceAnalysis, open_sqlite_analysis, sqlite_query
from rolloutdb.store.trace import queries as trace_queries
from rolloutdb.store.trace.writer import TRACE_FILENAME, Tracer
from test_trace_analysis import write_run_a, write_run_b
import lost_ctrl_c
from train_cli import env


def _attempt(p, gi, a, **kw):
    return dict(group_id=1, prompt_id=p, generation_index=gi, attempt=a, policy_version=0, **kw)


def write_turn_run_a(path) -> Tracer:
    tr = Tracer(path, clock=lambda: 100.0)
    e = tr.emit
    e("group_reserved", t=100, group_id=1, prompt_id=10, step=1, policy_version=0, group_size=2)
    e("attempt_dispatched", t=101, **_attempt(10, 0, 0))
    e("attempt_dispatched", t=101.5, **_attempt(10, 1, 0))
    e("call_finished", t=102, turn=0, tokens=20, finish_reason="stop", **_attempt(10, 0, 0))
    e("turn_committed", t=102.5, turn=0, tokens=20, total_tokens=30, **_attempt(10, 0, 0))
    e("call_finished", t=104, turn=1, tokens=15, finish_reason="stop", **_attempt(10, 0, 0))
    e("turn_committed", t=104.5, turn=1, tokens=35, total_tokens=50, **_attempt(10, 0, 0))
    e("call_finished", t=105.5, turn=0, tokens=9, finish_reason="stop", **_attempt(10, 1, 0))
    e("snapshot_cut", t=106.2, cut_time=106, snapshot_seq=1, anchor="bootstrap")
    e("turn_committed", t=106.5, turn=0, tokens=9, total_tokens=14, **_attempt(10, 1, 0))
    e("call_finished", t=107, turn=2, tokens=12, finish_reason="stop", **_attempt(10, 0, 0))
    e("turn_committed", t=107.5, turn=2, tokens=47, total_tokens=70, **_attempt(10, 0, 0))
    e("group_reserved", t=110, group_id=2, prompt_id=20, step=2, policy_version=0, group_size=2)
    return tr


def write_turn_run_b(path) -> Tracer:
    tr = Tracer(path, clock=lambda: 200.0)
    e = tr.emit
    e("attempt_abandoned", t=201, reason="restart", **_attempt(10, 0, 0))
    e("attempt_abandoned", t=201, reason="restart", **_attempt(10, 1, 0))
    e("restore_done", t=202, snapshot_seq=1, cut_time=106, anchor="bootstrap", groups_restored=1)
    e("attempt_dispatched", t=203, **_attempt(10, 0, 1))
    e("episode_restored", t=203, from_attempt=0, turn=2, tokens=35, total_tokens=50, **_attempt(10, 0, 1))
    e("attempt_dispatched", t=203, **_attempt(10, 1, 1))
    e("call_finished", t=204, turn=2, tokens=12, finish_reason="stop", **_attempt(10, 0, 1))
    e("turn_committed", t=204.5, turn=2, tokens=47, total_tokens=70, **_attempt(10, 0, 1))
    e("call_finished", t=204.5, turn=0, tokens=9, finish_reason="stop", **_attempt(10, 1, 1))
    e("turn_committed", t=204.75, turn=0, tokens=9, total_tokens=14, **_attempt(10, 1, 1))
    e("snapshot_cut", t=205.1, cut_time=205, snapshot_seq=2, anchor="bootstrap")
    e("call_finished", t=206, turn=3, tokens=8, finish_reason="length", **_attempt(10, 0, 1))
    e("group_reserved", t=207, group_id=2, prompt_id=20, step=2, policy_version=0, group_size=2)
    return tr


def write_turn_run_c(path) -> Tracer:
    tr = Tracer(path, clock=lambda: 300.0)
    e = tr.emit
    e("attempt_abandoned", t=301, reason="restart", **_attempt(10, 0, 1))
    e("attempt_abandoned", t=301, reason="restart", **_attempt(10, 1, 1))
    e("restore_done", t=302, snapshot_seq=2, cut_time=205, anchor="bootstrap", groups_restored=1)
    e("attempt_dispatched", t=303, **_attempt(10, 0, 2))
    e("episode_restored", t=303, from_attempt=1, turn=3, tokens=47, total_tokens=70, **_attempt(10, 0, 2))
    e("attempt_dispatched", t=303, **_attempt(10, 1, 2))
    e("episode_restored", t=303, from_attempt=1, turn=1, tokens=9, total_tokens=14, **_attempt(10, 1, 2))
    e("call_finished", t=304, turn=3, tokens=8, finish_reason="stop", **_attempt(10, 0, 2))
    e("group_sealed", t=306, group_id=1, prompt_id=10)
    return tr


# Stop 1 (cut 106), by attempt (stop, prompt, gen, attempt, group, decoded, decoded by
# the cut, kept, redone, turns kept, last committed turn, thrown-away s). Decoded by the
# cut: the calls finished at or before the cut (no call_cut here: turn level):
#   stop 1: gen 0 turns 0, 1 (20 + 15 = 35; turn 2 at 107 is after); gen 1 turn 0 at
#   105.5 (9). Stop 2: gen 0 turn 2 at 204 (12; turn 3 at 206 is after); gen 1 turn 0 at
#   204.5 (9).
#   gen 0 att 0: decoded 20 + 15 + 12 = 47 (turn 2 finished after the cut still counts);
#     kept 35 (turns 0, 1), redone 47 - 35 = 12; last turn committed by the cut: 1 (its
#     turn 2 committed at 107.5, after); thrown away 106 - max(101, 104.5) = 1.5.
#   gen 1 att 0: decoded 9, kept 0 (its commit at 106.5 missed the cut), redone 9; no
#     committed turn; thrown away 106 - 101.5 = 4.5.
# Stop 2 (cut 205):
#   gen 0 att 1: decoded 12 + 8 = 20 in run B; run C continues with 47 tokens, of which
#     35 att 1 was itself restored with: kept 47 - 35 = 12, redone 8; last committed turn
#     2; thrown away 205 - max(203, 204.5) = 0.5.
#   gen 1 att 1: decoded 9, kept 9, redone 0; turn 0 committed at 204.75: 0.25.
# At turn level the cut reads no call: no fallback, and unexplained_tokens is empty (a
# finished call whose turn missed the cut is lost by design there).
BY_ATTEMPT = [
    (1, 10, 0, 0, 1, 47, 35, 35, 0, None, 12, 2, 1, 1.5),
    (1, 10, 1, 0, 1, 9, 9, 0, 0, None, 9, 0, None, 4.5),
    (2, 10, 0, 1, 1, 20, 12, 12, 0, None, 8, 3, 2, 0.5),
    (2, 10, 1, 1, 1, 9, 9, 9, 0, None, 0, 1, 0, 0.25),
]
# Per stop (stop, cut_time, attempts, decoded, kept, redone, turns kept, thrown away):
#   stop 1: 2 attempts, 47 + 9 = 56, 35 + 0 = 35, 12 + 9 = 21, 2 + 0 turns, 1.5 + 4.5 = 6.0
#   stop 2: 2 attempts, 20 + 9 = 29, 12 + 9 = 21, 8 + 0 = 8, 3 + 1 turns, 0.5 + 0.25 = 0.75
PER_STOP = [(1, 106.0, 2, 56, 35, 21, 2, 6.0), (2, 205.0, 2, 29, 21, 8, 4, 0.75)]


@pytest.fixture
def turn_job(tmp_path):
    path = tmp_path / "run" / "logs" / TRACE_FILENAME
    for write in (write_turn_run_a, write_turn_run_b, write_turn_run_c):
        write(path).close()
    return path


def _per_stop(table) -> list[tuple]:
    return [(r["stop_no"], r["cut_time"], r["attempts_running"], r["decoded_tokens"], r["kept_tokens"],
             r["redone_tokens"], r["turns_kept"], r["thrown_away_s"]) for r in table.as_dicts()]


def test_a_stop_keeps_the_turns_committed_before_its_cut_and_redoes_the_rest(turn_job):
    with TraceAnalysis([turn_job]) as a:
        assert a.query("kept_by_attempt").rows == BY_ATTEMPT
        assert _per_stop(a.query("kept_per_stop")) == PER_STOP


def test_thrown_away_time_runs_from_the_last_turn_committed_before_the_cut(turn_job):
    with TraceAnalysis([turn_job]) as a:
        rows = a.query("thrown_away_by_attempt").as_dicts()
        per_stop = a.query("thrown_away_per_stop").as_dicts()
    # (gen, attempt, dispatched_at, committed_at, thrown_away_s): see BY_ATTEMPT.
    assert [(r["generation_index"], r["attempt"], r["dispatched_at"], r["committed_at"], r["thrown_away_s"])
            for r in rows] == [(0, 0, 101.0, 104.5, 1.5), (1, 0, 101.5, None, 4.5),
                               (0, 1, 203.0, 204.5, 0.5), (1, 1, 203.0, 204.75, 0.25)]
    assert [(r["stop_no"], r["attempts"], r["thrown_away_s"]) for r in per_stop] == [(1, 2, 6.0), (2, 2, 0.75)]


def test_the_kept_figures_are_the_same_in_sqlite_and_for_a_job_resumed_into_other_directories(turn_job, tmp_path):
    conn = open_sqlite_analysis([turn_job])
    try:
        with TraceAnalysis([turn_job]) as a:
            for name in trace_queries.QUERIES:
                assert a.query(name).rows == sqlite_query(conn, name).rows, name
    finally:
        conn.close()
    # Each run in a directory of its own: the calls of run A are matched from run B's file.
    files = [tmp_path / d / TRACE_FILENAME for d in ("a", "b", "c")]
    for write, path in zip((write_turn_run_a, write_turn_run_b, write_turn_run_c), files):
        write(path).close()
    with TraceAnalysis(files) as a:
        assert a.query("kept_by_attempt").rows == BY_ATTEMPT
        assert _per_stop(a.query("kept_per_stop")) == PER_STOP


def test_a_prompts_later_group_running_beside_the_stopped_one_adds_nothing_to_its_figures(tmp_path):
    # A small dataset's next epoch draws prompt 10 again while its group 1 is still in
    # flight: group 5's generation 0, attempt 0 has the same (prompt, generation, attempt)
    # and runs at the same time. An attempt is matched by its group as well, so group 5's
    # call and turn count neither as group 1's decoded tokens nor move its last commit.
    path = tmp_path / "run" / "logs" / TRACE_FILENAME
    tr = write_turn_run_a(path)
    tr.emit("group_reserved", t=101.1, group_id=5, prompt_id=10, step=2, policy_version=0, group_size=2)
    later = dict(group_id=5, prompt_id=10, generation_index=0, attempt=0, policy_version=0)
    tr.emit("attempt_dispatched", t=101.2, **later)
    tr.emit("call_finished", t=105.8, turn=0, tokens=100, finish_reason="stop", **later)
    tr.emit("turn_committed", t=105.9, turn=0, tokens=100, total_tokens=110, **later)
    tr.close()
    for write in (write_turn_run_b, write_turn_run_c):
        write(path).close()
    conn = open_sqlite_analysis([path])
    try:
        assert sqlite_query(conn, "kept_by_attempt").rows == BY_ATTEMPT
        assert _per_stop(sqlite_query(conn, "kept_per_stop")) == PER_STOP
    finally:
        conn.close()
    with TraceAnalysis([path]) as a:
        assert a.query("kept_by_attempt").rows == BY_ATTEMPT
        assert _per_stop(a.query("kept_per_stop")) == PER_STOP


def test_two_groups_of_one_prompt_running_at_a_stop_each_get_their_own_figures(tmp_path):
    # Group 5 draws prompt 10 again while group 1 runs; both are running at the cut of
    # 106, both are restarted: the same (prompt, generation, attempt) twice at one stop.
    # Group 5's attempt: its turn 0 (100 tokens) committed at 103.5, before the cut: kept
    # whole, nothing redone, thrown away 106 - 103.5 = 2.5 s.
    path = tmp_path / "run" / "logs" / TRACE_FILENAME
    later = dict(group_id=5, prompt_id=10, generation_index=0, policy_version=0)
    a = write_turn_run_a(path)
    a.emit("group_reserved", t=101.1, group_id=5, prompt_id=10, step=2, policy_version=0, group_size=2)
    a.emit("attempt_dispatched", t=101.2, attempt=0, **later)
    a.emit("call_finished", t=103, turn=0, tokens=100, finish_reason="stop", attempt=0, **later)
    a.emit("turn_committed", t=103.5, turn=0, tokens=100, total_tokens=110, attempt=0, **later)
    a.close()
    b = write_turn_run_b(path)
    b.emit("attempt_abandoned", t=201, reason="restart", attempt=0, **later)
    b.emit("attempt_dispatched", t=203.5, attempt=1, **later)
    b.emit("episode_restored", t=203.5, from_attempt=0, turn=1, tokens=100, total_tokens=110, attempt=1, **later)
    b.close()
    write_turn_run_c(path).close()
    expected = sorted(BY_ATTEMPT + [(1, 10, 0, 0, 5, 100, 100, 100, 0, None, 0, 1, 0, 2.5)],
                      key=lambda r: (r[0], r[1], r[2], r[3], r[4]))
    conn = open_sqlite_analysis([path])
    try:
        assert sqlite_query(conn, "kept_by_attempt").rows == expected
    finally:
        conn.close()
    with TraceAnalysis([path]) as an:
        assert an.query("kept_by_attempt").rows == expected
        per_stop = _per_stop(an.query("kept_per_stop"))
    assert per_stop == [(1, 106.0, 3, 156, 135, 21, 3, 8.5), PER_STOP[1]]


def test_an_attempt_a_resumed_run_never_restarted_belongs_to_the_stop_that_first_held_it(tmp_path):
    # Run B restores the cut of 106 and is stopped again before it restarts group 1 (room
    # for it never came); its own snapshot at 205 still holds group 1's attempts running,
    # and run C, restoring that, is the one that records their restart abandon. The work
    # they lost was lost at stop 1 (dispatched in run A, after it the cut of 106): they are
    # stop 1's attempts, with stop 1's figures, and stop 2 has none.
    path = tmp_path / "run" / "logs" / TRACE_FILENAME
    write_turn_run_a(path).close()
    b = Tracer(path, clock=lambda: 200.0)
    b.emit("restore_done", t=202, snapshot_seq=1, cut_time=106, anchor="bootstrap", groups_restored=1)
    b.emit("snapshot_cut", t=205.1, cut_time=205, snapshot_seq=2, anchor="bootstrap")
    b.emit("group_reserved", t=207, group_id=2, prompt_id=20, step=2, policy_version=0, group_size=2)
    b.close()
    c = Tracer(path, clock=lambda: 300.0)
    c.emit("attempt_abandoned", t=301, reason="restart", **_attempt(10, 0, 0))
    c.emit("attempt_abandoned", t=301, reason="restart", **_attempt(10, 1, 0))
    c.emit("restore_done", t=302, snapshot_seq=2, cut_time=205, anchor="bootstrap", groups_restored=2)
    c.emit("attempt_dispatched", t=303, **_attempt(10, 0, 1))
    c.emit("episode_restored", t=303, from_attempt=0, turn=2, tokens=35, total_tokens=50, **_attempt(10, 0, 1))
    c.emit("attempt_dispatched", t=303, **_attempt(10, 1, 1))
    c.close()
    conn = open_sqlite_analysis([path])
    try:
        sqlite_rows = sqlite_query(conn, "thrown_away_by_attempt").as_dicts()
    finally:
        conn.close()
    with TraceAnalysis([path]) as a:
        rows = a.query("thrown_away_by_attempt").as_dicts()
        kept = a.query("kept_by_attempt").rows
    assert rows == sqlite_rows
    # (stop, gen, attempt, thrown-away s): as stop 1 of BY_ATTEMPT.
    assert [(r["stop_no"], r["generation_index"], r["attempt"], r["thrown_away_s"]) for r in rows] == [
        (1, 0, 0, 1.5), (1, 1, 0, 4.5)]
    assert [r[:5] + r[6:8] for r in kept] == [(1, 10, 0, 0, 1, 35, 35), (1, 10, 1, 0, 1, 9, 0)]


def write_group_level_job(path) -> None:
    """test_trace_analysis's job (group-level recovery: no turn events) with the calls of
    its attempts: one call per generation (turn 0)."""
    tr = write_run_a(path)
    e = tr.emit
    # Calls of attempts that will be abandoned with reason restart at the stop:
    e("call_finished", t=104, group_id=2, prompt_id=20, generation_index=0, attempt=0, turn=0, tokens=6)
    e("call_finished", t=109.5, group_id=3, prompt_id=30, generation_index=0, attempt=0, turn=0, tokens=5)
    # Not running at the stop: prompt 30 gen 1 attempt 0 was abandoned for its deadline,
    # prompt 10's group was sealed before the cut.
    e("call_finished", t=103.2, group_id=3, prompt_id=30, generation_index=1, attempt=0, turn=0, tokens=100)
    e("call_finished", t=104, group_id=1, prompt_id=10, generation_index=0, attempt=0, turn=0, tokens=15)
    tr.close()
    write_run_b(path).close()


def test_a_group_level_run_keeps_nothing_and_its_thrown_away_time_is_unchanged(tmp_path):
    path = tmp_path / TRACE_FILENAME
    write_group_level_job(path)
    with TraceAnalysis([path]) as a:
        thrown = a.query("thrown_away_by_attempt").as_dicts()
        kept = a.query("kept_per_stop").as_dicts()
        by_attempt = a.query("kept_by_attempt").rows
    # Without turn_committed, thrown_away_s is the old cut_time - last dispatch, exactly:
    # 106 - 102, 106 - 102.5, 106 - 103, 106 - 104 (test_trace_analysis).
    assert [(r["prompt_id"], r["generation_index"], r["attempt"], r["thrown_away_s"]) for r in thrown] == [
        (20, 0, 0, 4.0), (20, 1, 0, 3.5), (30, 0, 0, 3.0), (30, 1, 1, 2.0)]
    assert all(r["committed_at"] is None and r["thrown_away_s"] == r["cut_time"] - r["dispatched_at"] for r in thrown)
    # Decoded: 6 (prompt 20 gen 0) + 5 (prompt 30 gen 0); nothing kept, all redone.
    assert [(r[1], r[2], r[3], r[5], r[7], r[10], r[11], r[12]) for r in by_attempt] == [
        (20, 0, 0, 6, 0, 6, 0, None), (20, 1, 0, 0, 0, 0, 0, None), (30, 0, 0, 5, 0, 5, 0, None),
        (30, 1, 1, 0, 0, 0, 0, None)]
    assert [(r["attempts_running"], r["decoded_tokens"], r["kept_tokens"], r["redone_tokens"], r["turns_kept"],
             r["thrown_away_s"]) for r in kept] == [(4, 11, 0, 11, 0, 12.5)]


def test_rolloutdb_trace_prints_what_each_stop_kept_and_writes_it_as_csv_json_and_a_plot(turn_job, capsys):
    run_dir = turn_job.parent.parent
    assert main(["trace", str(run_dir)]) == 0
    printed = capsys.readouterr().out
    section = printed.split("What each stop kept\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert section[0].split() == ["stop_no", "stopped_run", "resumed_run", "cut_time", "attempts_running",
                                  "decoded_tokens", "decoded_by_cut", "kept_tokens", "fallback_tokens",
                                  "unexplained_tokens", "redone_tokens", "turns_kept", "thrown_away_s"]
    # decoded by the cut: 35 + 9 at stop 1, 12 + 9 at stop 2 (BY_ATTEMPT above)
    assert set(section[1]) == {"-", " "} and section[-1] == "(2 rows)"  # the shared table format
    assert [line.split()[3:] for line in section[2:-1]] == [
        ["1970-01-01T00:01:46Z", "2", "56", "44", "35", "0", "-", "21", "2", "6.000"],
        ["1970-01-01T00:03:25Z", "2", "29", "21", "21", "0", "-", "8", "4", "0.750"]]
    plots = run_dir / "plots"
    with open(plots / "kept_per_stop.csv", newline="") as f:
        got = [(r["stop_no"], r["decoded_tokens"], r["kept_tokens"], r["redone_tokens"]) for r in csv.DictReader(f)]
    assert got == [("1", "56", "35", "21"), ("2", "29", "21", "8")]
    with open(plots / "kept_by_attempt.csv", newline="") as f:
        assert [r["last_committed_turn"] for r in csv.DictReader(f)] == ["1", "", "2", "0"]
    report = json.loads((plots / "trace_report.json").read_text())
    assert [(r["decoded_tokens"], r["kept_tokens"], r["redone_tokens"]) for r in report["kept_per_stop"]] == [
        (56, 35, 21), (29, 21, 8)]
    assert [r["thrown_away_s"] for r in report["kept_by_attempt"]] == [1.5, 4.5, 0.5, 0.25]
    assert (plots / "kept.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_ctrl_c_whose_exception_python_lost_stops_rolloutdb_trace_before_it_writes_a_report(turn_job):
    """The analysis checks the recorded signal (`TraceAnalysis(stop=)`): without it the
    whole analysis ran, wrote its report to plots/ and only then exited 130."""
    run_dir = turn_job.parent.parent
    plant = lost_ctrl_c.script("rolloutdb.store.trace.analysis", "standalone")
    proc = subprocess.run([sys.executable, "-c", plant, "trace", str(run_dir)], env=env(), capture_output=True,
                          text=True, timeout=120)
    assert "Exception ignored" in proc.stderr, proc.stderr  # the plant worked: the exception was lost
    assert (proc.returncode, proc.stderr.splitlines()[-1]) == (130, "error: interrupted"), proc.stderr
    assert proc.stdout == ""
    assert not (run_dir / "plots").exists()


def test_rolloutdb_trace_on_a_run_never_stopped_shows_no_stop(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write_turn_run_a(run_dir / "logs" / TRACE_FILENAME).close()
    assert main(["trace", str(run_dir)]) == 0
    printed = capsys.readouterr().out
    assert printed.split("What each stop kept\n", 1)[1].split("\n\n", 1)[0].splitlines()[-1] == "(0 rows)"
    assert (run_dir / "plots" / "kept.png").is_file()
    assert (run_dir / "plots" / "kept_per_stop.csv").read_text().count("\n") == 1  # the header only


def write_prefix_level_job(path) -> None:
    """Prefix level, one stop. Run A, cut at 106, killed at 110:
      gen 0 attempt 0: turn 0 (10 tokens) finishes at 102, commits at 102.5; turn 1 (6
        tokens, its last) finishes at 105 but its batch commits at 106.5, after the cut,
        so the cut saved that call whole (call_cut 6 at 106);
      gen 1 attempt 0: its call is running at the cut with 4 tokens (call_cut 4) and
        finishes at 107 with 9.
    Run B restores cut 106: gen 0 continues from turn 1 (10 tokens) with the 6-token call
    as its prefix; gen 1 from its 4-token prefix."""
    tr = Tracer(path, clock=lambda: 100.0)
    e = tr.emit
    e("group_reserved", t=100, group_id=1, prompt_id=10, step=1, policy_version=0, group_size=2)
    e("attempt_dispatched", t=101, **_attempt(10, 0, 0))
    e("attempt_dispatched", t=101, **_attempt(10, 1, 0))
    e("call_finished", t=102, turn=0, tokens=10, finish_reason="stop", **_attempt(10, 0, 0))
    e("turn_committed", t=102.5, turn=0, tokens=10, total_tokens=14, **_attempt(10, 0, 0))
    e("call_finished", t=105, turn=1, tokens=6, finish_reason="stop", **_attempt(10, 0, 0))
    e("snapshot_cut", t=106.2, cut_time=106, snapshot_seq=1, anchor="bootstrap")
    e("call_cut", t=106, step=1, tokens=6, **_attempt(10, 0, 0))
    e("call_cut", t=106, step=1, tokens=4, **_attempt(10, 1, 0))
    e("call_finished", t=107, turn=0, tokens=9, finish_reason="length", **_attempt(10, 1, 0))
    e("group_reserved", t=110, group_id=2, prompt_id=20, step=2, policy_version=0, group_size=2)
    tr.close()
    tr = Tracer(path, clock=lambda: 200.0)
    e = tr.emit
    e("attempt_abandoned", t=201, reason="restart", **_attempt(10, 0, 0))
    e("attempt_abandoned", t=201, reason="restart", **_attempt(10, 1, 0))
    e("restore_done", t=202, snapshot_seq=1, cut_time=106, anchor="bootstrap", groups_restored=1)
    e("attempt_dispatched", t=203, prefix_tokens=6, **_attempt(10, 0, 1))
    e("episode_restored", t=203, from_attempt=0, turn=1, tokens=10, total_tokens=14, **_attempt(10, 0, 1))
    e("attempt_dispatched", t=203, prefix_tokens=4, **_attempt(10, 1, 1))
    e("group_sealed", t=205, group_id=1, prompt_id=10)
    tr.close()


def test_a_call_the_cut_saved_whole_before_its_commit_counts_once_as_decoded_and_once_as_kept(tmp_path):
    path = tmp_path / TRACE_FILENAME
    write_prefix_level_job(path)
    with TraceAnalysis([path]) as a:
        rows = a.query("kept_by_attempt").as_dicts()
    # gen 0: decoded 10 + 6 = 16, all by the cut (the call_cut of its finished turn-1 call
    #   is that same call, not a 6 more); kept 10 (turn 0) + 6 (prefix) = 16, redone 0.
    # gen 1: decoded 9 (finished before the stop), 4 of them by the cut; kept the 4-token
    #   prefix, redone 9 - 4 = 5.
    assert [(r["generation_index"], r["decoded_tokens"], r["decoded_by_cut"], r["kept_tokens"], r["redone_tokens"])
            for r in rows] == [(0, 16, 16, 16, 0), (1, 9, 4, 4, 5)]


def write_prefix_accounting_job(path, *, decoded_at: float | None = 105.9, fallback: bool = True,
                                flushed: bool = False) -> None:
    """Prefix level, one stop, the cut read the running calls at 105.9 (`decoded_at`)
    and took its ledger read at 106. Run A, killed at 110:
      gen 0 attempt 0: its turn-0 call runs at the read with 3 tokens (call_cut 3) and
        finishes at 105.95, between the read and the cut, with 7: the cut keeps the 3 it
        read, the 4 after the read were not the cut's;
      gen 1 attempt 0: its turn-1 call runs at the read with 5 tokens, but its turn 0
        (8 tokens, finished at 103) was not committed by the cut: the cut leaves it out,
        with a reason (call_fallback turn_not_committed, 5 tokens; `fallback`);
      gen 2 attempt 0 (`flushed`): its turn-0 call (6 tokens) had finished in the engine
        by the read, but the pump wrote its call_finished at 105.92, after the read, and
        the flush after the read committed its turn at 105.95: the cut holds it whole.
    Run B restores the cut: gen 0 continues from its 3-token prefix, gen 1 from turn 0,
    gen 2 from turn 1."""
    tr = Tracer(path, clock=lambda: 100.0)
    e = tr.emit
    e("group_reserved", t=100, group_id=1, prompt_id=10, step=1, policy_version=0, group_size=2)
    e("attempt_dispatched", t=101, **_attempt(10, 0, 0))
    e("attempt_dispatched", t=101, **_attempt(10, 1, 0))
    e("call_finished", t=103, turn=0, tokens=8, finish_reason="stop", **_attempt(10, 1, 0))
    e("call_finished", t=105.95, turn=0, tokens=7, finish_reason="stop", **_attempt(10, 0, 0))
    if flushed:
        e("attempt_dispatched", t=101, **_attempt(10, 2, 0))
        e("call_finished", t=105.92, turn=0, tokens=6, finish_reason="stop", **_attempt(10, 2, 0))
        e("turn_committed", t=105.95, turn=0, tokens=6, total_tokens=10, **_attempt(10, 2, 0))
    e("snapshot_cut", t=106.2, cut_time=106, decoded_at=decoded_at, snapshot_seq=1, anchor="bootstrap")
    e("call_cut", t=106, step=1, tokens=3, **_attempt(10, 0, 0))
    if fallback:
        e("call_fallback", t=106, attempt_id=2, turn=1, reason="turn_not_committed", step=1, tokens=5,
          **_attempt(10, 1, 0))
    e("group_reserved", t=110, group_id=2, prompt_id=20, step=2, policy_version=0, group_size=2)
    tr.close()
    tr = Tracer(path, clock=lambda: 200.0)
    e = tr.emit
    e("attempt_abandoned", t=201, reason="restart", **_attempt(10, 0, 0))
    e("attempt_abandoned", t=201, reason="restart", **_attempt(10, 1, 0))
    if flushed:
        e("attempt_abandoned", t=201, reason="restart", **_attempt(10, 2, 0))
    e("restore_done", t=202, snapshot_seq=1, cut_time=106, decoded_at=decoded_at, anchor="bootstrap",
      groups_restored=1)
    if flushed:
        e("attempt_dispatched", t=203, **_attempt(10, 2, 1))
        e("episode_restored", t=203, from_attempt=0, turn=1, tokens=6, total_tokens=10, **_attempt(10, 2, 1))
    e("attempt_dispatched", t=203, prefix_tokens=3, **_attempt(10, 0, 1))
    e("attempt_dispatched", t=203, **_attempt(10, 1, 1))
    e("episode_restored", t=203, from_attempt=0, turn=1, tokens=8, total_tokens=12, **_attempt(10, 1, 1))
    tr.close()


def _accounting(path) -> list[tuple]:
    with TraceAnalysis([path]) as a:
        rows = a.query("kept_by_attempt").as_dicts()
        stop = a.query("kept_per_stop").as_dicts()
        fell = a.query("fallbacks_per_stop").as_dicts()
    return ([(r["generation_index"], r["decoded_by_cut"], r["kept_tokens"], r["fallback_tokens"],
              r["unexplained_tokens"]) for r in rows],
            [(r["decoded_by_cut"], r["kept_tokens"], r["fallback_tokens"], r["unexplained_tokens"]) for r in stop],
            [(r["reason"], r["calls"], r["tokens"]) for r in fell])


def test_every_token_a_prefix_cut_decoded_is_kept_or_has_a_reason(tmp_path):
    path = tmp_path / TRACE_FILENAME
    write_prefix_accounting_job(path)
    # gen 0: decoded by the read 3 (its call finished after it), kept 3.
    # gen 1: decoded by the read 8 (turn 0) + 5 (the call left out), kept 8, 5 with a reason.
    assert _accounting(path) == ([(0, 3, 3, 0, 0), (1, 13, 8, 5, 0)], [(16, 11, 5, 0)],
                                 [("turn_not_committed", 1, 5)])


def test_a_turn_the_pump_committed_after_the_read_counts_as_decoded_by_the_cut_and_kept(tmp_path):
    # gen 2's call_finished is after the decode point but its turn is in the cut (the
    # flush committed it): decoded by the cut 6, kept 6. Measured by the decode point
    # alone it would be 0 decoded by the cut and 6 kept (more kept than the cut decoded,
    # which a bench under load showed as 164%).
    path = tmp_path / TRACE_FILENAME
    write_prefix_accounting_job(path, flushed=True)
    by_attempt, per_stop, _ = _accounting(path)
    assert by_attempt[2] == (2, 6, 6, 0, 0)
    assert per_stop == [(22, 17, 5, 0)]


def write_prefix_twice_job(path) -> None:
    """Prefix level, two stops. Run A: gen 0 attempt 0's call runs at cut 106 with 3 tokens.
    Run B restores it: attempt 1 is dispatched with that 3-token prefix, decodes 5 more
    (call_finished counts what it decoded), commits turn 0 (8 tokens), and its turn-1 call
    has 1 token at cut 212. Run C restores cut 212: attempt 2 continues from turn 1 (8
    tokens, 3 of them kept at the first stop) with that 1-token prefix."""
    tr = Tracer(path, clock=lambda: 100.0)
    e = tr.emit
    e("group_reserved", t=100, group_id=1, prompt_id=10, step=1, policy_version=0, group_size=1)
    e("attempt_dispatched", t=101, **_attempt(10, 0, 0))
    e("snapshot_cut", t=106.2, cut_time=106, decoded_at=105.9, snapshot_seq=1, anchor="bootstrap")
    e("call_cut", t=106, step=1, tokens=3, **_attempt(10, 0, 0))
    tr.close()
    tr = Tracer(path, clock=lambda: 200.0)
    e = tr.emit
    e("attempt_abandoned", t=201, reason="restart", **_attempt(10, 0, 0))
    e("restore_done", t=202, snapshot_seq=1, cut_time=106, decoded_at=105.9, anchor="bootstrap", groups_restored=1)
    e("attempt_dispatched", t=203, prefix_tokens=3, **_attempt(10, 0, 1))
    e("call_finished", t=210, turn=0, tokens=5, finish_reason="stop", **_attempt(10, 0, 1))
    e("turn_committed", t=211, turn=0, tokens=8, total_tokens=12, **_attempt(10, 0, 1))
    e("snapshot_cut", t=212.2, cut_time=212, decoded_at=211.9, snapshot_seq=2, anchor="bootstrap")
    e("call_cut", t=212, step=1, tokens=1, **_attempt(10, 0, 1))
    e("group_reserved", t=215, group_id=2, prompt_id=20, step=2, policy_version=0, group_size=1)
    tr.close()
    tr = Tracer(path, clock=lambda: 300.0)
    e = tr.emit
    e("attempt_abandoned", t=301, reason="restart", **_attempt(10, 0, 1))
    e("restore_done", t=302, snapshot_seq=2, cut_time=212, decoded_at=211.9, anchor="bootstrap", groups_restored=1)
    e("attempt_dispatched", t=303, prefix_tokens=1, **_attempt(10, 0, 2))
    e("episode_restored", t=303, from_attempt=1, turn=1, tokens=8, total_tokens=12, **_attempt(10, 0, 2))
    tr.close()


def test_a_prefix_kept_at_one_stop_is_not_kept_again_when_its_turn_is_restored_at_the_next(tmp_path):
    # Attempt 1 decoded 5 + 1 tokens; the 8-token turn restored at stop 2 holds the
    # 3-token prefix stop 1 kept: stop 2 kept 5 + 1, not 8 + 1; and its own prefix is not
    # subtracted from its turn-1 call (loaded CI runs reported kept > decoded by the cut
    # for both).
    path = tmp_path / TRACE_FILENAME
    write_prefix_twice_job(path)
    with TraceAnalysis([path]) as a:
        rows = a.query("kept_by_attempt").as_dicts()
    assert [(r["stop_no"], r["attempt"], r["decoded_tokens"], r["decoded_by_cut"], r["kept_tokens"],
             r["unexplained_tokens"]) for r in rows] == [(1, 0, 3, 3, 3, 0), (2, 1, 6, 6, 6, 0)]


def test_a_token_the_cut_decoded_and_left_without_a_reason_is_reported_unexplained(tmp_path):
    # Planted: the resumed run lost gen 1's committed turn 0 (8 tokens decoded by the cut,
    # no episode_restored for them, no fallback): those 8 are reported, per attempt and stop.
    path = tmp_path / TRACE_FILENAME
    write_prefix_accounting_job(path, fallback=False)
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("DELETE FROM episode_restored")
    by_attempt, per_stop, fell = _accounting(path)
    assert by_attempt == [(0, 3, 3, 0, 0), (1, 8, 0, 0, 8)]
    assert per_stop == [(11, 3, 0, 8)] and fell == []


def test_measured_against_the_cuts_time_instead_of_its_read_a_call_finished_in_between_looks_lost(tmp_path):
    # The decode point matters: with the read's time unknown (a trace before trace_v1_4_a,
    # or below prefix level) the analysis counts gen 0's whole 7-token call as decoded by
    # the cut and reports nothing as unexplained (it cannot tell).
    path = tmp_path / TRACE_FILENAME
    write_prefix_accounting_job(path, decoded_at=None)
    by_attempt, per_stop, _ = _accounting(path)
    assert by_attempt == [(0, 7, 3, 0, None), (1, 13, 8, 5, None)]
    assert per_stop == [(20, 11, 5, None)]
