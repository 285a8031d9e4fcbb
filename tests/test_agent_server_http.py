"""The agent server protocol over real HTTP (docs/agent_server.md): a real agent server
process (`python -m rolloutdb.controller.agent_server.env_server`, port 0) and a real
policy endpoint over a real `ReferenceEngine` on the tiny policy, in this process
(tests/agent_server_world.py builds them: one module fixture, 10-40 s).

What is checked: every malformed request to either server gets a 4xx with a one-line
`{"error": ...}` and changes nothing; the checkpoint sequence (prepare, commit, drain,
export, resume), the lease, the modes, install + continue_from, retire, reset, the seeds
and the episode deadline behave as the doc says; 256 concurrent episodes finish on 2 cores.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import pytest

pytest.importorskip("aiohttp")

from agent_server_world import (  # noqa: E402
    PROMPTS,
    TOKEN,
    TURNS,
    checkpoint,
    health,
    ok,
    open_world,
    peek,
    policy,
    refusal,
    request,
    reset,
    result,
    start,
)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with open_world(tmp_path_factory.mktemp("agent_http")) as w:
        yield w


# ---------------------------------------------------------------------- malformed requests

BAD_EPISODE = {"key": "1.0-a0", "prompt_id": 0, "seed": 1, "policy": {"url": "http://127.0.0.1:9"}}
AGENT_CASES = [
    ("not JSON", "POST", "/episodes", None, b"{key: 1", {}),
    ("empty body", "POST", "/episodes", None, b"", {}),
    ("JSON array", "POST", "/episodes", [BAD_EPISODE], None, {}),
    ("deeply nested JSON", "POST", "/episodes", None, b"[" * 100_000 + b"]" * 100_000, {}),
    ("invalid UTF-8", "POST", "/episodes", None, b'{"key": "\xff\xfe"}', {}),
    ("missing key", "POST", "/episodes", {k: v for k, v in BAD_EPISODE.items() if k != "key"}, None, {}),
    ("key of the wrong type", "POST", "/episodes", {**BAD_EPISODE, "key": 12}, None, {}),
    ("key not an episode key", "POST", "/episodes", {**BAD_EPISODE, "key": "../etc"}, None, {}),
    ("prompt_id a boolean", "POST", "/episodes", {**BAD_EPISODE, "prompt_id": True}, None, {}),
    ("prompt_id a float", "POST", "/episodes", {**BAD_EPISODE, "prompt_id": 1.5}, None, {}),
    ("prompt_id negative", "POST", "/episodes", {**BAD_EPISODE, "prompt_id": -1}, None, {}),
    ("prompt_id past the dataset", "POST", "/episodes", {**BAD_EPISODE, "prompt_id": PROMPTS}, None, {}),
    ("seed NaN", "POST", "/episodes", None, json.dumps({**BAD_EPISODE, "seed": "X"}).replace('"X"', "NaN").encode(), {}),
    ("seed huge", "POST", "/episodes", {**BAD_EPISODE, "seed": 10**40}, None, {}),
    ("a number of 5000 digits", "POST", "/episodes", None,
     json.dumps({**BAD_EPISODE, "seed": 0}).replace(": 0", ": " + "9" * 5000, 1).encode(), {}),
    ("policy missing", "POST", "/episodes", {k: v for k, v in BAD_EPISODE.items() if k != "policy"}, None, {}),
    ("policy url not http", "POST", "/episodes", {**BAD_EPISODE, "policy": {"url": "file:///etc/passwd"}}, None, {}),
    ("policy n=2", "POST", "/episodes", {**BAD_EPISODE, "policy": {"url": "http://x", "n": 2}}, None, {}),
    ("policy max_tokens 0", "POST", "/episodes", {**BAD_EPISODE, "policy": {"url": "http://x", "max_tokens": 0}},
     None, {}),
    ("policy temperature a string", "POST", "/episodes",
     {**BAD_EPISODE, "policy": {"url": "http://x", "temperature": "hot"}}, None, {}),
    ("policy top_p infinite", "POST", "/episodes", None,
     json.dumps({**BAD_EPISODE, "policy": {"url": "http://x", "top_p": "X"}}).replace('"X"', "Infinity").encode(), {}),
    ("continue_from not a key", "POST", "/episodes", {**BAD_EPISODE, "continue_from": 3}, None, {}),
    ("continue_from never installed", "POST", "/episodes", {**BAD_EPISODE, "continue_from": "1.0-a9"}, None, {}),
    ("result of a bad key", "GET", "/episodes/nope", None, None, {}),
    ("result of an unknown episode", "GET", "/episodes/424242.0-a0", None, None, {}),
    ("forget an unknown episode", "DELETE", "/episodes/424242.0-a0", None, None, {}),
    ("retire keys not a list", "POST", "/checkpoint/retire", {"keys": "1.0-a0"}, None, {}),
    ("retire a bad key", "POST", "/checkpoint/retire", {"keys": ["1.0"]}, None, {}),
    ("prepare without checkpoint_id", "POST", "/checkpoint/prepare", {"lease_s": 5}, None, {}),
    ("prepare lease_s 0", "POST", "/checkpoint/prepare", {"checkpoint_id": "c", "lease_s": 0}, None, {}),
    ("prepare lease_s a boolean", "POST", "/checkpoint/prepare", {"checkpoint_id": "c", "lease_s": True}, None, {}),
    ("prepare lease_s 1e9", "POST", "/checkpoint/prepare", {"checkpoint_id": "c", "lease_s": 1e9}, None, {}),
    ("commit with no checkpoint in progress", "POST", "/checkpoint/commit", {"checkpoint_id": "c"}, None, {}),
    ("commit without checkpoint_id", "POST", "/checkpoint/commit", {}, None, {}),
    ("drain with no checkpoint in progress", "POST", "/checkpoint/drain", {"checkpoint_id": "c"}, None, {}),
    ("export with no checkpoint in progress", "GET", "/checkpoint/export?checkpoint_id=c", None, None, {}),
    ("export without checkpoint_id", "GET", "/checkpoint/export", None, None, {}),
    ("resume not JSON", "POST", "/checkpoint/resume", None, b"resume", {}),
    ("install episodes a list", "POST", "/agents/install", {"episodes": []}, None, {}),
    ("install a bad key", "POST", "/agents/install", {"episodes": {"x": {"turn": 1, "state": {}}}}, None, {}),
    ("install turn a boolean", "POST", "/agents/install", {"episodes": {"1.0-a0": {"turn": True, "state": {}}}},
     None, {}),
    ("install without state", "POST", "/agents/install", {"episodes": {"1.0-a0": {"turn": 1}}}, None, {}),
    ("install a transcript of unequal lengths", "POST", "/agents/install",
     {"episodes": {"1.0-a0": {"turn": 1, "state": {"env": {}}, "token_ids": [1, 2], "logprobs": [0.0],
                              "token_versions": [0, 0]}}}, None, {}),
    ("install part of a transcript", "POST", "/agents/install",
     {"episodes": {"1.0-a0": {"turn": 1, "state": {"env": {}}, "token_ids": [1]}}}, None, {}),
    ("install a state this server did not export", "POST", "/agents/install",
     {"episodes": {"1.0-a0": {"turn": 1, "state": {"mine": 1}}}}, None, {}),
    ("install a turn past the task's turns", "POST", "/agents/install",
     {"episodes": {"1.0-a0": {"turn": TURNS + 1, "state": {"env": {}}, "token_ids": [], "logprobs": [],
                              "token_versions": []}}}, None, {}),
    ("uninstall keys missing", "POST", "/agents/uninstall", {}, None, {}),
    ("reset an array", "POST", "/reset", [], None, {}),
    ("unknown path", "GET", "/v1/completions", None, None, {}),
    ("wrong method", "PUT", "/health", {}, None, {}),
    ("POST to a GET route", "POST", "/checkpoint/export", {}, None, {}),
]


@pytest.mark.parametrize("what,method,path,body,raw,headers", AGENT_CASES, ids=[c[0] for c in AGENT_CASES])
def test_a_malformed_request_to_the_agent_server_gets_a_4xx_with_one_line_and_changes_nothing(
        world, what, method, path, body, raw, headers):
    before = {k: v for k, v in health(world).items() if k != "lease_expirations"}
    status, text = request(world.servers["agents"], method, path, body, raw=raw, headers=headers)
    refusal(status, text)
    assert {k: v for k, v in health(world).items() if k != "lease_expirations"} == before


def test_a_wait_that_is_not_a_number_is_refused_and_the_episode_goes_on(world):
    reset(world)
    start(world, "70.0-a0")
    for wait in ("soon", "nan", "-1", "1e9"):
        refusal(*request(world.servers["agents"], "GET", f"/episodes/70.0-a0?wait_s={wait}"))
    assert result(world, "70.0-a0")["status"] == "finished"


OWNED = "999.0-a0"  # the episode the policy endpoint knows, for the cases past the ownership check
GOOD_CALL = {"prompt": [1, 2, 3], "max_tokens": 2}


def policy_cases(vocab_size: int, max_model_len: int) -> list[tuple]:
    h = {"X-Rolloutdb-Episode": OWNED, "X-Rolloutdb-Turn": "0"}
    return [
        ("missing episode header", "POST", "/v1/completions", GOOD_CALL, None, {}),
        ("episode header not a key", "POST", "/v1/completions", GOOD_CALL, None, {"X-Rolloutdb-Episode": "all"}),
        ("turn header not a number", "POST", "/v1/completions", GOOD_CALL, None, {**h, "X-Rolloutdb-Turn": "one"}),
        ("turn header negative", "POST", "/v1/completions", GOOD_CALL, None, {**h, "X-Rolloutdb-Turn": "-1"}),
        ("not JSON", "POST", "/v1/completions", None, b"prompt=1,2", h),
        ("deeply nested JSON", "POST", "/v1/completions", None, b"[" * 100_000 + b"]" * 100_000, h),
        ("JSON array", "POST", "/v1/completions", [GOOD_CALL], None, h),
        ("JSON string", "POST", "/v1/completions", "hello", None, h),
        ("missing prompt", "POST", "/v1/completions", {"max_tokens": 2}, None, h),
        ("text prompt", "POST", "/v1/completions", {"prompt": "123"}, None, h),
        ("empty prompt", "POST", "/v1/completions", {"prompt": []}, None, h),
        ("a batch of two prompts", "POST", "/v1/completions", {"prompt": [[1], [2]]}, None, h),
        ("prompt with a boolean", "POST", "/v1/completions", {"prompt": [1, True]}, None, h),
        ("prompt with a float", "POST", "/v1/completions", {"prompt": [1, 2.5]}, None, h),
        ("prompt with a huge id", "POST", "/v1/completions", {"prompt": [1, 2**40]}, None, h),
        ("prompt with a negative id", "POST", "/v1/completions", {"prompt": [-1]}, None, h),
        ("n=2", "POST", "/v1/completions", {**GOOD_CALL, "n": 2}, None, h),
        ("max_tokens a boolean", "POST", "/v1/completions", {**GOOD_CALL, "max_tokens": True}, None, h),
        ("max_tokens 1e308", "POST", "/v1/completions", {**GOOD_CALL, "max_tokens": 1e308}, None, h),
        ("max_tokens huge", "POST", "/v1/completions", {**GOOD_CALL, "max_tokens": 10**30}, None, h),
        ("min_tokens above max_tokens", "POST", "/v1/completions", {**GOOD_CALL, "min_tokens": 3}, None, h),
        ("temperature NaN", "POST", "/v1/completions", None,
         json.dumps({**GOOD_CALL, "temperature": "X"}).replace('"X"', "NaN").encode(), h),
        ("temperature negative", "POST", "/v1/completions", {**GOOD_CALL, "temperature": -1}, None, h),
        ("top_p 0", "POST", "/v1/completions", {**GOOD_CALL, "top_p": 0}, None, h),
        ("an empty stop string", "POST", "/v1/completions", {**GOOD_CALL, "stop": [""]}, None, h),
        ("stop a number", "POST", "/v1/completions", {**GOOD_CALL, "stop": 5}, None, h),
        ("seed negative", "POST", "/v1/completions", {**GOOD_CALL, "seed": -3}, None, h),
        ("out-of-vocabulary ids", "POST", "/v1/completions", {**GOOD_CALL, "prompt": [1, vocab_size]}, None, h),
        ("a prompt longer than the context", "POST", "/v1/completions",
         {**GOOD_CALL, "prompt": [1] * (max_model_len + 1)}, None, h),
        ("an episode the controller does not run", "POST", "/v1/completions", GOOD_CALL, None,
         {**h, "X-Rolloutdb-Episode": "31337.0-a0"}),
        ("GET the completions", "GET", "/v1/completions", None, None, h),
        ("chat completions", "POST", "/v1/chat/completions", GOOD_CALL, None, h),
        ("DELETE the health", "DELETE", "/health", None, None, {}),
    ]


POLICY_CASE_IDS = [c[0] for c in policy_cases(1, 1)]


@pytest.mark.parametrize("case", range(len(POLICY_CASE_IDS)), ids=POLICY_CASE_IDS)
def test_a_malformed_call_to_the_policy_endpoint_gets_a_4xx_with_one_line_and_reaches_no_engine(world, case):
    what, method, path, body, raw, headers = policy_cases(world.vocab_size, world.max_model_len)[case]
    world.owners[OWNED] = OWNED
    calls = world.endpoint.calls
    status, text = request(world.policy_url, method, path, body, raw=raw, headers=headers)
    refusal(status, text)
    assert world.endpoint.calls == calls


def test_a_well_formed_call_to_the_policy_endpoint_answers_its_tokens_logprobs_and_versions(world):
    world.owners["998.0-a0"] = "owner-998"
    body = ok(world.policy_url, "POST", "/v1/completions", {"prompt": [[1, 2, 3]], "max_tokens": 3, "min_tokens": 3,
                                                            "seed": 5},
              headers={"X-Rolloutdb-Episode": "998.0-a0", "X-Rolloutdb-Turn": "2"})
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == len(choice["policy_versions"]) == 3
    assert choice["policy_versions"] == [0, 0, 0]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    owner, turn, got = world.calls[-1]
    assert (owner, turn, got.request_id) == ("owner-998", 2, "998.0-a0-t2")
    assert ok(world.policy_url, "GET", "/health")["status"] == "ok"


# ---------------------------------------------------------------------- modes


def test_a_stateless_server_refuses_a_multi_turn_task_at_start_with_one_line(world):
    assert world.refused is not None, "a stateless server started on a 3-turn task"
    assert "exited with status 2" in str(world.refused)
    lines = [ln for ln in world.refused_log.read_text().splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("rolloutdb-agent-server: ") and "stateless" in lines[0] and "restart_only" in lines[0]


@pytest.mark.parametrize("server", ["quick", "single"])
def test_a_server_that_cannot_export_refuses_every_checkpoint_endpoint_with_409(world, server):
    url = world.servers[server]
    assert health(world, server)["mode"] == {"quick": "restart_only", "single": "stateless"}[server]
    for method, path, body in [("POST", "/checkpoint/prepare", {"checkpoint_id": "c", "lease_s": 5}),
                               ("POST", "/checkpoint/commit", {"checkpoint_id": "c"}),
                               ("POST", "/checkpoint/drain", {"checkpoint_id": "c"}),
                               ("GET", "/checkpoint/export?checkpoint_id=c", None),
                               ("POST", "/agents/install", {"episodes": {}})]:
        status, text = request(url, method, path, body)
        assert status == 409, (path, status, text)
        assert server_mode_named(refusal(status, text), health(world, server)["mode"])
    assert health(world, server)["dispatch"] == "open"


def server_mode_named(error: str, mode: str) -> bool:
    return mode in error and "export_restore" in error


def test_an_episode_past_its_deadline_fails_with_reason_deadline(world):
    reset(world, "quick")
    start(world, "80.0-a0", server="quick")
    got = result(world, "80.0-a0", server="quick")
    assert (got["status"], got["reason"]) == ("failed", "deadline"), got
    assert "deadline" in got["error"]


# ---------------------------------------------------------------------- checkpoints


def test_prepare_closes_registration_while_started_episodes_run_to_their_end(world):
    reset(world)
    world.engine.hold = lambda rid: rid.startswith("10.")
    start(world, "10.0-a0")
    world.engine.wait_held(1)
    assert ok(world.servers["agents"], "POST", "/checkpoint/prepare", {"checkpoint_id": "cp1", "lease_s": 30}) == {
        "checkpoint_id": "cp1", "episodes": 1}
    world.owners["10.1-a0"] = "x"
    status, text = request(world.servers["agents"], "POST", "/episodes",
                           {"key": "10.1-a0", "prompt_id": 1, "seed": 1, "policy": policy(world)})
    assert status == 409 and refusal(status, text).startswith("dispatch is closed")
    assert health(world)["dispatch"] == "closed"
    world.engine.release()
    got = result(world, "10.0-a0")
    assert (got["status"], got["turn"]) == ("finished", TURNS)
    assert ok(world.servers["agents"], "POST", "/checkpoint/resume", {"checkpoint_id": "cp1"}) == {"resumed": True}
    assert health(world)["dispatch"] == "open"
    start(world, "10.1-a0", prompt_id=1)
    assert result(world, "10.1-a0")["status"] == "finished"


def test_export_returns_the_agents_as_committed_not_the_turns_played_after(world):
    reset(world)
    keys = ["20.0-a0", "20.1-a0", "20.2-a0"]
    world.engine.hold = lambda rid: rid.startswith("20.") and rid.endswith("-t1")
    for i, key in enumerate(keys):
        start(world, key, prompt_id=i, seed=100 + i)
    world.engine.wait_held(len(keys))  # every agent has played turn 0 and waits on turn 1
    at_cut = {k: peek(world, k) for k in keys}
    assert all(v["status"] == "running" and v["turn"] == 1 for v in at_cut.values()), at_cut
    assert ok(world.servers["agents"], "POST", "/checkpoint/prepare", {"checkpoint_id": "cp2", "lease_s": 30})
    assert ok(world.servers["agents"], "POST", "/checkpoint/commit", {"checkpoint_id": "cp2"}) == {"episodes": 3}
    world.engine.release()  # the agents play on past the cut
    finished = {k: result(world, k) for k in keys}
    assert all(v["status"] == "finished" and v["turn"] == TURNS for v in finished.values()), finished
    assert ok(world.servers["agents"], "POST", "/checkpoint/drain", {"checkpoint_id": "cp2"}) == {"drained": True}
    export = json.loads(checkpoint(world, "export", "cp2")[1])
    assert export["checkpoint_id"] == "cp2" and sorted(export["episodes"]) == keys
    for key in keys:
        saved, done = export["episodes"][key], finished[key]
        assert saved["turn"] == 1 and saved["state"]["done"] is False and saved["state"]["env"]["turn"] == 1
        n = len(saved["token_ids"])
        # the copy is a prefix of the finished transcript: turn 0's reply and the
        # environment's answer (version -1), nothing of turns 1 and 2
        assert 0 < n < len(done["token_ids"])
        assert saved["token_ids"] == done["token_ids"][:n]
        assert saved["logprobs"] == pytest.approx(done["logprobs"][:n])
        assert saved["token_versions"] == done["token_versions"][:n]
        assert -1 in saved["token_versions"] and saved["token_versions"][0] == 0
    assert ok(world.servers["agents"], "POST", "/checkpoint/resume", {"checkpoint_id": "cp2"}) == {"resumed": True}


def test_a_stale_checkpoint_id_is_refused_with_409(world):
    reset(world)
    url = world.servers["agents"]
    ok(url, "POST", "/checkpoint/prepare", {"checkpoint_id": "old", "lease_s": 30})
    ok(url, "POST", "/checkpoint/prepare", {"checkpoint_id": "new", "lease_s": 30})  # replaces old
    for step in ("commit", "drain", "export"):
        status, text = checkpoint(world, step, "old")
        assert status == 409 and "old" in refusal(status, text), (step, status, text)
    status, text = checkpoint(world, "export", "new")
    assert status == 409 and "commit" in refusal(status, text)  # not committed yet
    assert ok(url, "POST", "/checkpoint/resume", {"checkpoint_id": "old"}) == {"resumed": False}
    assert health(world)["dispatch"] == "closed"
    assert ok(url, "POST", "/checkpoint/resume", {"checkpoint_id": "new"}) == {"resumed": True}
    assert health(world)["dispatch"] == "open"


def test_a_lease_that_expires_reopens_dispatch_and_drops_the_export(world):
    reset(world)
    url = world.servers["agents"]
    expirations = health(world)["lease_expirations"]
    ok(url, "POST", "/checkpoint/prepare", {"checkpoint_id": "leased", "lease_s": 0.5})
    ok(url, "POST", "/checkpoint/commit", {"checkpoint_id": "leased"})
    world.owners["30.0-a0"] = "x"
    status, text = request(url, "POST", "/episodes", {"key": "30.0-a0", "prompt_id": 0, "seed": 1,
                                                     "policy": policy(world)})
    assert status == 409 and refusal(status, text).startswith("dispatch is closed")
    deadline = time.monotonic() + 60  # a hang detector: headroom for a loaded machine
    while health(world)["dispatch"] != "open":
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.05)
    h = health(world)
    assert h["lease_expirations"] == expirations + 1 and h["checkpoint_id"] is None
    status, text = checkpoint(world, "export", "leased")
    assert status == 409, text  # the snapshot that died never gets the copy
    assert ok(url, "POST", "/checkpoint/resume", {"checkpoint_id": "leased"}) == {"resumed": False}
    start(world, "30.0-a0")
    assert result(world, "30.0-a0")["status"] == "finished"


def test_an_installed_agent_continues_from_its_turn_under_a_new_attempt(world):
    reset(world)
    url = world.servers["agents"]
    world.engine.hold = lambda rid: rid == "40.0-a0-t1"
    start(world, "40.0-a0", prompt_id=3, seed=11)
    world.engine.wait_held(1)
    ok(url, "POST", "/checkpoint/prepare", {"checkpoint_id": "cp4", "lease_s": 30})
    ok(url, "POST", "/checkpoint/commit", {"checkpoint_id": "cp4"})
    saved = json.loads(checkpoint(world, "export", "cp4")[1])["episodes"]["40.0-a0"]
    ok(url, "POST", "/checkpoint/resume", {"checkpoint_id": "cp4"})
    # the attempt is abandoned: retire forgets it (its held call fails when released)
    assert ok(url, "POST", "/checkpoint/retire", {"keys": ["40.0-a0", "41.0-a0"]}) == {"retired": 1}
    status, text = request(url, "GET", "/episodes/40.0-a0")
    assert status == 404, text
    world.engine.release()
    assert ok(url, "POST", "/agents/install", {"episodes": {"40.0-a0": saved}}, status=201) == {"installed": 1}
    assert health(world)["installed"] == 1
    calls_before = len(world.calls)
    assert start(world, "40.0-a1", prompt_id=3, seed=11, continue_from="40.0-a0") == {"key": "40.0-a1", "turn": 1}
    got = result(world, "40.0-a1")
    assert (got["status"], got["turn"]) == ("finished", TURNS)
    n = len(saved["token_ids"])
    assert got["token_ids"][:n] == saved["token_ids"] and got["token_versions"][:n] == saved["token_versions"]
    turns = sorted(t for o, t, _ in world.calls[calls_before:] if o == "40.0-a1")
    assert turns == [1, 2]  # turn 0 is not played again
    # the same prompt and seed played without a stop: the same conversation, token for
    # token (same seeds per turn; the engine's output does not depend on its batch)
    start(world, "41.0-a0", prompt_id=3, seed=11)
    whole = result(world, "41.0-a0")
    assert (got["token_ids"], got["reward"]) == (whole["token_ids"], whole["reward"])
    assert health(world)["installed"] == 0  # continue_from consumed it
    status, text = request(url, "POST", "/episodes", {"key": "40.0-a2", "prompt_id": 3, "seed": 11,
                                                     "policy": policy(world), "continue_from": "40.0-a0"})
    assert status == 404 and "install" in refusal(status, text)


def test_a_retired_agents_model_call_is_aborted_in_the_engine(world):
    reset(world)
    world.engine.hold = lambda rid: rid == "45.0-a0-t0"
    start(world, "45.0-a0")
    world.engine.wait_held(1)
    assert ok(world.servers["agents"], "POST", "/checkpoint/retire", {"keys": ["45.0-a0"]}) == {"retired": 1}
    deadline = time.monotonic() + 60
    while "45.0-a0-t0" not in world.engine.aborted:
        assert time.monotonic() < deadline, "the policy endpoint kept the hung-up call"
        time.sleep(0.02)
    world.engine.release()


def test_uninstall_removes_installed_agents_and_retire_forgets_them_too(world):
    reset(world)
    url = world.servers["agents"]
    agent = {"turn": 1, "state": {"env": {"turn": 1}}, "token_ids": [1], "logprobs": [-0.5], "token_versions": [0]}
    ok(url, "POST", "/agents/install", {"episodes": {"50.0-a0": agent, "50.1-a0": agent}}, status=201)
    assert ok(url, "POST", "/agents/uninstall", {"keys": ["50.0-a0", "50.9-a0"]}) == {"uninstalled": 1}
    assert ok(url, "POST", "/checkpoint/retire", {"keys": ["50.1-a0"]}) == {"retired": 0}
    assert health(world)["installed"] == 0


def test_reset_forgets_every_episode_installed_agent_and_checkpoint(world):
    reset(world)
    url = world.servers["agents"]
    world.engine.hold = lambda rid: rid.startswith("60.")
    for i in range(3):
        start(world, f"60.{i}-a0", prompt_id=i)
    world.engine.wait_held(3)
    agent = {"turn": 1, "state": {"env": {"turn": 1}}, "token_ids": [1], "logprobs": [-0.5], "token_versions": [0]}
    ok(url, "POST", "/agents/install", {"episodes": {"61.0-a0": agent}}, status=201)
    ok(url, "POST", "/checkpoint/prepare", {"checkpoint_id": "cp6", "lease_s": 30})
    assert ok(url, "POST", "/reset", {}) == {"forgotten": 3}
    h = health(world)
    assert (h["episodes"], h["running"], h["installed"], h["dispatch"], h["checkpoint_id"]) == (0, 0, 0, "open", None)
    for i in range(3):
        assert request(url, "GET", f"/episodes/60.{i}-a0")[0] == 404
    world.engine.release()


def expected_seed(seed: int, turn: int) -> int:
    """docs/agent_server.md's formula, computed here rather than imported."""
    return int.from_bytes(hashlib.blake2b(f"{seed},{turn}".encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF


def test_the_server_sends_each_turn_the_seed_derived_from_the_episodes_seed(world):
    reset(world)
    start(world, "90.0-a0", prompt_id=5, seed=123456789)
    assert result(world, "90.0-a0")["status"] == "finished"
    sent = {rid: s for rid, s in world.engine.seeds.items() if rid.startswith("90.0-a0-")}
    assert sent == {f"90.0-a0-t{n}": expected_seed(123456789, n) for n in range(TURNS)}


# ---------------------------------------------------------------------- load

LOAD = 256


@pytest.mark.timeout(90)
def test_256_concurrent_episodes_finish_through_one_server_and_the_endpoint_without_errors(world):
    reset(world)
    url, keys = world.servers["agents"], [f"{500 + i}.0-a0" for i in range(LOAD)]
    for key in keys:
        world.owners[key] = key
    calls_before = world.endpoint.calls

    async def one(session, i: int, key: str) -> dict:
        body = {"key": key, "prompt_id": i % PROMPTS, "seed": i, "policy": policy(world)}
        async with session.post(f"{url}/episodes", json=body) as resp:
            assert resp.status == 201, await resp.text()
        while True:
            async with session.get(f"{url}/episodes/{key}", params={"wait_s": "30"}) as resp:
                data = await resp.json()
                if resp.status == 200:
                    break
                assert resp.status == 202, data
        async with session.delete(f"{url}/episodes/{key}") as resp:
            assert resp.status == 200
        return data

    async def run_all() -> tuple[list, int]:
        from aiohttp import ClientSession, ClientTimeout, TCPConnector

        async with ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=90),
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as session:
            registered = asyncio.gather(*(one(session, i, k) for i, k in enumerate(keys)))
            await asyncio.sleep(0.5)
            async with session.get(f"{url}/health") as resp:
                running = (await resp.json())["running"]
            return await registered, running

    t0 = time.monotonic()
    results, running_midway = world.http.call(run_all(), timeout=110)
    elapsed = time.monotonic() - t0
    failed = [r for r in results if r["status"] != "finished"]
    assert not failed, failed[:3]
    assert all(r["turn"] == TURNS for r in results)
    assert world.endpoint.calls - calls_before == LOAD * TURNS
    assert running_midway > LOAD // 2, f"only {running_midway} episodes ran at once"
    h = health(world)
    assert (h["episodes"], h["running"]) == (0, 0)
    print(f"{LOAD} episodes x {TURNS} turns in {elapsed:.1f} s; {running_midway} running at 0.5 s")
