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

import json
import os
import signal

import pytest

from agent_server_world import ok, refusal, request
from one_server_world import open_one_server

@pytest.fixture(scope="module")
def fenced(tmp_path_factory):
    with open_one_server(tmp_path_factory.mktemp("fenced")) as f:
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
