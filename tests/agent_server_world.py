"""The world tests/test_agent_server_http.py runs in: four real agent server processes
and a real policy endpoint over a real engine behind a gate, and the HTTP helpers the
tests use (plain http.client: raw bytes, any method, any header).

`open_world` starts the servers at once (about 8 s each, mostly imports; in parallel
10-40 s on 2 busy cores): `agents` (export_restore, 3 turns), `quick` (restart_only, a
deadline of 1 ms), `single` (stateless, 1 turn) and `refused` (the 3-turn `agents` task
started with `--mode stateless`, which must not start).

`HeldEngine` is a gate in front of the real engine: a test closes it for some calls (by
request id) to freeze agents at a turn boundary, so what a commit copies is known
exactly; held calls are submitted unchanged when it opens. It also records each call's
seed and every abort.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rolloutdb.config import load_config
from rolloutdb.controller.job import build
from rolloutdb.controller.agent_server.http_loop import HttpLoop
from rolloutdb.controller.agent_server.policy_endpoint import PolicyEndpoint
from rolloutdb.controller.agent_server.process import ServerProcess, ServerStartError
from rolloutdb.gpu_capture.reference_engine import ReferenceEngine

TOKEN = "world-token-" + "0123456789abcdef"  # every request below carries it (`request`)
TURNS = 3
PROMPTS = 16
MAX_TOKENS = 4

CONFIG = f"""
run: {{seed: 0}}
generation: {{max_tokens: {MAX_TOKENS}}}
environment:
  task: digits
  kind: copy
  n_digits: 2
  turns: {TURNS}
  dataset_size: {PROMPTS}
  servers:
    - {{name: agents, mode: export_restore}}
    - {{name: quick, mode: restart_only, episode_timeout_s: 0.001}}
    - {{name: single, mode: stateless, turns: 1}}
rollout_recovery: {{target_level: turn}}
"""


class HeldEngine:
    """The real engine, with a gate: while `hold(request_id)` is true a call waits here
    (its future unresolved) until `release()` submits it to the engine."""

    def __init__(self, engine: ReferenceEngine):
        self.engine = engine
        self.lock = threading.Lock()
        self.hold: Any = None
        self.held: list[tuple[Any, Future]] = []
        self.aborted: list[str] = []
        self.seeds: dict[str, int | None] = {}  # request id -> the seed the call carried

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def submit(self, request) -> Future:
        with self.lock:
            self.seeds[request.request_id] = request.params.seed
            if self.hold is not None and self.hold(request.request_id):
                waiting: Future = Future()
                self.held.append((request, waiting))
                return waiting
        return self.engine.submit(request)

    def abort(self, request_ids) -> None:
        self.aborted += list(request_ids)
        self.engine.abort(request_ids)

    def wait_held(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.held) < n:
            assert time.monotonic() < deadline, f"only {len(self.held)} of {n} calls reached the gate"
            time.sleep(0.01)

    def release(self) -> None:
        with self.lock:
            held, self.held, self.hold = self.held, [], None
        for request, waiting in held:
            real = self.engine.submit(request)
            real.add_done_callback(lambda f, w=waiting: None if w.done() else w.set_result(f.result()))


@dataclass
class World:
    root: Path
    servers: dict[str, str]  # name -> base URL
    refused: ServerStartError | None
    refused_log: Path
    engine: HeldEngine
    http: HttpLoop
    endpoint: PolicyEndpoint
    policy_url: str
    owners: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[str, int, Any]] = field(default_factory=list)
    vocab_size: int = 0
    max_model_len: int = 0


@contextlib.contextmanager
def open_world(root: Path) -> Iterator[World]:
    """Build the tiny policy under `root`, start the four servers at once and the policy
    endpoint; stop them all on exit."""
    cfg = root / "run.yaml"
    cfg.write_text(CONFIG)
    policy = build.build_policy(load_config(cfg), root / "policy")
    procs = {
        name: ServerProcess(config_path=cfg, name=server, policy_dir=policy, log_path=root / f"{name}.log",
                            # four start at once: one alone took 45 s at load 12 on 2 cores
                            start_timeout_s=600, token=TOKEN, mode=mode)
        for name, server, mode in [("agents", "agents", None), ("quick", "quick", None), ("single", "single", None),
                                   ("refused", "agents", "stateless")]
    }

    def launch(p: ServerProcess) -> str | ServerStartError:
        try:
            return p.start()
        except ServerStartError as e:
            return e

    with contextlib.ExitStack() as stack:
        stack.callback(lambda: list(ThreadPoolExecutor(len(procs)).map(lambda p: p.stop(), procs.values())))
        with ThreadPoolExecutor(len(procs)) as pool:
            started = dict(zip(procs, pool.map(launch, procs.values())))
        real = ReferenceEngine(policy, max_batch_size=64, num_threads=1)
        stack.callback(real.close)
        loop = HttpLoop()
        stack.callback(loop.close)
        engine = HeldEngine(real)
        stack.callback(engine.release)  # runs first: no call stays held at close
        w = World(root=root, servers={}, refused=None, refused_log=root / "refused.log", engine=engine, http=loop,
                  endpoint=None, policy_url="", vocab_size=real.vocab_size,  # type: ignore[arg-type]
                  max_model_len=real.max_model_len)
        w.endpoint = PolicyEndpoint(engine, loop, owner=w.owners.get, tokens=[TOKEN],
                                    on_call=lambda o, t, r, _prefix=0: w.calls.append((o, t, r)))
        for name, got in started.items():
            if name == "refused":
                w.refused = got if isinstance(got, ServerStartError) else None
            else:
                assert isinstance(got, str), f"server {name} did not start: {got}"
                w.servers[name] = got
        w.policy_url = w.endpoint.start()
        stack.callback(w.endpoint.close)
        yield w


# ---------------------------------------------------------------------- helpers


def request(url: str, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
            headers: dict | None = None, timeout: float = 60.0) -> tuple[int, str]:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                       "Authorization": f"Bearer {TOKEN}", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def ok(url: str, method: str, path: str, body: Any = None, status: int = 200, **kw) -> dict:
    got, text = request(url, method, path, body, **kw)
    assert got == status, f"{method} {path}: {got} {text}"
    return json.loads(text)


def refusal(status: int, text: str) -> str:
    """The one-line reason of a 4xx answer (asserting its shape)."""
    assert 400 <= status < 500, f"expected a 4xx, got {status}: {text[:300]}"
    assert "Traceback" not in text and 'File "' not in text, text
    body = json.loads(text)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert isinstance(body["error"], str) and body["error"].strip() and "\n" not in body["error"], body
    return body["error"]


def policy(w: World, **sampling) -> dict:
    return {"url": w.policy_url, "max_tokens": MAX_TOKENS, "temperature": 1.0, **sampling}


def start(w: World, key: str, prompt_id: int = 0, seed: int = 7, server: str = "agents", **extra) -> dict:
    w.owners[key] = key
    return ok(w.servers[server], "POST", "/episodes", {"key": key, "prompt_id": prompt_id, "seed": seed,
                                                      "policy": policy(w), **extra}, status=201)


def result(w: World, key: str, server: str = "agents", wait_s: float = 30) -> dict:
    """The episode's end (200), waiting up to `wait_s`."""
    status, text = request(w.servers[server], "GET", f"/episodes/{key}?wait_s={wait_s}")
    assert status == 200, f"episode {key}: {status} {text}"
    return json.loads(text)


def peek(w: World, key: str) -> dict:
    """A running episode (202), without waiting."""
    status, text = request(w.servers["agents"], "GET", f"/episodes/{key}")
    assert status == 202, f"episode {key}: {status} {text}"
    return json.loads(text)


def health(w: World, server: str = "agents") -> dict:
    return ok(w.servers[server], "GET", "/health")


def reset(w: World, server: str = "agents") -> None:
    ok(w.servers[server], "POST", "/reset", {})


def checkpoint(w: World, step: str, cid: str, **extra) -> tuple[int, str]:
    if step == "export":
        return request(w.servers["agents"], "GET", f"/checkpoint/export?checkpoint_id={cid}")
    return request(w.servers["agents"], "POST", f"/checkpoint/{step}", {"checkpoint_id": cid, **extra})
