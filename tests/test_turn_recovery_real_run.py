"""Turn-level recovery on a real run of the main job: the multi-turn long-tail example at
`target_level: turn`, SIGKILLed once while the snapshot a resume would restore holds
episodes with committed turns, resumed with --resume, and reported by `rolloutdb trace`
against its never-stopped twin (same config and seed).

What the resume kept is decided here from the files, not with the code under test: the
snapshot the resume must restore is found from the manifests on disk
(`crash_harness.newest_usable_snapshot`) while the process is frozen (SIGSTOP), a copy of
its store file is taken before the kill (retention may remove the snapshot later), and its
`env_episodes` rows are decoded with numpy and json. The report's figures and the resumed
run's trace events must agree with that copy.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from crash_harness import kill_when, newest_usable_snapshot, resumed_events, train_env
from transcripts import saved_transcripts

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "multiturn.yaml"
TIMEOUT_S = 240
KILL_TRIES = 3
CONFIG = [
    "run.seed=3",
    "algorithm.total_steps=8",
    "algorithm.max_staleness=2",
    "checkpointing.interval_steps=1",
    "rollout_checkpointing.interval_s=0.1",
    "trace.enabled=true",
    "logging.progress=false",
    "logging.plot=false",
]


def _train(run_dir: Path, resume: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rolloutdb", "train", "--config", str(EXAMPLE), "--run-dir", str(run_dir)]
    return subprocess.Popen(cmd + (["--resume"] if resume else []) + CONFIG, env=train_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _saved_turns(snapshot_db: Path) -> dict[tuple[int, int, int], tuple[int, int]]:
    """(group, generation, attempt number) -> (turns committed, policy tokens saved) for
    every running attempt's episode with a transcript, decoded by hand."""
    uri = f"file:{snapshot_db}?mode=ro&immutable=1"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        transcripts = saved_transcripts(conn)
        rows = [(g, i, a, turn, transcripts[e].token_ids, transcripts[e].version_token_counts)
                for g, i, a, turn, e in conn.execute(
                    "SELECT r.group_id, r.generation_index, r.attempt, e.turn, e.attempt_id "
                    "FROM env_episodes e JOIN rollouts r ON r.attempt_id = e.attempt_id "
                    "WHERE r.state = 'running' AND e.transcript_tokens IS NOT NULL")]
    out = {}
    for g, i, a, turn, blob, runs in rows:
        assert blob is not None, f"the transcript of ({g}, {i}, {a}) does not line up"
        tokens = np.frombuffer(blob, "<i4")
        pairs = json.loads(runs)
        assert sum(n for _, n in pairs) == len(tokens)
        out[(g, i, a)] = (turn, sum(n for v, n in pairs if v != -1))
    return out


def _kill_with_turns_saved(run_dir: Path, proc: subprocess.Popen, keep: Path) -> dict | None:
    def look() -> dict | None:
        newest = newest_usable_snapshot(run_dir / "checkpoints")
        if newest is None:
            return None
        db = Path(newest[1]) / "rollout_state.sqlite"
        saved = _saved_turns(db)
        if not any(turn >= 1 for turn, _ in saved.values()):
            return None
        shutil.copyfile(db, keep)
        return {"snapshot": newest[1], "saved": saved}

    return kill_when(proc, look, timeout=TIMEOUT_S, poll_s=0.02)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("turn_run")
    twin_dir, out = root / "twin", root / "report"
    twin = _train(twin_dir)
    for attempt in range(KILL_TRIES):
        run_dir = root / f"run{attempt}"
        killed = _kill_with_turns_saved(run_dir, _train(run_dir), root / f"cut{attempt}.sqlite")
        if killed is not None:
            break
    else:
        pytest.fail(f"{KILL_TRIES} runs ended before a snapshot held an episode with a committed turn")
    resumed = _train(run_dir, resume=True)
    for name, proc in (("twin", twin), ("resumed", resumed)):
        _, err = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, (name, err[-2000:])
    report = subprocess.run([sys.executable, "-m", "rolloutdb", "trace", str(run_dir), "--baseline", str(twin_dir),
                             "--out", str(out)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert report.returncode == 0, report.stderr
    verify = subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    return {"run_dir": run_dir, "printed": report.stdout, "json": json.loads((out / "trace_report.json").read_text()),
            "verify": verify, **killed}


def test_every_episode_with_committed_turns_continued_from_its_last_committed_turn(job):
    restored = {(g, i, a_from): (turn, tokens, a_new) for g, i, a_from, turn, tokens, a_new in resumed_events(
        job["run_dir"], "episode_restored", "group_id, generation_index, from_attempt, turn, tokens, attempt")}
    assert {k: v[:2] for k, v in restored.items()} == job["saved"]
    calls = resumed_events(job["run_dir"], "call_finished", "group_id, generation_index, attempt, turn")
    for (g, i, _a), (turn, _tokens, a_new) in restored.items():
        turns = sorted(t for gg, ii, aa, t in calls if (gg, ii, aa) == (g, i, a_new))
        assert turns and turns[0] == turn, ((g, i), turn, turns)  # no earlier turn generated again


def test_the_trace_report_shows_what_the_stop_kept(job):
    (stop,) = job["json"]["kept_per_stop"]
    kept = sum(tokens for _turn, tokens in job["saved"].values())
    assert stop["kept_tokens"] == kept > 0
    assert stop["turns_kept"] == sum(turn for turn, _ in job["saved"].values())
    assert stop["decoded_tokens"] >= stop["kept_tokens"]
    assert stop["redone_tokens"] == stop["decoded_tokens"] - stop["kept_tokens"]
    assert "What each stop kept" in job["printed"]
    assert job["json"]["lost_progress_per_stop"]  # measured against the never-stopped twin


def test_the_resumed_run_lost_and_duplicated_nothing(job):
    assert job["verify"].returncode == 0, job["verify"].stdout + job["verify"].stderr
    figures = json.loads(job["verify"].stdout)
    assert figures["duplicated"] == 0 and figures["lost"] == 0, figures


def _carried(snapshot_db: Path, saved: dict[tuple[int, int, int], tuple[int, int]]) -> dict:
    """For every generation `saved` (an earlier snapshot's episodes) names: what the later
    snapshot shows of it, read by hand: its running attempt's saved turn, 'finished', or
    'settled' (its group left the live store or is no longer dispatched)."""
    uri = f"file:{snapshot_db}?mode=ro&immutable=1"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        states = dict(conn.execute("SELECT group_id, state FROM prompt_groups").fetchall())
        finished = set(conn.execute("SELECT group_id, generation_index FROM rollouts WHERE state = 'finished'").fetchall())
        turns = {(g, i): t for g, i, t in conn.execute(
            "SELECT r.group_id, r.generation_index, e.turn FROM env_episodes e JOIN rollouts r USING (attempt_id) "
            "WHERE r.state = 'running' AND e.transcript_tokens IS NOT NULL").fetchall()}
    out = {}
    for g, i, _a in saved:
        if states.get(g) not in ("dispatched", "sealed"):
            out[(g, i)] = "settled"
        elif (g, i) in finished:
            out[(g, i)] = "finished"
        else:
            out[(g, i)] = turns.get((g, i))
    return out


@pytest.mark.timeout(900)  # three processes, ~40 s on 2 idle cores
def test_a_resume_stopped_again_at_its_first_snapshot_still_holds_the_turns_it_restored(tmp_path):
    """Preempted again soon after a resume: the first snapshot the resumed process
    publishes must still hold every restored episode's committed turns (or its finished
    attempt), or a second stop loses them for good. Two planted bugs fail it: a forced
    snapshot cut at the resume before the pump starts the restored attempts (it held none
    of their turns), and restored turns written only when the next turn commits (a cut
    before that held none)."""
    run_dir = tmp_path / "run"
    first = None
    for attempt in range(KILL_TRIES):
        run_dir = tmp_path / f"run{attempt}"
        first = _kill_with_turns_saved(run_dir, _train(run_dir), tmp_path / f"cut{attempt}.sqlite")
        if first is not None:
            break
    assert first is not None, f"{KILL_TRIES} runs ended before a snapshot held an episode with a committed turn"
    sequence = int(Path(first["snapshot"]).name.split("_")[1])

    def first_of_the_resume() -> dict | None:
        newest = newest_usable_snapshot(run_dir / "checkpoints")
        if newest is None or newest[0] <= sequence:
            return None
        return {"snapshot": newest[1], "carried": _carried(Path(newest[1]) / "rollout_state.sqlite", first["saved"])}

    second = kill_when(_train(run_dir, resume=True), first_of_the_resume, timeout=TIMEOUT_S, poll_s=0.02)
    assert second is not None, "the resumed run ended before it published a snapshot"
    saved = {(g, i): turn for (g, i, _a), (turn, _tokens) in first["saved"].items()}
    lost = {k: (saved[k], got) for k, got in second["carried"].items()
            if got not in ("settled", "finished") and (got is None or got < saved[k])}
    assert not lost, f"(group, generation): (turn restored, turn in {second['snapshot']}): {lost}"
    resumed = _train(run_dir, resume=True)
    _, err = resumed.communicate(timeout=TIMEOUT_S)
    assert resumed.returncode == 0, err[-2000:]
    verify = subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert verify.returncode == 0, verify.stdout + verify.stderr
