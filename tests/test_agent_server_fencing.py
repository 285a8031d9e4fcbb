"""Side effects fenced (controller/agent_server/fencing.py), over HTTP against a real agent
server process running a toy tool with an effect outside the episode
(tests/effect_tools.py) and a real policy endpoint over a real engine behind a gate.

The rules checked: a stale attempt's `POST /episodes` gets 409 naming the rule; a running
older attempt stops before its next turn (its tool not run) once a newer attempt of its
episode registered; a turn played again after the server was SIGKILLed and the episode
resumed from its export carries the idempotency key of its first play, so a tool that
deduplicates by it acts once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import pytest

from agent_server_world import (TOKEN, HeldEngine, checkpoint, ok, refusal, request)
from rolloutdb.config import load_config
from rolloutdb.controller.agent_server.http_loop import HttpLoop
from rolloutdb.controller.agent_server.policy_endpoint import PolicyEndpoint
from rolloutdb.controller.agent_server.process import ServerProcess
from rolloutdb.controller.job import build
from rolloutdb.gpu_capture.reference_engine import ReferenceEngine

TOOL = f"{Path(__file__).with_name('effect_tools.py')}:record_effect"
CONFIG = """
run: {seed: 0}
generation: {max_tokens: 4}
environment:
  task: digits
  kind: copy
  n_digits: 2
  turns: 3
  dataset_size: 8
  servers:
    - {name: agents, mode: export_restore}
rollout_recovery: {target_level: turn}
"""


class Fenced:
    def __init__(self, root: Path):
        self.root = root
        self.plays, self.effects = root / "plays.txt", root / "effects.txt"
        self.owners: dict[str, str] = {}

    def start(self, key: str, **extra) -> tuple[int, str]:
        self.owners[key] = key
        return request(self.url, "POST", "/episodes", {"key": key, "prompt_id": 1, "seed": 5, "policy": {
            "url": self.policy_url, "max_tokens": 4}, **extra})

    def result(self, key: str) -> dict:
        return ok(self.url, "GET", f"/episodes/{key}?wait_s=30")

    def played(self, episode: str) -> list[tuple[str, int]]:
        lines = self.plays.read_text().split("\n") if self.plays.exists() else []
        return [(k, int(a)) for k, a in (line.split() for line in lines if line) if k.startswith(episode + "/")]


@pytest.fixture(scope="module")
def fenced(tmp_path_factory):
    root = tmp_path_factory.mktemp("fenced")
    cfg = root / "run.yaml"
    cfg.write_text(CONFIG)
    policy = build.build_policy(load_config(cfg), root / "policy")
    f = Fenced(root)
    saved = {k: os.environ.get(k) for k in ("ROLLOUTDB_TEST_PLAYS", "ROLLOUTDB_TEST_EFFECTS")}
    os.environ.update(ROLLOUTDB_TEST_PLAYS=str(f.plays), ROLLOUTDB_TEST_EFFECTS=str(f.effects))
    with contextlib.ExitStack() as stack:
        for k, v in saved.items():
            stack.callback(lambda k=k, v=v: os.environ.pop(k, None) if v is None else os.environ.update({k: v}))
        f.proc = ServerProcess(config_path=cfg, name="agents", policy_dir=policy, log_path=root / "agents.log",
                               start_timeout_s=600, token=TOKEN, tool=TOOL)
        stack.callback(f.proc.stop)
        f.url = f.proc.start()
        real = ReferenceEngine(policy, max_batch_size=16, num_threads=1)
        stack.callback(real.close)
        loop = HttpLoop()
        stack.callback(loop.close)
        f.engine = HeldEngine(real)
        stack.callback(f.engine.release)
        f.endpoint = PolicyEndpoint(f.engine, loop, owner=f.owners.get, tokens=[TOKEN])
        f.policy_url = f.endpoint.start()
        stack.callback(f.endpoint.close)
        yield f


def test_the_server_says_it_implements_fencing(fenced):
    assert ok(fenced.url, "GET", "/health")["fencing"] is True


def test_a_stale_attempt_s_post_episodes_is_refused_with_409_naming_the_rule(fenced):
    assert fenced.start("50.0-a1")[0] == 201
    status, text = fenced.start("50.0-a0")
    assert status == 409, text
    assert refusal(status, text).startswith("stale attempt 0 of episode 50.0: attempt 1 has been seen;")
    assert fenced.result("50.0-a1")["status"] == "finished"


def test_episode_and_attempt_that_contradict_the_key_are_refused(fenced):
    status, text = fenced.start("53.0-a2", episode="53.0", attempt=1)
    assert "contradict key" in refusal(status, text)


def test_a_running_older_attempt_stops_before_its_next_turn_once_a_newer_one_registered(fenced):
    fenced.engine.hold = lambda rid: rid == "51.0-a0-t1"
    assert fenced.start("51.0-a0", episode="51.0", attempt=0)[0] == 201
    fenced.engine.wait_held(1)
    assert fenced.start("51.0-a1", episode="51.0", attempt=1)[0] == 201
    fenced.engine.release()
    old = fenced.result("51.0-a0")
    assert old["status"] == "failed" and old["error"].startswith("stale attempt 0 of episode 51.0"), old
    assert fenced.result("51.0-a1")["status"] == "finished"
    # the old attempt's tool ran for its first turn only: the held turn's reply came after the fence
    assert [k for k, a in fenced.played("51.0") if a == 0] == ["51.0/t0"]
    assert sorted(k for k, a in fenced.played("51.0") if a == 1) == ["51.0/t0", "51.0/t1", "51.0/t2"]


def test_a_turn_replayed_after_a_kill_and_resume_carries_its_first_play_s_key_and_acts_once(fenced):
    fenced.engine.hold = lambda rid: rid == "52.0-a0-t1"
    assert fenced.start("52.0-a0")[0] == 201
    fenced.engine.wait_held(1)
    ok(fenced.url, "POST", "/checkpoint/prepare", {"checkpoint_id": "c52", "lease_s": 60})
    ok(fenced.url, "POST", "/checkpoint/commit", {"checkpoint_id": "c52"})
    ok(fenced.url, "POST", "/checkpoint/drain", {"checkpoint_id": "c52"})
    status, text = request(fenced.url, "GET", "/checkpoint/export?checkpoint_id=c52")
    exported = json.loads(text)["episodes"]
    assert status == 200 and exported["52.0-a0"]["turn"] == 1
    ok(fenced.url, "POST", "/checkpoint/resume", {"checkpoint_id": "c52"})
    fenced.engine.release()  # the first play goes on past the cut: turns 1 and 2 act
    assert fenced.result("52.0-a0")["status"] == "finished"
    os.kill(fenced.proc.pid, signal.SIGKILL)  # the stop: the server dies with everything it held
    fenced.proc.proc.wait(30)
    fenced.url = fenced.proc.start()
    ok(fenced.url, "POST", "/agents/install", {"episodes": exported}, status=201)
    assert fenced.start("52.0-a1", continue_from="52.0-a0")[0] == 201
    assert fenced.result("52.0-a1")["status"] == "finished"
    first = [k for k, a in fenced.played("52.0") if a == 0]
    replayed = [k for k, a in fenced.played("52.0") if a == 1]
    assert first == ["52.0/t0", "52.0/t1", "52.0/t2"] and replayed == ["52.0/t1", "52.0/t2"]
    effects = [k for k in fenced.effects.read_text().split() if k.startswith("52.0/")]
    assert effects == ["52.0/t0", "52.0/t1", "52.0/t2"]  # each turn's effect once
