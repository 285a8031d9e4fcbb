"""Hostile callers of the two HTTP surfaces (docs/agent_server.md, "Who may call"): a local
user without the run's token, a caller that sends too much, an episode that names another
port, keys written two ways. Real parts: the tiny policy, a real `ReferenceEngine` behind a
real policy endpoint, one real agent server process started as the controller starts it
(`ServerProcess`: token in its environment, `--policy-url` fixed) and one `AgentServer`
served in this process on a real port (no `--policy-url`: it pins the first endpoint an
episode names). Plain `http.client` requests, any header.

Runtime: ~20-60 s on 2 busy cores, most of it the server process's start (torch imports).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

pytest.importorskip("aiohttp")

from rolloutdb.config import config_from_dict, load_config  # noqa: E402
from rolloutdb.controller.job import build  # noqa: E402
from rolloutdb.controller.agent_server import auth, wire  # noqa: E402
from rolloutdb.controller.agent_server.http_loop import HttpLoop  # noqa: E402
from rolloutdb.controller.agent_server.policy_endpoint import PolicyEndpoint  # noqa: E402
from rolloutdb.controller.agent_server.process import ServerProcess  # noqa: E402
from rolloutdb.gpu_capture.reference_engine import ReferenceEngine  # noqa: E402

TOKEN = "hostile-http-token-" + "5f0c2a9e7d41"
MAX_AGENTS = 2
CONFIG = f"""
run: {{seed: 0}}
generation: {{max_tokens: 4, max_inflight_calls: 1}}
environment:
  task: digits
  kind: copy
  n_digits: 2
  turns: 2
  dataset_size: 8
  servers:
    - {{name: agents, mode: export_restore, max_agents: {MAX_AGENTS}}}
rollout_recovery: {{target_level: turn}}
"""


class World:
    root: Path
    config: Path
    policy: Path
    http: HttpLoop
    endpoint: PolicyEndpoint
    policy_url: str
    server: ServerProcess
    url: str  # the server process (policy endpoint fixed)
    pinless: Any  # the in-process AgentServer
    pinless_url: str
    owners: dict[str, str]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from aiohttp import web

    root = tmp_path_factory.mktemp("hostile_http")
    w = World()
    w.root, w.config, w.owners = root, root / "run.yaml", {}
    w.config.write_text(CONFIG)
    w.policy = build.build_policy(load_config(w.config), root / "policy")
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(ReferenceEngine(w.policy, max_batch_size=4, num_threads=1))
        w.http = HttpLoop()
        stack.callback(w.http.close)
        w.endpoint = PolicyEndpoint(engine, w.http, owner=w.owners.get, tokens=[TOKEN])
        w.policy_url = w.endpoint.start()
        stack.callback(w.endpoint.close)
        w.server = ServerProcess(config_path=w.config, name="agents", policy_dir=w.policy, log_path=root / "agents.log",
                                 start_timeout_s=180, token=TOKEN, policy_url=w.policy_url)
        stack.callback(w.server.stop)
        w.url = w.server.start()

        from rolloutdb.controller.agent_server.env_server import build_server

        w.pinless = build_server(load_config(w.config), "agents", w.policy, token=TOKEN)

        async def serve():
            runner = web.AppRunner(w.pinless.app(), access_log=None, handle_signals=False)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"

        runner, w.pinless_url = w.http.call(serve(), timeout=60)
        stack.callback(lambda: w.http.call(runner.cleanup(), timeout=30))
        yield w


def request(url: str, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
            token: str | None = TOKEN, headers: dict | None = None) -> tuple[int, str, dict]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {}),
            **(headers or {})}
    try:
        conn.request(method, path, body=raw if raw is not None else None if body is None else json.dumps(body).encode(),
                     headers=sent)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace"), dict(resp.getheaders())
    finally:
        conn.close()


def one_line_error(status: int, text: str, expected: int) -> str:
    assert status == expected, f"expected {expected}, got {status}: {text[:300]}"
    body = json.loads(text)
    assert set(body) == {"error"} and "\n" not in body["error"] and body["error"].strip(), body
    return body["error"]


def health(url: str) -> dict:
    status, text, _ = request(url, "GET", "/health")
    assert status == 200, text
    return {k: v for k, v in json.loads(text).items() if k != "lease_expirations"}


def episode(w: World, key: str, policy_url: str | None = None, **extra) -> dict:
    return {"key": key, "prompt_id": 0, "seed": 1, "policy": {"url": policy_url or w.policy_url, "max_tokens": 4},
            **extra}


def routes(app) -> list[tuple[str, str]]:
    found = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    return sorted((m, p.replace("{key}", "1.0-a0")) for m, p in found)


def agent_routes() -> list[tuple[str, str]]:
    from rolloutdb.controller.agent_server.env_server import AgentServer

    return routes(AgentServer(None, name="r", mode="export_restore", task={}, token=TOKEN).app())


def policy_routes() -> list[tuple[str, str]]:
    return routes(PolicyEndpoint(None, None, owner={}.get, tokens=[TOKEN]).build_app())  # type: ignore[arg-type]


BAD_TOKENS = {"no header": None, "a wrong token": "hostile-http-token-000000000000", "the token as Basic": "basic",
              "a prefix of the token": TOKEN[:-1]}


def _asked(token: str | None) -> tuple[str | None, dict]:
    if token == "basic":
        return None, {"Authorization": f"Basic {TOKEN}"}
    return token, {}


# ---------------------------------------------------------------------- 401 on every route


@pytest.mark.parametrize("who", BAD_TOKENS)
@pytest.mark.parametrize("route", agent_routes(), ids=lambda r: f"{r[0]} {r[1]}")
def test_every_agent_server_route_answers_401_with_one_line_without_the_token_and_changes_nothing(world, route, who):
    method, path = route
    before = health(world.url)
    token, headers = _asked(BAD_TOKENS[who])
    body = {"checkpoint_id": "x", "lease_s": 3600} if path.endswith("prepare") else \
        episode(world, "77.0-a0") if path == "/episodes" else {}
    status, text, got = request(world.url, method, path, None if method in ("GET", "DELETE") else body,
                                token=token, headers=headers)
    error = one_line_error(status, text, 401)
    assert "bearer token" in error and TOKEN not in text
    assert got.get("WWW-Authenticate") == "Bearer"
    assert health(world.url) == before  # dispatch still open: no prepare held it, no episode started


@pytest.mark.parametrize("who", BAD_TOKENS)
@pytest.mark.parametrize("route", policy_routes(), ids=lambda r: f"{r[0]} {r[1]}")
def test_every_policy_endpoint_route_answers_401_without_the_token_even_for_a_running_episode(world, route, who):
    method, path = route
    world.owners["901.0-a0"] = "running"  # a key any local user could read from the store
    calls = world.endpoint.calls
    token, headers = _asked(BAD_TOKENS[who])
    status, text, _ = request(world.policy_url, method, path, {"prompt": [1, 2, 3], "max_tokens": 2}
                              if method == "POST" else None, token=token,
                              headers={**headers, wire.EPISODE_HEADER: "901.0-a0", wire.TURN_HEADER: "0"})
    assert "bearer token" in one_line_error(status, text, 401)
    assert world.endpoint.calls == calls


def test_an_unauthenticated_body_over_the_cap_is_refused_as_unauthenticated_before_it_is_read(world):
    status, text, _ = request(world.policy_url, "POST", "/v1/completions", raw=b" " * (wire.POLICY_MAX_BODY_BYTES + 1),
                              token=None, headers={wire.EPISODE_HEADER: "901.0-a0"})
    assert "bearer token" in one_line_error(status, text, 401)


# ---------------------------------------------------------------------- the token's file, its holders


def test_the_runs_token_file_is_created_0600_even_under_umask_0_and_is_what_both_surfaces_accept(tmp_path, monkeypatch):
    from rolloutdb.controller.agent_server.client import AgentPool
    from rolloutdb.store import faults

    cfg = config_from_dict({"environment": {"task": "digits", "servers": [{"name": "agents"}]},
                            "rollout_recovery": {"target_level": "turn"}})
    seen: dict[str, int] = {}
    real_io = faults.io

    def watch(op: str, path: object = None) -> None:  # the temporary file, written, before its rename
        p = Path(str(path))
        if op == "fsync" and p.name.endswith(".tmp"):
            seen[p.name] = stat.S_IMODE(os.stat(p).st_mode)
        real_io(op, path)

    monkeypatch.setattr(faults, "io", watch)
    token_path = tmp_path / "agent_server.token"
    old = os.umask(0)
    try:
        pools = [AgentPool(cfg, None, config_path=tmp_path / "c.yaml", policy_dir=tmp_path, log_dir=tmp_path,
                           token_path=token_path) for _ in range(2)]
    finally:
        os.umask(old)
    for pool in pools:
        pool.close()
    assert stat.S_IMODE(os.stat(token_path).st_mode) == 0o600
    assert seen and all(mode == 0o600 for mode in seen.values()), seen
    token = token_path.read_text().strip()
    assert pools[1].endpoint.tokens == (token,) and pools[1].clients[0].headers == auth.header(token)
    assert pools[0].endpoint.tokens != pools[1].endpoint.tokens  # a fresh token at every start
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent_server.token"]  # no temporary file left


def test_a_token_file_other_users_can_read_is_refused_with_one_line(tmp_path):
    leaky = tmp_path / "token"
    leaky.write_text(TOKEN + "\n")
    leaky.chmod(0o644)
    cfg = config_from_dict({"environment": {"task": "digits", "servers": [
        {"name": "agents", "url": "http://127.0.0.1:9", "token_file": str(leaky)}]},
        "rollout_recovery": {"target_level": "turn"}})
    from rolloutdb.controller.agent_server.client import AgentPool

    with pytest.raises(auth.TokenError) as info:
        AgentPool(cfg, None, config_path=tmp_path / "c.yaml", policy_dir=tmp_path, log_dir=tmp_path,
                  token_path=tmp_path / "agent_server.token")
    assert "chmod 600" in str(info.value) and "\n" not in str(info.value) and TOKEN not in str(info.value)
    assert not (tmp_path / "agent_server.token").exists()


def test_a_server_at_a_url_needs_its_token_file_in_the_config():
    with pytest.raises(ValueError, match="token_file"):
        config_from_dict({"environment": {"task": "digits", "servers": [{"name": "a", "url": "http://127.0.0.1:9"}]},
                          "rollout_recovery": {"target_level": "turn"}})


def test_a_server_started_without_a_token_exits_2_with_one_line(world):
    env = {k: v for k, v in os.environ.items() if k != auth.TOKEN_ENV}
    done = subprocess.run([sys.executable, "-m", "rolloutdb.controller.agent_server.env_server", "--config",
                           str(world.config), "--server", "agents", "--policy-dir", str(world.policy), "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "token" in lines[0] and "listening" not in done.stdout, done.stderr


def test_the_token_is_on_no_command_line_and_in_no_log(world):
    pid = world.server.pid
    assert pid is not None
    argv = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert TOKEN.encode() not in argv and world.policy_url.encode() in argv
    request(world.url, "POST", "/reset", {}, token="hostile-http-token-wrong00000")
    assert TOKEN not in (world.root / "agents.log").read_text(errors="replace")


# ---------------------------------------------------------------------- caps


def test_an_agent_server_refuses_agents_past_max_agents_with_429_and_keeps_what_it_held(world):
    assert request(world.url, "POST", "/reset", {})[0] == 200
    for key in ("10.0-a0", "10.1-a0"):
        status, text, _ = request(world.url, "POST", "/episodes", episode(world, key))
        assert status == 201, text
    for key in ("10.0-a0", "10.1-a0"):  # not the controller's: their first call is refused, the agents stay
        assert request(world.url, "GET", f"/episodes/{key}?wait_s=30")[0] == 200
    before = health(world.url)
    status, text, _ = request(world.url, "POST", "/episodes", episode(world, "10.2-a0"))
    error = one_line_error(status, text, 429)
    assert f"at most {MAX_AGENTS}" in error and "max_agents" in error
    saved = {"turn": 1, "state": {"env": {}}, "token_ids": [], "logprobs": [], "token_versions": []}
    status, text, _ = request(world.url, "POST", "/agents/install", {"episodes": {"9.0-a0": saved}})
    assert "max_agents" in one_line_error(status, text, 429)
    assert health(world.url) == before and before["episodes"] == MAX_AGENTS and before["installed"] == 0
    assert request(world.url, "DELETE", "/episodes/10.0-a0")[0] == 200
    assert request(world.url, "POST", "/episodes", episode(world, "10.2-a0"))[0] == 201  # room again
    assert request(world.url, "POST", "/reset", {})[0] == 200


def test_a_completion_body_over_the_policy_endpoints_cap_is_refused_with_413_naming_the_cap(world):
    world.owners["902.0-a0"] = "running"
    calls = world.endpoint.calls
    prompt = b'{"max_tokens": 2, "prompt": [' + b"1," * (wire.POLICY_MAX_BODY_BYTES // 2) + b"1]}"
    status, text, _ = request(world.policy_url, "POST", "/v1/completions", raw=prompt,
                              headers={wire.EPISODE_HEADER: "902.0-a0"})
    assert str(wire.POLICY_MAX_BODY_BYTES) in one_line_error(status, text, 413)
    assert world.endpoint.calls == calls


def test_lists_past_their_caps_are_refused_with_400_naming_the_cap(world):
    world.owners["903.0-a0"] = "running"
    calls = world.endpoint.calls
    stops = {"prompt": [1, 2], "max_tokens": 2, "stop": [str(i) for i in range(wire.MAX_STOP + 1)]}
    status, text, _ = request(world.policy_url, "POST", "/v1/completions", stops,
                              headers={wire.EPISODE_HEADER: "903.0-a0"})
    assert f"at most {wire.MAX_STOP}" in one_line_error(status, text, 400)
    assert world.endpoint.calls == calls
    keys = json.dumps({"keys": [f"{i}.0-a0" for i in range(wire.MAX_KEYS + 1)]}).encode()
    status, text, _ = request(world.url, "POST", "/checkpoint/retire", raw=keys)
    assert f"at most {wire.MAX_KEYS}" in one_line_error(status, text, 400)


# ---------------------------------------------------------------------- where a server may call


@contextlib.contextmanager
def decoy() -> Any:
    """A listener on another loopback port that counts the connections it gets."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.settimeout(0.2)
    got: list[int] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conn, _ = sock.accept()
                got.append(1)
                conn.close()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", got
    finally:
        stop.set()
        t.join(5)
        sock.close()


def test_a_server_the_controller_starts_calls_its_policy_endpoint_only_and_refuses_another_port_with_403(world):
    assert request(world.url, "POST", "/reset", {})[0] == 200
    before = health(world.url)
    with decoy() as (elsewhere, connections):
        port = urlsplit(world.policy_url).port
        for url in (elsewhere, f"http://localhost:{port}", f"http://127.0.0.1:{port}/v1/x"):
            status, text, _ = request(world.url, "POST", "/episodes", episode(world, "20.0-a0", policy_url=url))
            assert world.policy_url in one_line_error(status, text, 403)
        assert health(world.url) == before
        assert connections == []


def test_a_server_without_policy_url_pins_the_first_endpoint_an_episode_names_until_a_reset(world):
    url = world.pinless_url
    assert request(url, "POST", "/reset", {})[0] == 200
    world.owners["30.0-a0"] = "running"
    assert request(url, "POST", "/episodes", episode(world, "30.0-a0"))[0] == 201
    with decoy() as (elsewhere, connections):
        status, text, _ = request(url, "POST", "/episodes", episode(world, "30.1-a0", policy_url=elsewhere))
        assert world.policy_url in one_line_error(status, text, 403)
        assert connections == []
    assert "30.1-a0" not in world.pinless.agents
    assert request(url, "POST", "/reset", {})[0] == 200
    assert world.pinless.policy_url is None  # the next controller's first episode names its own


# ---------------------------------------------------------------------- one key, one spelling


NOT_KEYS = ["15.0-a0\n", "0005.0-a0", "5.00-a0", "5.0-a00", "05.0-a0", " 5.0-a0", "5.0-a0 ", "\u0665.0-a0",
            "5.0-a-1", "+5.0-a0", "5.0-A0"]


@pytest.mark.parametrize("key", NOT_KEYS, ids=repr)
def test_an_episode_key_has_one_spelling_and_any_other_is_refused(key):
    assert wire.episode_key("5.0-a0") == "5.0-a0" and wire.episode_key("0.0-a0") == "0.0-a0"
    with pytest.raises(wire.HttpError) as info:
        wire.episode_key(key)
    assert info.value.status == 400 and "leading zeros" in info.value.message


def test_keys_in_another_spelling_are_refused_by_both_servers(world):
    assert request(world.url, "POST", "/reset", {})[0] == 200
    for key in ("15.0-a0\n", "0005.0-a0"):
        status, text, _ = request(world.url, "POST", "/episodes", episode(world, key))
        one_line_error(status, text, 400)
    status, text, _ = request(world.url, "GET", "/episodes/15.0-a0%0A")
    one_line_error(status, text, 400)
    status, text, _ = request(world.url, "POST", "/checkpoint/retire", {"keys": ["0015.0-a0"]})
    one_line_error(status, text, 400)
    assert health(world.url)["episodes"] == 0
    world.owners["0005.0-a0"] = "a second name for 5.0-a0"
    calls = world.endpoint.calls
    status, text, _ = request(world.policy_url, "POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2},
                              headers={wire.EPISODE_HEADER: "0005.0-a0"})
    one_line_error(status, text, 400)
    assert world.endpoint.calls == calls
