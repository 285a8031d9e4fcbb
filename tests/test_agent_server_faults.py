"""Agent-server faults with real processes: `python -m rolloutdb train` subprocesses, real
agent server processes (`rolloutdb.controller.agent_server.env_server`), SIGKILL.

1. The `agents` server killed alone mid-rollout: its attempts are abandoned with reason
   `error`, the controller restarts it, nothing is lost or doubled.
2. The controller SIGKILLed at every kill point of the environment phase of a snapshot,
   against a server the test started at a URL: the server reopens dispatch by itself when
   its lease expires, the snapshot that died is never published, the next run resumes.
3. The controller and its servers SIGKILLed together: the resumed run continues the
   `agents` server's episodes from the turn the snapshot exported (the prefix-level run of
   tests/test_agent_server_prefix.py, made once per session and read by both).
4. An export that disagrees with the ledger at the cut refuses the snapshot, recorded.
5. A resume into another checkpoint mode is refused before anything changes on disk.

What the runs must have done is read from the files through separate connections
(plain sqlite3 on the ledger, the snapshot copies and the trace; the manifests with
`crash_harness.newest_usable_snapshot`), never from the controller's own objects. Which
server a prompt meets is the protocol's rule (prompt id modulo the number of servers,
`AgentPool.server_for`), restated here: with the example's two servers, even prompts go
to `agents` (export_restore), odd ones to `restarts` (restart_only).

Runtime: ~3 min on 2 cores, most of it process start-up (a controller process starts in
~5 s, an agent server in ~6 s: both import torch and build the task); the runs themselves
train 4-8 small steps in 1-2 s. Section 3's run is shared with
tests/test_agent_server_prefix.py (one run instead of two, since 2026-12-01).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from crash_harness import SERVER_MODULE, metrics, newest_usable_snapshot, read_sql, server_pids, train_env
from rolloutdb.controller.fault_points import ENV_POINTS

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "agent_server.yaml"
TIMEOUT_S = 240
LEASE_S = 3.0  # short, so a test waits little for the lease; long enough to see dispatch closed first
OVERRIDES = [
    "algorithm.groups_per_step=2",
    "checkpointing.interval_steps=1",
    "rollout_checkpointing.interval_s=0.3",
    "trace.enabled=true",
    "logging.progress=false",
    "logging.plot=false",
]
TRACE = Path("logs") / "rollout_trace.sqlite"
URL_SERVER_TOKEN = "url-server-token-0123456789"  # the token the server at a URL is started with


# ---------------------------------------------------------------------- helpers


def _config(path: Path, servers: list[dict]) -> Path:
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["environment"]["servers"] = servers
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _train(config: Path, run_dir: Path, steps: int, *, resume: bool = False, fault: str | None = None,
           extra: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rolloutdb", "train", "--config", str(config), "--run-dir", str(run_dir)]
    cmd += (["--resume", "latest"] if resume else []) + OVERRIDES + [f"algorithm.total_steps={steps}", *extra]
    return subprocess.Popen(cmd, env=train_env(fault), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _ended(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"a run did not end within {TIMEOUT_S} s: {err[-1500:]}")
    return proc.returncode, err


def _verify(run_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(run_dir), "--json"], env=train_env(),
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def _health(url: str) -> dict:
    asked = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {URL_SERVER_TOKEN}"})
    with urllib.request.urlopen(asked, timeout=10) as resp:
        return json.load(resp)


def _wait_for(what: str, check, timeout: float = TIMEOUT_S, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}: {proc.stderr.read()[-1500:]}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def _snapshot_dirs(run_dir: Path) -> dict[int, Path]:
    """Every published snapshot directory on disk, by sequence (dot-named staging leftovers
    never match the name)."""
    out = {}
    for path in (run_dir / "checkpoints").glob("*/rollout_snapshots/*"):
        m = re.fullmatch(r"snapshot_(\d+)", path.name)
        if m:
            out[int(m.group(1))] = path
    return out


def _restore_lines(run_dir: Path) -> list[dict]:
    return [e for e in metrics(run_dir) if e.get("kind") == "restore"]


def _last_trace_run(run_dir: Path) -> int:
    return read_sql(run_dir / TRACE, "SELECT max(run) FROM runs")[0][0]


# ---------------------------------------------------------------------- 1. the server killed alone


@pytest.fixture(scope="module")
def server_killed(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_killed")
    config = _config(root / "run.yaml", [{"name": "agents", "mode": "export_restore"},
                                         {"name": "restarts", "mode": "restart_only"}])
    run_dir = root / "run"
    proc = _train(config, run_dir, steps=6)
    store = run_dir / "rollout_state.sqlite"

    def agents_running() -> bool:  # attempts the ledger runs on `agents` (even prompts)
        if not store.exists():
            return False
        with contextlib.suppress(sqlite3.Error):
            return read_sql(store, "SELECT count(*) FROM rollouts r JOIN prompt_groups g USING (group_id) "
                                   "WHERE r.state = 'running' AND g.prompt_id % 2 = 0")[0][0] >= 4
        return False

    _wait_for("attempts running on the agents server", agents_running, proc=proc)
    pids = server_pids(proc.pid)
    assert set(pids) == {"agents", "restarts"}, pids
    os.kill(pids["agents"], signal.SIGKILL)
    rc, err = _ended(proc)
    assert rc == 0, err[-2000:]
    return {"run_dir": run_dir}


def test_a_killed_server_s_attempts_are_abandoned_with_reason_error_and_retried(server_killed):
    # Read from the trace: settled groups' attempt rows have left the live store.
    run_dir = server_killed["run_dir"]
    abandoned = read_sql(run_dir / TRACE, "SELECT group_id, generation_index, attempt, reason, prompt_id FROM attempt_abandoned")
    lost = {(g, i, a) for g, i, a, _r, _p in abandoned}
    assert lost, "no attempt was abandoned: the kill hit no running episode"
    assert {reason for *_, reason, _p in abandoned} == {"error"}
    assert {p % 2 for *_, p in abandoned} == {0}  # only the killed server's
    finished = {(g, i): a for g, i, a in read_sql(run_dir / TRACE, "SELECT group_id, generation_index, max(attempt) "
                                                                "FROM rollout_finished GROUP BY group_id, generation_index")}
    # Every lost generation was generated again by a later attempt, which finished.
    assert all(finished.get((g, i), -1) > a for g, i, a in lost), sorted(lost)
    # The trace names every attempt the ledger started, retried ones included, by the
    # number the ledger gave it (the key the server ran it under): the attempts still in
    # the live store among them.
    dispatched = set(read_sql(run_dir / TRACE, "SELECT group_id, generation_index, attempt FROM attempt_dispatched"))
    live = read_sql(run_dir / "rollout_state.sqlite", "SELECT group_id, generation_index, attempt, state FROM rollouts")
    assert lost | {(g, i, a) for g, i, a, _s in live} <= dispatched
    assert {(g, i, a) for g, i, a, state in live if state == "abandoned"} <= lost


def test_the_controller_restarted_the_killed_server_once_and_left_the_other_alone(server_killed):
    restarts = [e for e in metrics(server_killed["run_dir"]) if e.get("kind") == "agent_server_restart"]
    assert [(e["server"], e["restarts"]) for e in restarts] == [("agents", 1)]
    log = (server_killed["run_dir"] / "logs" / "agent_server_restarts.log").read_text()
    assert "Traceback" not in log


def test_a_run_whose_server_was_killed_lost_and_duplicated_nothing(server_killed):
    figures = _verify(server_killed["run_dir"])
    assert figures["ok"] and figures["duplicated"] == 0 and figures["lost"] == 0, figures
    assert figures["trained"] == 6 * 2


# ---------------------------------------------------------------------- 2. the controller killed in the env phase


@pytest.fixture(scope="module")
def url_server(tmp_path_factory):
    """One agent server the test owns, at a URL every run of the module's env-phase
    chains names (a server that outlives its controllers)."""
    from rolloutdb.config import config_from_dict
    from rolloutdb.controller.job import build

    root = tmp_path_factory.mktemp("url_server")
    token_file = root / "token"
    token_file.write_text(URL_SERVER_TOKEN + "\n")
    token_file.chmod(0o600)
    spec = {"name": "agents", "mode": "export_restore", "url": "http://127.0.0.1:1", "lease_s": LEASE_S,
            "token_file": str(token_file)}
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["environment"]["servers"] = [spec]
    policy = build.build_policy(config_from_dict(cfg), root / "policy")  # the tokenizer the task needs
    server_cfg = _config(root / "server.yaml", [spec])
    proc = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, "--config", str(server_cfg), "--server", "agents",
                             "--policy-dir", str(policy), "--port", "0", "--token-file", str(token_file)],
                            env=train_env(), stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("rolloutdb-agent-server listening on "), line
        url = line.split()[-1]
        yield {"url": url, "config": _config(root / "run.yaml", [{**spec, "url": url}])}
    finally:
        proc.terminate()
        proc.wait(30)


# One point in the default tier (~30 s each); all four with -m slow (CI time, 2026-12-02).
@pytest.mark.parametrize("point", [pytest.param(p, marks=() if p == "env.after_export" else pytest.mark.slow)
                                   for p in ENV_POINTS])
def test_a_controller_killed_in_the_environment_phase_leaves_a_server_that_reopens_and_a_run_that_resumes(
        point, url_server, tmp_path):
    url, config, run_dir = url_server["url"], url_server["config"], tmp_path / "run"
    before = _health(url)
    assert before["dispatch"] == "open"
    rc, err = _ended(_train(config, run_dir, steps=4, fault=f"{point}@3"))
    assert rc == -signal.SIGKILL, err[-2000:]

    # The server was left inside the checkpoint, and reopens by itself once the lease ends.
    t_killed = time.monotonic()
    held = _health(url)
    assert held["dispatch"] == "closed" and held["checkpoint_id"], held
    reopened = _wait_for("the lease to reopen dispatch", lambda: (h := _health(url))["dispatch"] == "open" and h,
                         timeout=LEASE_S + 10)
    assert time.monotonic() - t_killed < LEASE_S + 10
    assert reopened["checkpoint_id"] is None
    assert reopened["lease_expirations"] >= before["lease_expirations"] + 1

    # The attempt that died was never published: on disk, no snapshot newer than the last
    # one the ledger recorded as published, and that one is what a resume must restore.
    published = [s for (s,) in read_sql(run_dir / "rollout_state.sqlite",
                                        "SELECT snapshot_seq FROM snapshot_attempts WHERE outcome = 'published'")]
    assert published and max(_snapshot_dirs(run_dir)) == max(published)
    newest = newest_usable_snapshot(run_dir / "checkpoints")
    assert newest is not None and newest[0] == max(published)

    rc, err = _ended(_train(config, run_dir, steps=4, resume=True))
    assert rc == 0, err[-2000:]
    (restore,) = _restore_lines(run_dir)
    assert restore["snapshot_seq"] == max(published) and restore["snapshot"] == newest[1]
    figures = _verify(run_dir)
    assert figures["ok"] and figures["duplicated"] == 0 and figures["lost"] == 0, figures
    assert _health(url)["dispatch"] == "open"
    refused = read_sql(run_dir / "rollout_state.sqlite", "SELECT error FROM snapshot_attempts WHERE outcome = 'failed'")
    assert refused == [], refused  # the server follows the protocol: no export disagreed


# ---------------------------------------------------------------------- 3. controller and servers killed together


# The run is tests/test_agent_server_prefix.py's real run, made once per session (conftest.py
# `agent_servers_killed`): examples/agent_server.yaml (these two servers) at prefix level, 8
# steps of four groups, a snapshot every 0.1 s, SIGKILLed with its servers while the snapshot
# a resume restores holds an exported agent past its first turn (and agents prefixes and
# restarts fallbacks, which that module checks), then resumed. Prefix level saves the
# exported agents exactly as turn level does, and a call's prefix besides; turn level with
# agent servers is killed and resumed in section 2.
STEPS_3, BUSY = 8, ("algorithm.groups_per_step=4", "rollout_checkpointing.interval_s=0.1",
                    "rollout_recovery.target_level=prefix")


@pytest.fixture(scope="module")
def all_killed(agent_servers_killed):
    killed = agent_servers_killed
    assert set(killed["servers"]) == {"agents", "restarts"}
    return killed


def test_only_the_export_restore_server_s_agents_are_in_the_snapshot(all_killed):
    assert {prompt % 2 for _t, _n, prompt in all_killed["saved"].values()} == {0}


def test_the_exporting_server_s_agents_continued_from_their_exported_turn(all_killed):
    run_dir = all_killed["run_dir"]
    resumed = _last_trace_run(run_dir)
    (restore,) = _restore_lines(run_dir)
    assert restore["snapshot"] == all_killed["snapshot"]
    events = read_sql(run_dir / TRACE, "SELECT group_id, generation_index, from_attempt, turn, tokens, attempt, prompt_id "
                                       "FROM episode_restored WHERE run = ?", (resumed,))
    restored = {(g, i, a): (turn, tokens, prompt) for g, i, a, turn, tokens, _new, prompt in events}
    assert restored == all_killed["saved"]
    assert any(turn > 0 for turn, _, _ in restored.values())
    calls = read_sql(run_dir / TRACE, "SELECT group_id, generation_index, attempt, turn FROM call_finished WHERE run = ?",
                     (resumed,))
    for g, i, _from, turn, _tokens, new, _prompt in events:
        turns = sorted(t for gg, ii, aa, t in calls if (gg, ii, aa) == (g, i, new))
        # The server's first model call for the new attempt is the exported turn: no
        # earlier turn was generated again (a server that restarted the agent starts at 0).
        assert turns and turns[0] == turn, ((g, i), turn, turns)


def test_the_trace_report_shows_the_turns_the_stop_kept(all_killed):
    (stop,) = all_killed["report"]["kept_per_stop"]
    saved = all_killed["saved"].values()
    assert stop["turns_kept"] == sum(turn for turn, _, _ in saved) > 0
    # Kept: the exported agents' committed policy tokens and, at prefix level, the saved
    # prefixes of their running calls (both decoded here from the snapshot's copy).
    prefix_tokens = sum(len(p["tokens"]) for p in all_killed["prefixes"].values())
    assert stop["kept_tokens"] == sum(tokens for _, tokens, _ in saved) + prefix_tokens


def test_no_snapshot_of_a_run_whose_servers_follow_the_protocol_is_refused(all_killed):
    refused = read_sql(all_killed["run_dir"] / "rollout_state.sqlite",
                       "SELECT error FROM snapshot_attempts WHERE outcome = 'failed'")
    assert refused == [], refused


def test_a_run_killed_with_its_servers_lost_and_duplicated_nothing(all_killed):
    figures = _verify(all_killed["run_dir"])
    assert figures["ok"] and figures["duplicated"] == 0 and figures["lost"] == 0, figures
    assert figures["trained"] == STEPS_3 * 4


# ---------------------------------------------------------------------- 4. an export the ledger disagrees with

UNKNOWN_KEY = "999999.0-a0"  # a well-formed episode key of a group the ledger never had


@pytest.fixture(scope="module")
def tampered(tmp_path_factory):
    """A real controller run in-process with a real `agents` server process, whose
    environment checkpoint is `HttpEnvironmentCheckpoint` with one change: `export()`
    adds an agent the ledger does not know once, then drops an acknowledged, unfinished
    agent from each export until the ledger has recorded one such snapshot refused (at
    most MAX_DROPS times). A drop need not be refused: its attempt may end
    `aborted_commit` (a train step began before the cut) or the agent may finish between
    the export and the cut; on a busy machine three drops in a row went that way, so the
    tamper reads the outcome (a second, read-only connection) instead of assuming it.
    A server that follows the protocol never does either, and
    making a real one lose an agent at exactly the cut would take a bug planted in it;
    this subclass changes only what the export returns, so the server, the ledger check
    at the cut, the snapshot pump and the store all run as they do in production. The
    run is in-process only so that the subclass can be put in place (`build_env_checkpoint`)."""
    from rolloutdb.config import config_from_dict
    from rolloutdb.controller.job import build
    from rolloutdb.controller.agent_server.client import HttpEnvironmentCheckpoint
    from rolloutdb.controller.job.controller import Controller

    done: list[tuple[str, str]] = []  # (what, key), in the order the exports were changed
    run_dir = tmp_path_factory.mktemp("tampered") / "run"

    class TamperedExport(HttpEnvironmentCheckpoint):
        def export(self) -> dict[str, dict]:
            real = super().export()
            unfinished = sorted(k for k in self.expected_keys() & set(real) if not real[k]["state"]["done"])
            if not unfinished:
                return real
            if not done:
                real[UNKNOWN_KEY] = real[unfinished[0]]
                done.append(("unknown", UNKNOWN_KEY))
            elif len(done) <= MAX_DROPS and not _refused_for_missing(run_dir):
                del real[unfinished[0]]
                done.append(("missing", unfinished[0]))
            return real

    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["environment"]["servers"] = [{"name": "agents", "mode": "export_restore"}]
    cfg["algorithm"].update(total_steps=10, groups_per_step=4)
    cfg["checkpointing"]["interval_steps"] = 1
    cfg["rollout_checkpointing"]["interval_s"] = 0.05  # many exports while episodes run
    cfg["logging"] = {"progress": False, "plot": False}
    real_build = build.build_env_checkpoint
    build.build_env_checkpoint = lambda config, agents=None: TamperedExport(agents)
    try:
        Controller(config_from_dict(cfg), run_dir).run()
    finally:
        build.build_env_checkpoint = real_build
    return {"run_dir": run_dir, "done": done}


MAX_DROPS = 12  # a cap, so that a refusal never recorded fails the test instead of every snapshot


def _refused_for_missing(run_dir: Path) -> bool:
    """Whether the ledger has recorded a snapshot refused for a running attempt missing
    from the export (an attempt's row is written before the pump's next attempt exports)."""
    return bool(read_sql(run_dir / "rollout_state.sqlite", "SELECT 1 FROM snapshot_attempts "
                                                         "WHERE error LIKE '%running attempts missing%' LIMIT 1"))


def _failed_attempts(run_dir: Path) -> list[tuple]:
    return read_sql(run_dir / "rollout_state.sqlite", "SELECT snapshot_seq, error FROM snapshot_attempts "
                                                      "WHERE outcome = 'failed' ORDER BY attempt_seq")


def test_an_export_holding_an_episode_the_ledger_does_not_know_refuses_the_snapshot(tampered):
    assert tampered["done"][0] == ("unknown", UNKNOWN_KEY)
    refused = [(seq, e) for seq, e in _failed_attempts(tampered["run_dir"]) if "unknown or retired" in e]
    assert len(refused) == 1, _failed_attempts(tampered["run_dir"])
    seq, error = refused[0]
    assert f"1 unknown or retired episodes ({UNKNOWN_KEY})" in error and "ExportMismatch" in error
    assert "\n" not in error
    assert seq not in _snapshot_dirs(tampered["run_dir"])  # nothing published under its number


def test_an_export_missing_a_running_acknowledged_attempt_refuses_the_snapshot(tampered):
    dropped = [k for what, k in tampered["done"] if what == "missing"]
    assert dropped
    refused = [(seq, e) for seq, e in _failed_attempts(tampered["run_dir"]) if "running attempts missing" in e]
    # A dropped attempt that finished between the export and the cut is no mismatch (its
    # sample is in the cut); one still running is. The tamper drops until one is refused.
    assert refused, (dropped, _failed_attempts(tampered["run_dir"]))
    assert len(dropped) <= MAX_DROPS
    for seq, error in refused:
        named = re.search(r"1 running attempts missing \(([0-9.a-]+)\)", error)
        assert named and named[1] in dropped, error
        assert seq not in _snapshot_dirs(tampered["run_dir"])
    lines = [e for e in metrics(tampered["run_dir"]) if e.get("kind") == "snapshot" and e["outcome"] == "failed"]
    assert [e["error"] for e in lines] == [e for _, e in _failed_attempts(tampered["run_dir"])]


def test_refused_snapshots_leave_the_run_whole(tampered):
    published = read_sql(tampered["run_dir"] / "rollout_state.sqlite",
                      "SELECT snapshot_seq FROM snapshot_attempts WHERE outcome = 'published'")
    assert published  # the untampered attempts were published
    figures = _verify(tampered["run_dir"])
    assert figures["ok"] and figures["duplicated"] == 0 and figures["lost"] == 0, figures


# ---------------------------------------------------------------------- 5. a restore into another mode


def _files(root: Path) -> dict[str, tuple]:
    """Every file's size, content hash and modification time. The lock file's content is
    put back after a refusal (RunLock.undo), not its time: its time is left out."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_dir():
            out[rel] = ("dir",)
        else:
            st = path.stat()
            mtime = None if rel == "run.lock" else st.st_mtime_ns
            out[rel] = (st.st_size, mtime, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def test_a_resume_into_another_checkpoint_mode_is_refused_and_changes_nothing(all_killed, tmp_path):
    run_dir = all_killed["run_dir"]
    config = _config(tmp_path / "restart_only.yaml", [{"name": "agents", "mode": "restart_only"},
                                                      {"name": "restarts", "mode": "restart_only"}])
    before = _files(run_dir)
    rc, err = _ended(_train(config, run_dir, steps=STEPS_3, resume=True, extra=BUSY))
    assert rc != 0
    said = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and "Traceback" not in err, err
    assert re.search(r"agents: export_restore in the snapshot, restart_only now", said[0]), said
    assert "restarts:" not in said[0]  # the server whose mode did not change is not named
    assert _files(run_dir) == before

