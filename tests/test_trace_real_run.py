"""`rolloutdb trace` on a real run of the main job that was SIGKILLed and resumed, against
its never-stopped twin (same config and seed), every figure checked independently.

The job is the crash harness's small config with the trace on. The twin runs to the end;
the other run is killed once, after it has published a rollout snapshot anchored to a
trainer checkpoint beyond bootstrap that holds running attempts (we freeze the process
with SIGSTOP, look at the snapshot a resume would restore, and SIGKILL it if the snapshot
fits, SIGCONT otherwise; a run that ends first is tried again in a fresh directory), then
resumed with --resume. The figures are compared with
numbers computed here from the trace file with plain sqlite3 and from metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from crash_harness import EXAMPLE, OVERRIDES, kill_when, metrics, newest_usable_snapshot
from rolloutdb.store.trace.writer import TRACE_FILENAME
from rolloutdb.timefmt import iso_utc

TIMEOUT_S = 240
KILL_TRIES = 3
# More than the crash harness's 5: a wider window for the kill. The pump runs max_staleness
# steps ahead, so the last ~3 steps' snapshots find it done and idle; with 8 steps a run
# under load left 3-5 snapshots with attempts running (measured beside 4 busy loops on 2
# cores), with 12 it leaves 6-9.
STEPS = 12
# Staleness 2 lets the rollout pump run ahead of training, so that a snapshot anchored to
# a trainer checkpoint usually holds running attempts (with 1 it often finds the pump
# waiting for new weights, and a kill then throws nothing away).
CONFIG = [o for o in OVERRIDES if not o.startswith("algorithm.total_steps=")] + [
    f"algorithm.total_steps={STEPS}", "algorithm.max_staleness=2"]
PLOTS = ("thrown_away.png", "lost_progress.png", "batch_age.png")
TABLES = ("thrown_away_per_stop", "thrown_away_by_attempt", "lost_progress_per_stop", "lost_progress_by_group",
          "batch_age_per_step")


def _train(run_dir: Path, resume: bool = False) -> subprocess.Popen:
    """Start the job; its stderr goes to `_stderr_file(run_dir, resume)`, a file, not a pipe
    nobody reads while it runs (a full pipe would stall the job until the kill's timeout)."""
    cmd = [sys.executable, "-m", "rolloutdb", "train", "--config", str(EXAMPLE), "--run-dir", str(run_dir)]
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUTDB_FAULT"}
    env["RAY_AUTH_MODE"] = "disabled"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with _stderr_file(run_dir, resume).open("w") as stderr:
        return subprocess.Popen(cmd + (["--resume"] if resume else []) + CONFIG, env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def _stderr_file(run_dir: Path, resume: bool = False) -> Path:
    return run_dir.parent / f"{run_dir.name}{'.resumed' if resume else ''}.stderr"


def _anchor_of(snapshot: str) -> str:
    return Path(snapshot).parents[1].name  # CHECKPOINTS/<anchor>/rollout_snapshots/snapshot_<N>


def _running_attempts(snapshot_db: Path) -> int:
    uri = f"file:{snapshot_db}?mode=ro&immutable=1"  # a published snapshot never changes
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        return conn.execute("SELECT count(*) FROM rollouts WHERE state = 'running'").fetchone()[0]


def _kill_once_beyond_bootstrap(run_dir: Path, proc: subprocess.Popen) -> str | None:
    """SIGKILL `proc` at a moment when the snapshot a resume would restore is anchored to
    a trainer checkpoint beyond bootstrap and has attempts running. Returns that snapshot,
    or None if the run ended before there was one (rare: a loaded machine can find the
    pump idle at every such snapshot)."""

    def look() -> str | None:
        if not any(e.get("outcome") == "published" and str(e.get("anchor", "")).startswith("step_")
                   for e in metrics(run_dir, "snapshot")):
            return None
        # Decided from the manifests on disk (read as JSON, files hashed), not with
        # the selection code the resume runs: the resume must agree with this.
        newest = newest_usable_snapshot(run_dir / "checkpoints")
        if newest is not None and _anchor_of(newest[1]).startswith("step_") \
                and _running_attempts(Path(newest[1]) / "rollout_state.sqlite") > 0:
            return newest[1]
        return None

    try:
        return kill_when(proc, look, timeout=TIMEOUT_S, poll_s=0.01)
    except AssertionError as failed:  # the run failed or hung: its stderr is in a file, not a pipe
        raise AssertionError(f"{failed}{_stderr_file(run_dir).read_text()[-3000:]}") from None


def _snapshots_of(run_dir: Path) -> dict:
    """What a run that ended did with its snapshots: the outcome of every snapshot it
    logged, and (anchor, running attempts) of each it left on disk, oldest first."""
    found = sorted(run_dir.glob("checkpoints/*/rollout_snapshots/snapshot_*/rollout_state.sqlite"),
                   key=lambda db: int(db.parent.name.removeprefix("snapshot_")))
    return {"logged": [(e.get("outcome"), e.get("anchor")) for e in metrics(run_dir, "snapshot")],
            "on_disk": [(_anchor_of(str(db.parent)), _running_attempts(db)) for db in found]}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_run")
    twin_dir, out = root / "twin", root / "report"
    twin = _train(twin_dir)  # runs beside the killed run: the twin's timing does not matter
    ended = []
    for attempt in range(KILL_TRIES):
        run_dir = root / f"run{attempt}"
        first = _train(run_dir)
        snapshot = _kill_once_beyond_bootstrap(run_dir, first)
        if snapshot is not None:
            break
        ended.append(_snapshots_of(run_dir))
    else:
        pytest.fail(f"{KILL_TRIES} runs ended before a snapshot beyond bootstrap with running attempts was published; "
                    f"what each did with its snapshots: {ended}")
    assert first.returncode == -signal.SIGKILL
    resumed = _train(run_dir, resume=True)
    errs = {}
    for name, proc, stderr in (("twin", twin, _stderr_file(twin_dir)),
                               ("resumed", resumed, _stderr_file(run_dir, resume=True))):
        proc.wait(timeout=TIMEOUT_S)
        errs[name] = stderr.read_text()
        assert proc.returncode == 0, errs[name][-2000:]
    report = subprocess.run([sys.executable, "-m", "rolloutdb", "trace", str(run_dir), "--baseline", str(twin_dir),
                             "--out", str(out), "--steps"], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert report.returncode == 0, report.stderr
    return {"run_dir": run_dir, "twin_dir": twin_dir, "out": out, "printed": report.stdout, "snapshot": snapshot,
            "resume_stderr": errs["resumed"],
            "json": json.loads((out / "trace_report.json").read_text())}


def _trace_rows(run_dir: Path, sql: str, *args) -> list[tuple]:
    path = run_dir / "logs" / TRACE_FILENAME
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return conn.execute(sql, args).fetchall()


def _printed_table(printed: str, title: str) -> list[list[str]]:
    lines = printed.split(f"\n{title}\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [line.split() for line in lines[2:-1]]  # without the header, its rule and the row count


def test_the_resumed_run_restored_the_snapshot_it_was_killed_after(job):
    restores = metrics(job["run_dir"], "restore")
    assert [r["snapshot"] for r in restores] == [job["snapshot"]]
    assert restores[0]["anchor"] == _anchor_of(job["snapshot"]) and restores[0]["anchor"].startswith("step_")
    seq = int(Path(job["snapshot"]).name.removeprefix("snapshot_"))
    assert f"resumed from {_anchor_of(job['snapshot'])}/snapshot_{seq} " in job["resume_stderr"]
    # The kill log: the newest snapshot the killed process logged as published is the one.
    logged = [e["sequence"] for e in metrics(job["run_dir"])[: _restore_index(job["run_dir"])]
              if e.get("kind") == "snapshot" and e.get("outcome") == "published"]
    assert logged and max(logged) <= seq


def _restore_index(run_dir: Path) -> int:
    return next(i for i, e in enumerate(metrics(run_dir)) if e.get("kind") == "restore")


def _restored_cut_time(run_dir: Path) -> float:
    """The cut time (epoch seconds, full precision) of the snapshot the resumed run
    restored, from the trace file: the report shows it as ISO-8601 (milliseconds), too
    coarse to join events on."""
    runs = [r[0] for r in _trace_rows(run_dir, "SELECT run FROM runs ORDER BY first_t")]
    assert len(runs) == 2
    (cut_time,) = [r[0] for r in _trace_rows(run_dir, "SELECT cut_time FROM restore_done WHERE run = ?", runs[1])]
    return cut_time


def test_thrown_away_time_equals_an_independent_computation_from_the_trace_file(job):
    run_dir = job["run_dir"]
    # Plain SQL and Python over the file's tables, none of the analysis views: the resumed
    # run is the second in `runs`; its restore_done names the cut; each attempt it
    # abandoned with reason 'restart' threw away cut_time - its last dispatch before it.
    cut_time = _restored_cut_time(run_dir)
    runs = [r[0] for r in _trace_rows(run_dir, "SELECT run FROM runs ORDER BY first_t")]
    abandoned = _trace_rows(run_dir, "SELECT prompt_id, generation_index, attempt FROM attempt_abandoned "
                                     "WHERE reason = 'restart' AND run = ?", runs[1])
    dispatched: dict[tuple, float] = {}
    for key_t in _trace_rows(run_dir, "SELECT prompt_id, generation_index, attempt, t FROM attempt_dispatched"):
        key, t = key_t[:3], key_t[3]
        if t <= cut_time:
            dispatched[key] = max(t, dispatched.get(key, -math.inf))
    expected = sum(cut_time - dispatched[key] for key in abandoned)

    (stop,) = job["json"]["thrown_away_per_stop"]
    assert stop["attempts"] == len(abandoned) > 0
    assert stop["thrown_away_s"] >= 0
    assert math.isclose(stop["thrown_away_s"], expected, rel_tol=1e-9, abs_tol=1e-9)
    assert stop["cut_time"] == iso_utc(cut_time)  # the report shows points in time as ISO-8601 UTC
    assert len(job["json"]["thrown_away_by_attempt"]) == len(abandoned)
    assert _printed_table(job["printed"], "Thrown-away time per stop")[0][6] == str(len(abandoned))


def test_lost_progress_matches_groups_running_at_the_stop_with_the_twin(job):
    (stop,) = job["json"]["lost_progress_per_stop"]
    assert stop["groups_running"] >= stop["groups_matched"]
    matched = [g for g in job["json"]["lost_progress_by_group"] if g["lost_s"] is not None]
    assert len(matched) == stop["groups_matched"]
    assert math.isclose(stop["lost_s_total"] or 0.0, sum(g["lost_s"] for g in matched), abs_tol=1e-9)  # None: none matched
    # The groups running at the stop, recomputed from the killed run's events: a prompt
    # whose latest reservation was followed by no seal and no discard up to the cut.
    run_dir = job["run_dir"]
    first = _trace_rows(run_dir, "SELECT run FROM runs ORDER BY first_t LIMIT 1")[0][0]
    cut_time = _restored_cut_time(run_dir)
    assert job["json"]["thrown_away_per_stop"][0]["cut_time"] == iso_utc(cut_time)
    reserved = dict(_trace_rows(run_dir, "SELECT prompt_id, max(t) FROM group_reserved WHERE run = ? GROUP BY prompt_id",
                                first))
    settled = dict(_trace_rows(run_dir, "SELECT prompt_id, max(t) FROM (SELECT prompt_id, t, run FROM group_sealed "
                                        "UNION ALL SELECT prompt_id, t, run FROM group_discarded) "
                                        "WHERE run = ? AND t <= ? GROUP BY prompt_id", first, cut_time))
    expected = {p for p, t in reserved.items() if t > settled.get(p, -math.inf)}
    running = [g["prompt_id"] for g in job["json"]["lost_progress_by_group"]]
    assert sorted(running) == sorted(expected) and stop["groups_running"] == len(expected)
    discarded = _trace_rows(run_dir, "SELECT prompt_id FROM group_discarded WHERE run = ? AND t <= ?", first, cut_time)
    assert discarded, "no group was discarded before the cut: the check above proves less than it should"
    # Matched: a running prompt sealed again after the resume and sealed in the twin. The
    # two runs train at different moments, so a prompt may earn rewards with no variance
    # in one of them and be discarded there: the count is what it is, but it must be
    # exactly the prompts sealed on both sides.
    resumed = _trace_rows(run_dir, "SELECT run FROM runs ORDER BY first_t")[1][0]
    sealed_after = {r[0] for r in _trace_rows(run_dir, "SELECT prompt_id FROM group_sealed WHERE run = ?", resumed)}
    sealed_twin = {r[0] for r in _trace_rows(job["twin_dir"], "SELECT prompt_id FROM group_sealed")}
    assert stop["groups_matched"] == len(expected & sealed_after & sealed_twin)


def test_batch_age_is_printed_for_every_step_and_equals_the_logged_value(job):
    events = metrics(job["run_dir"])
    restore_at = next(i for i, e in enumerate(events) if e.get("kind") == "restore")
    logged = {1: [(e["step"], e["batch_age"]) for e in events[:restore_at] if e.get("kind") == "train_step"],
              2: [(e["step"], e["batch_age"]) for e in events[restore_at:] if e.get("kind") == "train_step"]}
    rows = job["json"]["batch_age_per_step"]
    traced = {n: [(r["step"], r["batch_age"]) for r in rows if r["run_no"] == n] for n in (1, 2)}
    assert {r["step"] for r in rows} == set(range(1, STEPS + 1))
    assert traced[1] and traced[2]
    for n in (1, 2):
        # A kill may fall between a step's trace event and its metrics line: the killed
        # run's two lists may differ by their last entry, nothing else.
        common = min(len(traced[n]), len(logged[n]))
        assert common >= len(traced[n]) - (n == 1) and common >= len(logged[n]) - (n == 1)
        for (step, age), (logged_step, logged_age) in zip(traced[n][:common], logged[n][:common]):
            assert step == logged_step and math.isclose(age, logged_age, rel_tol=1e-9, abs_tol=1e-12), (n, step)
    for r in rows:
        assert math.isclose(r["batch_age"], r["logged_batch_age"], rel_tol=1e-9, abs_tol=1e-12)
    # And against a computation from the trace file in plain Python (the logged value
    # could be wrong in the same way): per train_step, its groups' latest group_published
    # at or before it, tokens per policy version >= 0, age = trained version - version.
    run_dir = job["run_dir"]
    publishes: dict[int, list[tuple[float, int]]] = {}
    for seq, t, group_id in _trace_rows(run_dir, "SELECT seq, t, group_id FROM group_published"):
        publishes.setdefault(group_id, []).append((t, seq))
    tokens: dict[int, list[tuple[int, int]]] = {}
    for seq, version, n in _trace_rows(run_dir, "SELECT seq, policy_version, tokens FROM published_tokens"):
        tokens.setdefault(seq, []).append((version, n))
    members: dict[int, list[int]] = {}
    for seq, group_id in _trace_rows(run_dir, "SELECT seq, group_id FROM trained_groups"):
        members.setdefault(seq, []).append(group_id)
    by_hand = []
    for seq, t, step, version in _trace_rows(run_dir, "SELECT seq, t, step, policy_version FROM train_step ORDER BY t, seq"):
        trained_version = step - 1 if version is None else version
        total = weighted = 0
        for g in members.get(seq, []):
            latest = max(p for p in publishes[g] if p[0] <= t)[1]
            for v, n in tokens.get(latest, []):
                if v >= 0:
                    total += n
                    weighted += (trained_version - v) * n
        by_hand.append((step, weighted / total))
    assert len(by_hand) == len(rows)
    for (step, age), r in zip(by_hand, rows):
        assert step == r["step"] and math.isclose(age, r["batch_age"], rel_tol=1e-9, abs_tol=1e-12), (step, age, r)
    printed = _printed_table(job["printed"], "Batch age per train step")
    assert [(int(p[0]), int(p[1])) for p in printed] == [(r["run_no"], r["step"]) for r in rows]
    assert [p[6] for p in printed] == [f"{r['batch_age']:.3f}" for r in rows]
    assert f"equal to the logged value at all {len(rows)} steps" in job["printed"]


def test_the_report_files_and_plots_are_written(job):
    out = job["out"]
    for png in PLOTS:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    for name in TABLES:
        with open(out / f"{name}.csv", newline="") as f:
            rows = list(csv.reader(f))
        assert len(rows) - 1 == len(job["json"][name]), name
    assert job["json"]["baseline"] == [str(job["twin_dir"] / "logs" / TRACE_FILENAME)]


def test_trace_json_from_a_subprocess_is_the_report_document_with_points_in_time_in_iso_8601(job, tmp_path):
    import re

    r = subprocess.run([sys.executable, "-m", "rolloutdb", "trace", str(job["run_dir"]), "--baseline",
                        str(job["twin_dir"]), "--out", str(tmp_path), "--json"], capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc == json.loads((tmp_path / "trace_report.json").read_text())
    iso = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3})?Z$")
    times = [row[c] for name in TABLES for row in doc[name] for c in ("cut_time", "dispatched_at", "t")
             if row.get(c) is not None]
    assert times and all(isinstance(v, str) and iso.match(v) for v in times), times[:5]
    with open(tmp_path / "thrown_away_by_attempt.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(iso.match(row["dispatched_at"]) and iso.match(row["cut_time"]) for row in rows)


def test_by_default_the_batch_age_is_one_summary_line_and_steps_prints_every_step(job, tmp_path):
    rows = job["json"]["batch_age_per_step"]
    ages = [r["batch_age"] for r in rows if r["batch_age"] is not None]
    plain = subprocess.run([sys.executable, "-m", "rolloutdb", "trace", str(job["run_dir"]), "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert plain.returncode == 0, plain.stderr
    assert "Batch age per train step" not in plain.stdout and "Thrown-away time per stop" in plain.stdout
    assert (f"Batch age: {len(ages)} train steps, mean {sum(ages) / len(ages):.3f}, min {min(ages):.3f}, "
            f"max {max(ages):.3f}") in plain.stdout
    assert len(_printed_table(job["printed"], "Batch age per train step")) == len(rows)
