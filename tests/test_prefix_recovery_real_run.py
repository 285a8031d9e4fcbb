"""Prefix-level recovery on real runs of the main job, and its twin test.

The multi-turn example at `target_level: prefix`, with the policy held fixed (a recording
GRPO trainer with learning rate 0, tests/recording_trainer.py) and no zero-variance
discards (so every run trains the same groups, greedy's flat ones too), is SIGKILLed
twice while the snapshot a resume would restore holds prefixes of running calls, and
resumed each time. Its never-stopped twin runs the same config. Two configurations, each
with stop strings, presence and frequency penalties and min_tokens set: greedy
(temperature 0) and seeded sampling (temperature 1, with shared-prefix packing: the
seeded pair runs once per session and tests/test_shared_prefix_packing.py reads it too).
The digit task without the long tail, so the config's min_tokens and max_tokens hold (the
long-tail task sets each reply's limits itself). Then:

- every group trained by the killed run was trained by the twin with exactly the same
  tokens and logprobs, generation by generation: "as if never stopped";
- each resume continued every call whose prefix the restored snapshot held, counted from
  a copy of that snapshot taken before the kill (decoded here with SQL, not by the code
  under test), and `rolloutdb verify` finds nothing lost or doubled;
- the settings acted: some replies ended on a stop string, min_tokens held a stop string
  back, and the penalties changed what was decoded (first replies decoded again here with
  and without them).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chunk_bytes import inline_copy
from crash_harness import kill_when, metrics, newest_usable_snapshot, train_env
from transcripts import saved_transcripts

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "multiturn.yaml"
TIMEOUT_S = 300
KILLS = 2


STOPS = ["7", "x"]
MIN_TOKENS, MAX_TOKENS = 4, 24
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5}
# Measured on this tiny policy (run.seed 5): greedy replies end on EOS (~60%) or a stop
# string (~40%), 5 to 19 tokens; seeded ones on EOS (~50%), a stop string (~45%) or
# max_tokens. Every configuration costs two runs side by side (~30 s on 2 cores). The seeded
# one packs shared prefixes too (it changes only how the trainer lays out a batch; the
# learning rate is 0): tests/test_shared_prefix_packing.py checks its packed batches instead
# of killing a run of its own, greedy keeps the unpacked layout.
SAMPLING = {"greedy": ["generation.temperature=0"],
            "seeded": ["generation.temperature=1", "algorithm.shared_prefix_packing=true"]}


def _config(record: Path, mode: str) -> list[str]:
    return [
        "run.seed=5",
        "environment.task=digits",
        f"generation.max_tokens={MAX_TOKENS}",
        f"generation.min_tokens={MIN_TOKENS}",
        f"generation.stop={json.dumps(STOPS)}",
        *(f"generation.{k}={v}" for k, v in PENALTIES.items()),
        *SAMPLING[mode],
        "algorithm.total_steps=8",
        "algorithm.max_staleness=2",
        "algorithm.discard_zero_variance=false",
        "checkpointing.interval_steps=1",
        "rollout_recovery.target_level=prefix",
        "rollout_checkpointing.interval_s=0.1",
        "trace.enabled=true",
        "logging.progress=false",
        "logging.plot=false",
        f"trainer.factory={REPO / 'tests' / 'recording_trainer.py'}:make_trainer",
        f"trainer.options={{record: {record}}}",
    ]


def _train(run_dir: Path, record: Path, mode: str, resume: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rolloutdb", "train", "--config", str(EXAMPLE), "--run-dir", str(run_dir)]
    return subprocess.Popen(cmd + (["--resume"] if resume else []) + _config(record, mode), env=train_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kept_by_hand(snapshot_db: Path) -> int:
    """What a resume from this snapshot keeps, decoded here with SQL and numpy: the policy
    tokens of the running attempts' saved episodes and their calls' prefixes."""
    uri = f"file:{snapshot_db}?mode=ro&immutable=1"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        transcripts = saved_transcripts(conn)
        running = conn.execute("SELECT e.attempt_id FROM env_episodes e JOIN rollouts r "
                               "ON r.attempt_id = e.attempt_id WHERE r.state = 'running' AND e.transcript_tokens IS NOT NULL")
        turns = sum(n for (a,) in running for v, n in json.loads(transcripts[a].version_token_counts) if v != -1)
        chunks = conn.execute("SELECT c.token_ids FROM token_chunks c JOIN rollouts r ON r.attempt_id = c.attempt_id "
                              "WHERE r.state = 'running'").fetchall()
    return turns + sum(len(np.frombuffer(blob, "<i4")) for (blob,) in chunks)


def _prefix_tokens_by_hand(snapshot_db: Path) -> int:
    uri = f"file:{snapshot_db}?mode=ro&immutable=1"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        chunks = conn.execute("SELECT c.token_ids FROM token_chunks c JOIN rollouts r ON r.attempt_id = c.attempt_id "
                              "WHERE r.state = 'running'").fetchall()
    return sum(len(np.frombuffer(blob, "<i4")) for (blob,) in chunks)


def _prefixed_calls(snapshot_db: Path) -> int:
    """Running attempts whose calls the snapshot holds a prefix of, with one logprob per token."""
    uri = f"file:{snapshot_db}?mode=ro&immutable=1"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        return conn.execute(
            "SELECT count(DISTINCT c.attempt_id) FROM token_chunks c JOIN rollouts r ON r.attempt_id = c.attempt_id "
            "WHERE r.state = 'running' AND length(c.logprobs) = length(c.token_ids)").fetchone()[0]


def _kill_with_prefixes_saved(run_dir: Path, proc: subprocess.Popen, keep: Path, after: int) -> tuple[int, int] | None:
    """SIGKILL the run once the snapshot a resume would restore is newer than snapshot
    `after` (a resumed run's own, not the one it restored) and holds prefixes of running
    calls (a copy of its store kept); how many calls and the snapshot's number, or None
    if the run ended first."""
    def look() -> tuple[int, int] | None:
        newest = newest_usable_snapshot(run_dir / "checkpoints")
        if newest is None or newest[0] <= after:
            return None
        # The copy holds the chunks' bytes: retention may remove their segments later.
        n = _prefixed_calls(inline_copy(Path(newest[1]) / "rollout_state.sqlite", keep))
        return (n, newest[0]) if n else None

    return kill_when(proc, look, timeout=TIMEOUT_S)


def _trained(record: Path) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for line in record.read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["prompt_id"], set()).add(json.dumps([row["tokens"], row["logprobs"]]))
    return out


def killed_twin_runs(root: Path, mode: str) -> dict:
    """The killed run (KILLS kills, each once the snapshot holds prefixes) and its twin of
    one configuration, both to the end, with what the tests read from them. Seeded runs
    once per session (conftest.py `seeded_prefix_run`): tests/test_shared_prefix_packing.py
    reads its packed batches too."""
    twin_dir, run_dir = root / "twin", root / "run"
    twin = _train(twin_dir, root / "twin.jsonl", mode)
    proc = _train(run_dir, root / "run.jsonl", mode)
    kills: list[int] = []
    restored = -1
    for k in range(KILLS):
        killed = _kill_with_prefixes_saved(run_dir, proc, root / f"cut{k}.sqlite", after=restored)
        if killed is None:
            break
        n, restored = killed
        kills.append(n)
        proc = _train(run_dir, root / "run.jsonl", mode, resume=True)
    _, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err[-2000:]
    _, err = twin.communicate(timeout=TIMEOUT_S)
    assert twin.returncode == 0, err[-2000:]
    assert kills, "the run ended before any snapshot held a prefix of a running call"
    verify = subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    report = subprocess.run([sys.executable, "-m", "rolloutdb", "trace", str(run_dir), "--baseline", str(twin_dir),
                             "--out", str(root / "report")], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert report.returncode == 0, report.stderr
    return {"mode": mode, "root": root, "run_dir": run_dir, "twin_dir": twin_dir, "kills": kills, "verify": verify,
            "cut": root / f"cut{len(kills) - 1}.sqlite",
            "report": json.loads((root / "report" / "trace_report.json").read_text()),
            "kept_by_hand": _kept_by_hand(root / "cut0.sqlite"),
            "prefix_tokens_by_hand": _prefix_tokens_by_hand(root / "cut0.sqlite"),
            "run": _trained(root / "run.jsonl"), "twin": _trained(root / "twin.jsonl"),
            "replies": _replies(root / "twin.jsonl")}


# Seeded sampling in the default tier (the case RL runs); greedy with -m slow (~1 min; the
# vLLM tier's prefix-level run is greedy).
@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.slow) if k == "greedy" else k
                                        for k in SAMPLING])
def job(request, tmp_path_factory):
    if request.param == "seeded":
        return request.getfixturevalue("seeded_prefix_run")
    return killed_twin_runs(tmp_path_factory.mktemp(f"prefix_run_{request.param}"), request.param)


def _replies(record: Path) -> list[dict]:
    """Every policy reply the twin trained: its group's prompt, generation index, turn and
    tokens. A reply is a run of tokens with a logprob (the environment's tokens carry 0.0
    exactly, episodes.Episode.absorb)."""
    out = []
    for line in record.read_text().splitlines():
        row = json.loads(line)
        for index, (tokens, logprobs) in enumerate(zip(row["tokens"], row["logprobs"])):
            turn, current = 0, []
            for t, lp in [*zip(tokens, logprobs), (None, 0.0)]:
                if lp != 0.0:
                    current.append(t)
                elif current:
                    out.append({"prompt_id": row["prompt_id"], "prompt_ids": row["prompt_ids"], "index": index,
                                "turn": turn, "tokens": current})
                    turn, current = turn + 1, []
    return out


def test_every_group_the_killed_run_trained_has_exactly_its_twins_tokens_and_logprobs(job):
    assert job["run"].keys() == job["twin"].keys()
    differ = [p for p in job["run"] if job["run"][p] != job["twin"][p]]
    assert not differ, f"prompts whose generations differ from the twin's: {differ[:5]}"


def test_the_last_resume_continued_every_call_the_restored_snapshot_held_a_prefix_of(job):
    # The metrics log rolls back with each restore to its anchor: an earlier resume's line
    # survives only when the later snapshot's anchor is past it, so the lines are the last
    # resumes' (at least the last one); the twin test above covers every resume.
    restores = metrics(job["run_dir"], "prefix_restore")
    assert 1 <= len(restores) <= len(job["kills"])
    assert [r["calls"] for r in restores] == job["kills"][-len(restores):]
    assert all(r["tokens"] >= r["calls"] for r in restores)


def test_the_trace_marks_every_continued_call_bitwise_on_the_reference_engine_and_no_call_of_the_twin(job):
    # The reference engine's seeded draws are a function of (seed, position): a continued
    # call is the uninterrupted one (the twin test above), and its call_finished says so.
    def kinds(run_dir: Path) -> list:
        with contextlib.closing(sqlite3.connect(run_dir / "logs" / "rollout_trace.sqlite")) as conn:
            return [k for (k,) in conn.execute("SELECT prefix_exactness FROM call_finished "
                                               "WHERE prefix_exactness IS NOT NULL")]
    continued = kinds(job["run_dir"])
    assert continued and set(continued) == {"bitwise"}, continued
    assert kinds(job["twin_dir"]) == []


def test_a_prefix_level_run_killed_twice_loses_and_doubles_nothing(job):
    assert job["verify"].returncode == 0, job["verify"].stderr
    report = json.loads(job["verify"].stdout)
    assert report["duplicated"] == 0 and report["lost"] == 0, report


def test_the_trace_counts_the_first_stops_kept_prefixes_and_turns_as_its_snapshot_holds_them(job):
    # Only what the resumed run recorded: the stopped run's last events before its SIGKILL
    # may never reach the trace file (its writer batches), so its decoded counts are a
    # lower bound, and redone (decoded - kept) is not compared here.
    first = job["report"]["kept_per_stop"][0]
    assert first["kept_tokens"] == job["kept_by_hand"] > 0
    assert first["decoded_by_cut"] >= job["prefix_tokens_by_hand"]


def test_every_token_a_restored_cut_had_decoded_was_kept_or_has_a_traced_reason(job):
    # The stopped run's events up to the cut's decode point are in the trace before its
    # snapshot is published (snapshot_pump.py `_trace_cut`), so this is exact, not a bound.
    stops = job["report"]["kept_per_stop"]
    assert len(stops) == len(job["kills"])
    assert [s["unexplained_tokens"] for s in stops] == [0] * len(stops), stops
    # Nor more kept than decoded by the cut (a token counted kept but not decoded by it is
    # an accounting hole that would hide an unexplained one).
    assert all(s["kept_tokens"] <= s["decoded_by_cut"] for s in stops), stops
    assert sum(s["decoded_by_cut"] for s in stops) > 0


def test_an_attempt_whose_call_the_cut_froze_threw_no_time_away(job):
    rows = job["report"]["kept_by_attempt"]
    frozen = [r for r in rows if r["stop_no"] == 1 and r["decoded_tokens"] > 0 and r["kept_tokens"] > 0]
    assert frozen
    assert any(r["thrown_away_s"] == 0 for r in frozen)


def _tokenizer(job):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(job["twin_dir"] / "policy")


def test_the_twins_settings_acted_some_replies_ended_on_a_stop_string_and_min_tokens_held_stops_back(job):
    tok = _tokenizer(job)
    replies = [r["tokens"] for r in job["replies"]]
    assert replies
    ends = [tok.decode(r, skip_special_tokens=True) for r in replies]
    on_stop = [r for r, text in zip(replies, ends) if r[-1] != tok.eos_token_id and text.endswith(tuple(STOPS))]
    assert len(on_stop) >= 10, f"{len(on_stop)} of {len(replies)} replies ended on a stop string"
    assert all(len(r) > MIN_TOKENS for r in replies if len(r) < MAX_TOKENS)  # nothing ended inside min_tokens
    held = [r for r in replies
            if any(tok.decode(r[:n], skip_special_tokens=True).endswith(tuple(STOPS)) for n in range(1, MIN_TOKENS + 1))]
    assert held, "no stop string came within min_tokens, where it must not end a reply"


def test_the_twins_penalties_changed_what_was_decoded(job):
    """First replies decoded again on the run's own policy: with the penalties they are the
    twin's, without them some differ. Seeds as controller/rollout/episodes.py derives them
    (epoch 0: these runs use fewer prompts than the dataset holds)."""
    from rolloutdb.controller.rollout.episodes import call_seed
    from rolloutdb.gpu_capture import GenerationRequest, ReferenceEngine, SamplingParams

    firsts = [r for r in job["replies"] if r["turn"] == 0][:64]
    params = dict(max_tokens=MAX_TOKENS, min_tokens=MIN_TOKENS, stop=tuple(STOPS),
                  temperature=0.0 if job["mode"] == "greedy" else 1.0)

    def decode(**penalties):
        requests = [GenerationRequest(f"r{i}", r["prompt_ids"], SamplingParams(
            seed=call_seed(call_seed(5, 0, r["prompt_id"], r["index"]), 0), **params, **penalties))
            for i, r in enumerate(firsts)]
        return [out.token_ids for out in engine.generate(requests)]

    with ReferenceEngine(job["twin_dir"] / "policy", max_batch_size=64, num_threads=1) as engine:
        assert decode(**PENALTIES) == [r["tokens"] for r in firsts]
        plain = decode()
    assert sum(a != r["tokens"] for a, r in zip(plain, firsts)) >= 5
