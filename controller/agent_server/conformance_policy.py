"""The conformance kit's side of the wire: a small deterministic policy endpoint the server
under test calls, and a plain HTTP client for the server's episode API.

Standard library only (http.server, http.client): the kit talks HTTP to any server, so it
depends on nothing of the controller but the protocol's constants (docs/agent_server.md).

`FixedPolicy` answers `POST /v1/completions` with the same tokens every time (the first
`max_tokens` of `REPLY`), records every call (episode key, turn, prompt, seed) and can hold
calls at a gate: a check closes it for some (key, turn) pairs to freeze agents at a turn
boundary, so what a commit copies is known exactly. Held calls are answered when the gate
opens (`release`) or the policy closes.
"""

from __future__ import annotations

import hmac
import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from rolloutdb.controller.agent_server.wire import EPISODE_HEADER, TURN_HEADER

REPLY = [4, 5, 6, 7, 8, 9, 10, 11]  # token ids every call gets (small: inside any task's vocabulary)
REPLY_LOGPROB = -0.5
MAX_ANSWER_BYTES = 64 << 20  # what the kit reads of one answer, as the controller does


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # a held call's server hung up (it retired or lost the episode): expected, not news
        pass


@dataclass(frozen=True)
class Call:
    key: str
    turn: int
    prompt: list[int]
    seed: int | None


class FixedPolicy:
    """A policy endpoint on 127.0.0.1 that every server under test may call."""

    def __init__(self, token: str):
        self.token = token
        self.calls: list[Call] = []
        self.lock = threading.Lock()
        self._hold: Callable[[str, int], bool] | None = None
        self._gate = threading.Condition(self.lock)
        self._server = _QuietServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="conformance-policy", daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def hold(self, which: Callable[[str, int], bool]) -> None:
        """Keep calls for which `which(key, turn)` is true waiting until `release` (or a
        new `hold` that no longer matches them)."""
        with self.lock:
            self._hold = which
            self._gate.notify_all()

    def release(self) -> None:
        with self.lock:
            self._hold = None
            self._gate.notify_all()

    def wait_calls(self, want: Callable[[list[Call]], bool], timeout: float) -> bool:
        """Wait until the calls so far satisfy `want`; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if want(list(self.calls)):
                    return True
            time.sleep(0.01)
        return False

    def calls_of(self, key: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.key == key]

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _answer(self, headers, body: dict) -> tuple[int, dict]:
        given = headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return 401, {"error": "wrong or no bearer token"}
        key = headers.get(EPISODE_HEADER)
        try:
            turn = int(headers.get(TURN_HEADER, "0"))
        except ValueError:
            return 400, {"error": f"header {TURN_HEADER} must be an integer"}
        if not key:
            return 400, {"error": f"missing header {EPISODE_HEADER}"}
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(prompt, list) or not prompt or not isinstance(max_tokens, int) or max_tokens < 1:
            return 400, {"error": "field 'prompt' must be a non-empty list of token ids, 'max_tokens' >= 1"}
        seed = body.get("seed")
        with self.lock:
            self.calls.append(Call(key, turn, list(prompt), seed if isinstance(seed, int) else None))
            while self._hold is not None and self._hold(key, turn):
                self._gate.wait()
        tokens = REPLY[:max_tokens]
        return 200, {
            "id": f"{key}-t{turn}", "object": "text_completion", "created": int(time.time()), "model": "policy",
            "choices": [{"index": 0, "text": "", "token_ids": tokens,
                         "logprobs": {"token_logprobs": [REPLY_LOGPROB] * len(tokens)},
                         "finish_reason": "length" if max_tokens <= len(REPLY) else "stop",
                         "policy_versions": [0] * len(tokens)}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                      "total_tokens": len(prompt) + len(tokens)}}

    def _handler(self):
        policy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # noqa: A002 - the base class's name
                pass  # the kit's table says what went wrong; no access log on stderr

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path == "/health":
                    self._send(200, {"status": "ok", "model": "policy", "policy_version": 0,
                                     "calls": len(policy.calls)})
                else:
                    self._send(404, {"error": f"no such endpoint: GET {self.path}"})

            def do_POST(self):  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                if self.path != "/v1/completions":
                    self._send(404, {"error": f"no such endpoint: POST {self.path}"})
                    return
                try:
                    body = json.loads(raw)
                except ValueError:
                    self._send(400, {"error": "body is not JSON"})
                    return
                if not isinstance(body, dict):
                    self._send(400, {"error": "body must be a JSON object"})
                    return
                self._send(*policy._answer(self.headers, body))

        return Handler


@dataclass(frozen=True)
class Answer:
    status: int
    body: Any  # the parsed JSON, or the raw text when it is not JSON
    request: str  # "METHOD PATH body" as sent, for the results table


class ServerClient:
    """One request per connection to the server under test, with its bearer token."""

    def __init__(self, url: str, token: str | None, timeout: float = 60.0):
        u = urlsplit(url.rstrip("/"))
        if u.scheme != "http" or not u.hostname or u.port is None:
            raise ValueError(f"URL {url!r}: give the server's base URL as http://HOST:PORT")
        self.url, self.host, self.port = url.rstrip("/"), u.hostname, u.port
        self.token = token
        self.timeout = timeout

    def call(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
             headers: dict | None = None, token: bool = True, timeout: float | None = None) -> Answer:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        shown = f"{method} {path}" + ("" if data is None else f" {data[:200].decode(errors='replace')}")
        sent = {"Content-Type": "application/json", **(headers or {})}
        if token and self.token is not None:
            sent["Authorization"] = f"Bearer {self.token}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)
        try:
            conn.request(method, path, body=data, headers=sent)
            resp = conn.getresponse()
            text = resp.read(MAX_ANSWER_BYTES).decode(errors="replace")
        finally:
            conn.close()
        try:
            parsed: Any = json.loads(text) if text else None
        except ValueError:
            parsed = text
        return Answer(resp.status, parsed, shown)

    def alive(self) -> bool:
        try:
            return self.call("GET", "/health", timeout=2).status == 200
        except OSError:
            return False
