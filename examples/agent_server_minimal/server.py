"""A minimal agent server, written from docs/agent_server.md alone: Python's standard
library only (http.server, threading, json, urllib), no import of rolloutdb.

    python server.py --token-file FILE [--host 127.0.0.1] [--port 0] [--turns 3] [--prompts 64]
        [--policy-dir RUN_DIR/policy --n-digits 2 --seed 0]

With `--policy-dir` it runs the built-in `digits` copy task (digits_task.py: the prompts,
observations and rewards the controller's own environment gives, so `rolloutdb train`
trains on what was played); without it, a toy tool-use game (`ToyTask`).

Every turn carries an idempotency key `<episode>/t<turn>` (the same across attempts of an
episode) and the fencing token `attempt`, handed to the tool; the server refuses a turn of
an attempt older than the newest it has seen for its episode (docs/agent_server.md,
"Fencing"). A turn is applied under the server's one lock, so a commit never sees one half
applied and drain has nothing to wait for.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import re
import sys
import threading
import urllib.error
import urllib.request
from hashlib import blake2b
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

PROTOCOL = 1
KEY = re.compile(r"(?:0|[1-9][0-9]{0,17})\.(?:0|[1-9][0-9]{0,8})-a(?:0|[1-9][0-9]{0,8})")
MAX_BODY = 64 << 20


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def call_seed(seed: int, turn: int) -> int:
    return int.from_bytes(blake2b(f"{seed},{turn}".encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF


def need(body: dict, name: str, kind: type, lo: int | None = None, hi: int | None = None):
    value = body.get(name)
    if value is None or isinstance(value, bool) or not isinstance(value, kind):
        raise Refused(400, f"field {name!r} must be {kind.__name__}")
    if lo is not None and not lo <= value <= (hi if hi is not None else value):
        raise Refused(400, f"field {name!r} must be in [{lo}, {hi}]")
    return value


def need_key(value, name: str = "key") -> str:
    if not isinstance(value, str) or not KEY.fullmatch(value):
        raise Refused(400, f"field {name!r} must be an episode key like '12.3-a0'")
    return value


class ToyTask:
    """A toy tool-use game (the default): each turn the tool "check" compares the reply's
    first token with the turn's target token and answers `[3, next target]`; the reward
    is the share of turns it scored. Prompt `p` is `[1, 2, 4 + p % 10]`."""

    def __init__(self, turns: int):
        self.turns = turns

    @staticmethod
    def target(prompt_id: int, turn: int) -> int:
        return 4 + (prompt_id + turn) % 8

    def new_state(self, prompt_id: int) -> dict:
        return {"scored": 0}

    def valid_state(self, state: dict) -> bool:
        return isinstance(state.get("scored"), int)

    def prompt(self, prompt_id: int) -> list[int]:
        return [1, 2, 4 + prompt_id % 10]

    def tool(self, state: dict, prompt_id: int, turn: int, reply: list[int]) -> list[int]:
        if reply[:1] == [self.target(prompt_id, turn)]:
            state["scored"] += 1
        return [3, self.target(prompt_id, turn + 1)]

    def reward(self, state: dict) -> float:
        return state["scored"] / self.turns


def run_tool(task, agent: Agent, reply: list[int], idempotency_key: str, attempt: int) -> list[int]:
    """One turn's tool. A tool with an effect outside the episode (a file, a request) would
    record `idempotency_key` (`<episode>/t<turn>`, the same in every attempt) with its
    effect and skip one it has done already; `attempt` is the fencing token it can compare
    with the newest it has seen. The tools here act inside the episode: nothing to skip."""
    del idempotency_key, attempt
    return task.tool(agent.state, agent.prompt_id, agent.turn, reply)


class Agent:
    def __init__(self, key: str, episode: str, attempt: int, prompt_id: int, seed: int, policy: dict):
        self.key, self.episode, self.attempt = key, episode, attempt
        self.prompt_id, self.seed, self.policy = prompt_id, seed, policy
        self.turn = 0
        self.state: dict = {}
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reasons: list[str] = []
        self.status, self.reason, self.error = "running", None, None
        self.cancelled = False
        self.ended = threading.Event()

    def view(self) -> dict:
        # a deep copy: the committed copy must not change as later turns append to the state
        state = json.loads(json.dumps(self.state))
        return {"turn": self.turn, "state": dict(state, finish_reasons=list(self.finish_reasons)),
                "token_ids": list(self.token_ids), "logprobs": list(self.logprobs),
                "token_versions": list(self.versions)}


class Server:
    def __init__(self, token: str, turns: int = 3, prompts: int = 64, task=None):
        self.token, self.turns, self.prompts = token, turns, prompts
        self.task = task or ToyTask(turns)
        self.lock = threading.Lock()
        self.agents: dict[str, Agent] = {}
        self.installed: dict[str, dict] = {}
        self.newest: dict[str, int] = {}  # episode -> the newest attempt seen (the fence)
        self.policy_url: str | None = None
        self.checkpoint_id: str | None = None
        self.committed: dict | None = None
        self.lease: threading.Timer | None = None
        self.lease_expirations = 0

    # ---------------------------------------------------------------- episodes

    def see(self, key: str, episode: str | None, attempt: int | None) -> tuple[str, int]:
        """The episode and attempt of `key` (given, or read from its `-a<N>` suffix), refused
        when older than the newest attempt seen for that episode."""
        base, suffix = key.rsplit("-a", 1)
        episode = base if episode is None else episode
        attempt = int(suffix) if attempt is None else attempt
        newest = self.newest.get(episode, -1)
        if attempt < newest:
            raise Refused(409, f"stale attempt {attempt} of episode {episode}: attempt {newest} has been seen; "
                               "a newer attempt owns this episode")
        return episode, attempt

    def start(self, body: dict) -> tuple[int, dict]:
        key = need_key(body.get("key"))
        prompt_id = need(body, "prompt_id", int, 0, self.prompts - 1)
        seed = need(body, "seed", int, 0, 2**63 - 1)
        policy = need(body, "policy", dict)
        url = need(policy, "url", str).rstrip("/")
        max_tokens = policy.get("max_tokens", 16)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 1_000_000:
            raise Refused(400, "field 'max_tokens' must be an integer in [1, 1000000]")
        episode = body.get("episode")
        if episode is not None and not isinstance(episode, str):
            raise Refused(400, "field 'episode' must be a string")
        attempt = None if body.get("attempt") is None else need(body, "attempt", int, 0, 2**31 - 1)
        source = body.get("continue_from")
        with self.lock:
            if self.policy_url is not None and url != self.policy_url:
                raise Refused(403, f"policy.url {url} is not this server's policy endpoint {self.policy_url}")
            if self.checkpoint_id is not None:
                raise Refused(409, f"dispatch is closed: checkpoint {self.checkpoint_id} is in progress; retry "
                                   "after resume")
            if key in self.agents:
                raise Refused(409, f"episode {key} exists already")
            episode, attempt = self.see(key, episode, attempt)
            agent = Agent(key, episode, attempt, prompt_id, seed, {k: v for k, v in policy.items() if k != "url"})
            agent.state = self.task.new_state(prompt_id)
            if source is not None:
                saved = self.installed.pop(need_key(source, "continue_from"), None)
                if saved is None:
                    raise Refused(404, f"no installed agent {source}; POST /agents/install it first")
                agent.turn, agent.state = saved["turn"], json.loads(json.dumps(saved["state"]))
                agent.finish_reasons = list(agent.state.pop("finish_reasons", []))
                agent.token_ids, agent.logprobs = list(saved["token_ids"]), list(saved["logprobs"])
                agent.versions = list(saved["token_versions"])
            self.newest[episode] = attempt
            self.policy_url = url
            self.agents[key] = agent
        threading.Thread(target=self.play, args=(agent,), name=f"agent-{key}", daemon=True).start()
        return 201, {"key": key, "turn": agent.turn}

    def fenced(self, agent: Agent) -> bool:
        return self.newest.get(agent.episode, -1) > agent.attempt

    def end(self, agent: Agent, status: str, reason: str | None = None, error: str | None = None) -> None:
        agent.status, agent.reason, agent.error = status, reason, error
        agent.ended.set()

    def play(self, agent: Agent) -> None:
        try:
            prompt = self.task.prompt(agent.prompt_id)
        except (OSError, ValueError, KeyError) as e:
            with self.lock:
                return self.end(agent, "failed", "error", f"the task cannot start: {type(e).__name__}: {e}")
        while True:
            with self.lock:
                if agent.cancelled:
                    return self.end(agent, "failed", "error", "retired")
                if self.fenced(agent):
                    return self.end(agent, "failed", "error", f"stale attempt {agent.attempt}: fenced")
                if agent.turn >= self.turns:
                    return self.end(agent, "finished")
                turn, url = agent.turn, self.policy_url
                body = dict(agent.policy, prompt=prompt + agent.token_ids, seed=call_seed(agent.seed, turn))
            request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                             headers={"Content-Type": "application/json",
                                                      "Authorization": f"Bearer {self.token}",
                                                      "X-Rolloutdb-Episode": agent.key, "X-Rolloutdb-Turn": str(turn)})
            try:
                with urllib.request.urlopen(request, timeout=600) as resp:
                    choice = json.loads(resp.read(MAX_BODY))["choices"][0]
            except (OSError, ValueError, KeyError, IndexError) as e:
                with self.lock:
                    return self.end(agent, "failed", "error", f"policy call failed: {type(e).__name__}: {e}")
            if choice.get("finish_reason") == "abort":
                with self.lock:
                    return self.end(agent, "failed", "error", "the policy aborted the call")
            with self.lock:  # the whole turn at once: no commit sees it half applied
                if agent.cancelled or self.fenced(agent):
                    continue  # the loop's top ends it, without running the tool
                reply = list(choice["token_ids"])
                observation = run_tool(self.task, agent, reply, f"{agent.episode}/t{turn}", agent.attempt)
                agent.token_ids += reply
                agent.logprobs += list(choice["logprobs"]["token_logprobs"])
                agent.versions += list(choice["policy_versions"])
                agent.finish_reasons.append(str(choice.get("finish_reason")))
                agent.turn += 1
                if agent.turn < self.turns:  # the last observation is never part of the transcript
                    agent.token_ids += observation
                    agent.logprobs += [0.0] * len(observation)
                    agent.versions += [-1] * len(observation)

    def result(self, key: str, query: dict) -> tuple[int, dict]:
        key = need_key(key)
        try:
            wait_s = float(query.get("wait_s", ["0"])[0])
        except ValueError:
            raise Refused(400, "query 'wait_s' must be a number of seconds") from None
        if not 0 <= wait_s <= 60:
            raise Refused(400, "query 'wait_s' must be in [0, 60]")
        agent = self.agent(key)
        agent.ended.wait(wait_s)
        with self.lock:
            out = {"key": key, "status": agent.status, "turn": agent.turn}
            if agent.status == "finished":
                out.update(reward=self.task.reward(agent.state), token_ids=agent.token_ids,
                           logprobs=agent.logprobs, token_versions=agent.versions,
                           finish_reasons=agent.finish_reasons)
            elif agent.status == "failed":
                out.update(reason=agent.reason, error=agent.error)
        return (202 if agent.status == "running" else 200), out

    def agent(self, key: str) -> Agent:
        with self.lock:
            if key not in self.agents:
                raise Refused(404, f"no episode {key} on this server")
            return self.agents[key]

    def forget(self, keys: list[str]) -> int:
        gone = [self.agents.pop(k) for k in keys if k in self.agents]
        for a in gone:
            a.cancelled = True
        return len(gone)

    # ---------------------------------------------------------------- checkpoints

    def current(self, cid) -> None:
        if not isinstance(cid, str) or cid != self.checkpoint_id:
            raise Refused(409, f"checkpoint {cid} is not in progress here (lease expired or replaced); prepare again")

    def end_checkpoint(self) -> None:
        if self.lease is not None:
            self.lease.cancel()
        self.lease, self.checkpoint_id, self.committed = None, None, None

    def expire(self, cid: str) -> None:
        with self.lock:
            if self.checkpoint_id == cid:
                self.lease_expirations += 1
                self.end_checkpoint()

    def checkpoint(self, route: str, body: dict) -> tuple[int, dict]:
        with self.lock:
            if route == "prepare":
                cid = need(body, "checkpoint_id", str)
                lease_s = body.get("lease_s")
                if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not 0 < lease_s <= 3600:
                    raise Refused(400, "field 'lease_s' must be a number in (0, 3600]")
                self.end_checkpoint()
                self.checkpoint_id = cid
                self.lease = threading.Timer(lease_s, self.expire, args=(cid,))
                self.lease.daemon = True
                self.lease.start()
                return 200, {"checkpoint_id": cid, "episodes": len(self.agents)}
            if route == "resume":
                cid = need(body, "checkpoint_id", str)
                resumed = cid == self.checkpoint_id
                if resumed:
                    self.end_checkpoint()
                return 200, {"resumed": resumed}
            self.current(body.get("checkpoint_id"))
            if route == "commit":
                self.committed = {k: a.view() for k, a in self.agents.items() if a.status != "failed"}
                return 200, {"episodes": len(self.committed)}
            if route == "drain":
                return 200, {"drained": True}  # turns are applied under the lock: none is half applied
            if self.committed is None:
                raise Refused(409, "not committed yet; POST /checkpoint/commit first")
            return 200, {"checkpoint_id": self.checkpoint_id, "episodes": self.committed}

    def install(self, body: dict) -> tuple[int, dict]:
        episodes = need(body, "episodes", dict)
        checked = {}
        for key, saved in episodes.items():
            need_key(key, "episodes")
            if not isinstance(saved, dict):
                raise Refused(400, f"episode {key}: must be an object with 'turn', 'state' and a transcript")
            need(saved, "turn", int, 0, self.turns)
            if not isinstance(saved.get("state"), dict) or not self.task.valid_state(saved["state"]):
                raise Refused(400, f"episode {key}: 'state' is not this server's; nothing was installed")
            lists = [saved.get(f) for f in ("token_ids", "logprobs", "token_versions")]
            if not all(isinstance(v, list) for v in lists) or len({len(v) for v in lists}) != 1:
                raise Refused(400, f"episode {key}: give token_ids, logprobs, token_versions of one length")
            checked[key] = saved
        with self.lock:
            for key in checked:
                base, suffix = key.rsplit("-a", 1)
                self.newest[base] = max(self.newest.get(base, -1), int(suffix))
            self.installed.update(checked)
        return 201, {"installed": len(checked)}

    def health(self) -> dict:
        with self.lock:
            return {"status": "ok", "server": "agent-server-minimal", "protocol": PROTOCOL, "mode": "export_restore",
                    "max_turns": self.turns, "episodes": len(self.agents), "installed": len(self.installed),
                    "dispatch": "closed" if self.checkpoint_id else "open", "checkpoint_id": self.checkpoint_id,
                    "lease_expirations": self.lease_expirations, "fencing": True}

    # ---------------------------------------------------------------- routes

    def route(self, method: str, path: str, query: dict, body) -> tuple[int, dict]:
        if method == "GET" and path == "/health":
            return 200, self.health()
        if path.startswith("/episodes/") and method in ("GET", "DELETE"):
            key = path[len("/episodes/"):]
            if method == "GET":
                return self.result(key, query)
            need_key(key)
            with self.lock:
                if self.forget([key]) == 0:
                    raise Refused(404, f"no episode {key} on this server")
            return 200, {"key": key, "forgotten": True}
        if method == "GET" and path == "/checkpoint/export":
            return self.checkpoint("export", {"checkpoint_id": query.get("checkpoint_id", [None])[0]})
        posts = {"/episodes", "/checkpoint/retire", "/checkpoint/prepare", "/checkpoint/commit", "/checkpoint/drain",
                 "/checkpoint/resume", "/agents/install", "/agents/uninstall", "/reset"}
        if path not in posts:
            raise Refused(404 if path not in ("/health", "/checkpoint/export") else 405,
                          f"no such endpoint: {method} {path}")
        if method != "POST":
            raise Refused(405, f"method not allowed: {method} {path}")
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object")
        if path == "/episodes":
            return self.start(body)
        if path.startswith("/checkpoint/") and path != "/checkpoint/retire":
            return self.checkpoint(path.rsplit("/", 1)[1], body)
        if path == "/agents/install":
            return self.install(body)
        keys = body.get("keys", [])
        if path != "/reset":
            if not isinstance(keys, list):
                raise Refused(400, "field 'keys' must be a list of episode keys")
            keys = [need_key(k, "keys") for k in keys]
        with self.lock:
            if path == "/checkpoint/retire":
                for k in keys:
                    self.installed.pop(k, None)
                return 200, {"retired": self.forget(keys)}
            if path == "/agents/uninstall":
                return 200, {"uninstalled": sum(self.installed.pop(k, None) is not None for k in keys)}
            n = self.forget(list(self.agents))
            self.installed.clear()
            self.newest.clear()  # a resumed controller resets first, then registers newer attempts
            self.end_checkpoint()
            self.policy_url = None
            return 200, {"forgotten": n}


def handler(server: Server):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # noqa: A002
            pass

        def answer(self) -> None:
            status, out = 500, {"error": "internal error"}
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY:
                    raise Refused(413, f"request body larger than {MAX_BODY} bytes")
                raw = self.rfile.read(length) if length else b""
                given = self.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {server.token}".encode()):
                    raise Refused(401, "no bearer token or a wrong one: send Authorization: Bearer <token>")
                url = urlsplit(self.path)
                body = None
                if self.command == "POST":
                    try:
                        body = json.loads(raw) if raw else None
                    except (ValueError, RecursionError):
                        raise Refused(400, "the body is not JSON") from None
                status, out = server.route(self.command, url.path, parse_qs(url.query), body)
            except Refused as e:
                status, out = e.status, {"error": e.message}
            except Exception as e:  # noqa: BLE001 - never a traceback to the client
                status, out = 500, {"error": f"internal error: {type(e).__name__}: {e}"}
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = do_PUT = answer

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A minimal rolloutdb agent server (standard library only).")
    ap.add_argument("--token-file", required=True, help="a file (mode 0600) holding the bearer token")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=64, help="prompt ids 0..PROMPTS-1 are accepted")
    ap.add_argument("--policy-dir", default=None, help="run the built-in digits copy task with this run's policy "
                    "tokenizer (RUN_DIR/policy); without it, the toy task")
    ap.add_argument("--n-digits", type=int, default=2, help="digits task: environment.n_digits")
    ap.add_argument("--seed", type=int, default=0, help="digits task: run.seed")
    args = ap.parse_args(argv)
    task = None
    if args.policy_dir:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from digits_task import DigitsCopyTask

        task = DigitsCopyTask(Path(args.policy_dir), turns=args.turns, n_digits=args.n_digits, seed=args.seed)
    try:
        if os.stat(args.token_file).st_mode & 0o077:
            raise ValueError(f"{args.token_file} can be read by other users; chmod 600 it")
        token = open(args.token_file, encoding="ascii").read().strip()
    except (OSError, ValueError) as e:
        print(f"agent-server-minimal: {e}", file=sys.stderr)
        return 2
    httpd = ThreadingHTTPServer((args.host, args.port), handler(Server(token, args.turns, args.prompts, task)))
    httpd.daemon_threads = True
    print(f"rolloutdb-agent-server listening on http://{args.host}:{httpd.server_address[1]}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
