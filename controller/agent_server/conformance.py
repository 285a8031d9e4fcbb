"""The conformance kit: drive any agent server through the protocol of
docs/agent_server.md over HTTP and check the guarantees it promises, each a named check.

    results = run_kit("http://127.0.0.1:8700", token, restart_cmd=None)
    print(results_table(results))

(or `rolloutdb conformance URL`). The kit serves its own deterministic policy endpoint
(`conformance_policy.FixedPolicy`) and names it in every `POST /episodes`, so the server
must call the policy endpoint an episode names (a server started with a fixed
`--policy-url` elsewhere answers 403). It sends `POST /reset` before and after each check:
run it against a server no controller is using.

It talks HTTP only: of the controller it imports nothing but the protocol's constants.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rolloutdb.controller.agent_server.conformance_policy import Answer, FixedPolicy, ServerClient
from rolloutdb.controller.agent_server.wire import PROTOCOL

TRANSCRIPT = ("turn", "state", "token_ids", "logprobs", "token_versions")


@dataclass(frozen=True)
class Result:
    guarantee: str
    status: str  # pass | fail | skipped
    detail: str = ""  # what was wrong (fail) or why it did not run (skipped)
    request: str = ""  # the request that failed
    got: str = ""  # what came back


class Failed(Exception):
    def __init__(self, detail: str, answer: Answer | None = None):
        super().__init__(detail)
        self.detail = detail
        self.answer = answer


class Skipped(Exception):
    pass


def _shown(answer: Answer | None) -> tuple[str, str]:
    if answer is None:
        return "", ""
    body = answer.body if isinstance(answer.body, str) else json.dumps(answer.body)
    return answer.request[:300], f"{answer.status} {body[:300]}"


class Kit:
    """One run of every check against the server at `url`."""

    def __init__(self, url: str, token: str | None, *, restart_cmd: str | None = None, lease_s: float = 1.0,
                 timeout: float = 30.0):
        self.client = ServerClient(url, token)
        self.token = token or ""
        self.restart_cmd = restart_cmd
        self.lease_s = lease_s
        self.timeout = timeout
        self.health: dict = {}
        self.policy: FixedPolicy | None = None
        self._group = 9_000_000 + int(time.time()) % 1_000_000  # keys no controller of this server has used

    # ------------------------------------------------------------------ helpers

    def call(self, method: str, path: str, body: Any = None, *, want: int | tuple[int, ...] | None = None,
             what: str = "", **kw) -> Answer:
        answer = self.client.call(method, path, body, **kw)
        wanted = (want,) if isinstance(want, int) else want
        if wanted is not None and answer.status not in wanted:
            raise Failed(what or f"expected {' or '.join(map(str, wanted))}", answer)
        return answer

    def key(self, generation: int = 0, attempt: int = 0) -> str:
        return f"{self._group}.{generation}-a{attempt}"

    def next_group(self) -> None:
        self._group += 1

    def start(self, key: str, *, continue_from: str | None = None, prompt_id: int = 1, want: Any = 201,
              what: str = "") -> Answer:
        episode, attempt = key.rsplit("-a", 1)
        body: dict[str, Any] = {"key": key, "episode": episode, "attempt": int(attempt), "prompt_id": prompt_id,
                                "seed": 12345, "policy": {"url": self.policy_url, "max_tokens": 2,
                                                          "temperature": 1.0}}
        if continue_from is not None:
            body["continue_from"] = continue_from
        return self.call("POST", "/episodes", body, want=want, what=what or f"POST /episodes {key}")

    @property
    def policy_url(self) -> str:
        assert self.policy is not None
        return self.policy.url

    def wait_call(self, key: str, turn: int) -> None:
        assert self.policy is not None
        if not self.policy.wait_calls(lambda calls: any(c.key == key and c.turn == turn for c in calls), self.timeout):
            raise Failed(f"episode {key} never called the policy for turn {turn} within {self.timeout:g} s")

    def wait_end(self, key: str) -> Answer:
        deadline = time.monotonic() + self.timeout
        while True:
            answer = self.call("GET", f"/episodes/{key}?wait_s=1", want=(200, 202))
            if answer.status == 200 or time.monotonic() > deadline:
                return answer

    def checkpoint(self, lease_s: float = 60.0) -> dict:
        """prepare, commit, drain, export, resume: the export's episodes."""
        cid = uuid.uuid4().hex[:12]
        self.call("POST", "/checkpoint/prepare", {"checkpoint_id": cid, "lease_s": lease_s}, want=200)
        try:
            self.call("POST", "/checkpoint/commit", {"checkpoint_id": cid}, want=200)
            self.call("POST", "/checkpoint/drain", {"checkpoint_id": cid}, want=200)
            got = self.call("GET", f"/checkpoint/export?checkpoint_id={cid}", want=200)
        finally:
            self.call("POST", "/checkpoint/resume", {"checkpoint_id": cid})
        return self.episodes(got)

    def episodes(self, answer: Answer) -> dict:
        if not isinstance(answer.body, dict) or not isinstance(answer.body.get("episodes"), dict):
            raise Failed("an export is an object with 'episodes', an object keyed by episode key", answer)
        return answer.body["episodes"]

    def held_agent(self, key: str, turn: int = 1) -> dict:
        """Start `key`, hold its call of `turn`, and export it: the agent at that turn."""
        assert self.policy is not None
        self.policy.hold(lambda k, t: k == key and t >= turn)
        self.start(key)
        self.wait_call(key, turn)
        exported = self.checkpoint()
        if key not in exported:
            raise Failed(f"the export lacks episode {key}, running at turn {turn} (its call held by the kit)")
        agent = exported[key]
        if not isinstance(agent, dict) or agent.get("turn") != turn:
            raise Failed(f"the export holds {key} at turn {agent.get('turn') if isinstance(agent, dict) else agent!r}"
                         f"; it had finished {turn} turns when the checkpoint was taken")
        return agent

    def needs_export(self, turns: int = 2) -> None:
        mode = self.health.get("mode")
        if mode != "export_restore":
            raise Skipped(f"the server runs mode {mode!r}: it exports nothing (export_restore only)")
        max_turns = self.health.get("max_turns")
        if isinstance(max_turns, int) and max_turns < turns:
            raise Skipped(f"needs a task of at least {turns} turns; GET /health says max_turns {max_turns}")

    # ------------------------------------------------------------------ checks

    def check_health(self) -> None:
        answer = self.call("GET", "/health", want=200, what="GET /health answers 200")
        body = answer.body if isinstance(answer.body, dict) else {}
        if body.get("protocol") != PROTOCOL:
            raise Failed(f"GET /health must report \"protocol\": {PROTOCOL}", answer)
        if body.get("mode") not in ("export_restore", "restart_only", "stateless"):
            raise Failed("GET /health must report its mode: export_restore, restart_only or stateless", answer)
        self.health = body

    def check_export_equals_restore(self) -> None:
        self.needs_export()
        assert self.policy is not None
        k0, k1 = self.key(0, 0), self.key(0, 1)
        exported = self.held_agent(k0)
        first = self.policy.calls_of(k0)[-1]
        self.call("POST", "/checkpoint/retire", {"keys": [k0]}, want=200)
        self.policy.hold(lambda k, t: k == k1)
        self.call("POST", "/agents/install", {"episodes": {k0: exported}}, want=201)
        started = self.start(k1, continue_from=k0)
        if not isinstance(started.body, dict) or started.body.get("turn") != exported["turn"]:
            raise Failed(f"an episode continued from an agent exported at turn {exported['turn']} must start there",
                         started)
        self.wait_call(k1, exported["turn"])
        again = self.policy.calls_of(k1)[0]
        if (again.turn, again.prompt, again.seed) != (first.turn, first.prompt, first.seed):
            raise Failed(f"the restored agent's first call (turn {again.turn}, {len(again.prompt)} prompt tokens, seed "
                         f"{again.seed}) is not the call it was exported at (turn {first.turn}, {len(first.prompt)} "
                         f"tokens, seed {first.seed})")
        restored = self.checkpoint().get(k1)
        differ = [f for f in TRANSCRIPT if not isinstance(restored, dict) or restored.get(f) != exported.get(f)]
        if differ:
            raise Failed(f"exported again before any turn, the restored agent {k1} differs from what was installed "
                         f"in {', '.join(differ)}: {json.dumps(restored)[:200]}")

    def check_export_is_the_commit_copy(self) -> None:
        self.needs_export(3)
        assert self.policy is not None
        k = self.key()
        self.policy.hold(lambda key, t: t >= 1)
        self.start(k)
        self.wait_call(k, 1)
        frozen = self.checkpoint().get(k)  # the agent at turn 1, taken while nothing moves
        cid = uuid.uuid4().hex[:12]
        self.call("POST", "/checkpoint/prepare", {"checkpoint_id": cid, "lease_s": 60}, want=200)
        try:
            self.call("GET", f"/checkpoint/export?checkpoint_id={cid}", want=409,
                      what="an export before commit must be refused (409: not committed yet)")
            self.call("POST", "/checkpoint/commit", {"checkpoint_id": cid}, want=200)
            self.policy.hold(lambda key, t: t >= 2)  # turn 1 is played after the commit
            self.wait_call(k, 2)
            self.call("POST", "/checkpoint/drain", {"checkpoint_id": cid}, want=200)
            answer = self.call("GET", f"/checkpoint/export?checkpoint_id={cid}", want=200)
            agent = self.episodes(answer).get(k)
            differ = [f for f in TRANSCRIPT if not isinstance(agent, dict) or not isinstance(frozen, dict)
                      or agent.get(f) != frozen.get(f)]
            if differ:
                raise Failed(f"episode {k} had finished 1 turn at commit and 2 at export; the export must be the "
                             f"copy commit took, never turns played after it (differs in {', '.join(differ)})", answer)
        finally:
            self.call("POST", "/checkpoint/resume", {"checkpoint_id": cid})

    def check_lease_releases_dispatch(self) -> None:
        self.needs_export(1)
        cid = uuid.uuid4().hex[:12]
        self.call("POST", "/checkpoint/prepare", {"checkpoint_id": cid, "lease_s": self.lease_s}, want=200)
        closed = self.start(self.key(0, 0), want=409, what="registration must close at prepare (409)")
        error = closed.body.get("error") if isinstance(closed.body, dict) else None
        if not isinstance(error, str) or not error.startswith("dispatch is closed"):
            raise Failed("a registration refused while a checkpoint holds dispatch must say 'dispatch is closed'",
                         closed)
        deadline = time.monotonic() + self.lease_s + 5.0
        while True:
            answer = self.start(self.key(0, 1), want=None)
            if answer.status == 201:
                break
            if time.monotonic() > deadline:
                raise Failed(f"the lease of {self.lease_s:g} s expired without resume, yet dispatch is still closed "
                             f"{self.lease_s + 5:g} s after prepare", answer)
            time.sleep(0.1)
        self.call("POST", "/checkpoint/commit", {"checkpoint_id": cid}, want=409,
                  what="a commit after the lease expired must be refused (409: stale checkpoint)")

    def check_retired_key_never_returns(self) -> None:
        self.needs_export()
        k = self.key()
        agent = self.held_agent(k)
        self.call("POST", "/checkpoint/retire", {"keys": [k]}, want=200)
        self.call("GET", f"/episodes/{k}", want=404, what=f"a retired episode {k} must be gone (404)")
        self.call("POST", "/agents/install", {"episodes": {k: agent}}, want=201)
        self.call("POST", "/checkpoint/retire", {"keys": [k]}, want=200)
        self.start(self.key(0, 1), continue_from=k, want=404,
                   what=f"an installed agent {k} that was retired must not be continued (404)")
        exported = self.checkpoint()
        if k in exported or self.key(0, 1) in exported:
            raise Failed(f"the export after retiring {k} still holds it: {sorted(exported)[:5]}")

    def check_restored_twice_not_duplicated(self) -> None:
        self.needs_export()
        k, k1, k2 = self.key(0, 0), self.key(0, 1), self.key(0, 2)
        agent = self.held_agent(k)
        self.call("POST", "/checkpoint/retire", {"keys": [k]}, want=200)
        for _ in range(2):
            self.call("POST", "/agents/install", {"episodes": {k: agent}}, want=201)
        self.start(k1, continue_from=k)
        self.start(k2, continue_from=k, want=404,
                   what=f"an agent installed twice is continued once: a second continue_from {k} must be 404")
        mine = [key for key in self.checkpoint() if key.startswith(f"{self._group}.")]
        if mine != [k1]:
            raise Failed(f"after installing {k} twice and continuing it once the export holds {mine}, not [{k1}]")

    def check_killed_between_prepare_and_commit(self) -> None:
        self.needs_export()
        if not self.restart_cmd:
            raise Skipped("give --restart-cmd (a command that kills the server hard and starts it at the same URL)")
        assert self.policy is not None
        k, k1 = self.key(0, 0), self.key(0, 1)
        committed = self.held_agent(k)
        cid = uuid.uuid4().hex[:12]
        self.call("POST", "/checkpoint/prepare", {"checkpoint_id": cid, "lease_s": 60}, want=200)
        done = subprocess.run(self.restart_cmd, shell=True, timeout=300, capture_output=True, text=True)
        if done.returncode != 0:
            raise Failed(f"--restart-cmd exited {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}")
        deadline = time.monotonic() + 120
        while not self.client.alive():
            if time.monotonic() > deadline:
                raise Failed("the server did not answer GET /health within 120 s of --restart-cmd")
            time.sleep(0.2)
        self.call("POST", "/checkpoint/commit", {"checkpoint_id": cid}, want=409,
                  what="a commit of a checkpoint prepared before the restart must be refused (409)")
        self.call("POST", "/reset", {}, want=200)
        self.policy.hold(lambda key, t: key == k1)
        self.call("POST", "/agents/install", {"episodes": {k: committed}}, want=201)
        self.start(k1, continue_from=k)
        self.wait_call(k1, committed["turn"])
        restored = self.checkpoint().get(k1)
        differ = [f for f in TRANSCRIPT if not isinstance(restored, dict) or restored.get(f) != committed.get(f)]
        if differ:
            raise Failed(f"after the restart the agent committed before it continues with other {', '.join(differ)}")

    def check_malformed_requests_get_4xx(self) -> None:
        key = self.key()
        good = {"key": key, "prompt_id": 1, "seed": 1, "policy": {"url": self.policy_url, "max_tokens": 2}}
        cases: list[tuple[str, str, dict]] = [
            ("POST", "/episodes", {"raw": b"{not json"}),
            ("POST", "/episodes", {"raw": b"[1, 2]"}),
            ("POST", "/episodes", {"raw": b""}),
            ("POST", "/episodes", {"body": {}}),
            ("POST", "/episodes", {"body": {**good, "key": "not-a-key"}}),
            ("POST", "/episodes", {"body": {**good, "prompt_id": "1"}}),
            ("POST", "/episodes", {"body": {**good, "seed": True}}),
            ("POST", "/episodes", {"body": {**good, "policy": {"url": self.policy_url, "max_tokens": -1}}}),
            ("GET", "/episodes/not-a-key", {}),
            ("GET", f"/episodes/{key}?wait_s=soon", {}),
            ("DELETE", f"/episodes/{key}", {}),
            ("POST", "/checkpoint/retire", {"body": {"keys": "all"}}),
            ("POST", "/checkpoint/prepare", {"body": {"checkpoint_id": 5, "lease_s": 1}}),
            ("POST", "/checkpoint/commit", {"body": {"checkpoint_id": "never-prepared"}}),
            ("POST", "/checkpoint/drain", {"raw": b"{]"}),
            ("GET", "/checkpoint/export", {}),
            ("POST", "/agents/install", {"body": {"episodes": {key: "an agent"}}}),
            ("POST", "/agents/uninstall", {"body": {"keys": [1, 2]}}),
            ("POST", "/reset", {"raw": b"reset please"}),
            ("GET", "/no/such/route", {}),
            ("GET", "/health", {"token": False}),
        ]
        for method, path, kw in cases:
            answer = self.client.call(method, path, kw.get("body"), raw=kw.get("raw"), token=kw.get("token", True))
            body = answer.body
            if not 400 <= answer.status < 500:
                raise Failed("a malformed request must get a 4xx", answer)
            if not (isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"].strip()
                    and "\n" not in body["error"]):
                raise Failed("a refusal's body must be {\"error\": \"<one line>\"}", answer)

    def check_fencing(self) -> None:
        if self.health.get("fencing") is not True:
            raise Skipped("not implemented (GET /health lacks \"fencing\": true)")
        assert self.policy is not None
        new, old = self.key(0, 1), self.key(0, 0)
        self.policy.hold(lambda key, t: t >= 1)
        self.start(new)
        refused = self.start(old, want=409, what="attempt 0 after attempt 1 of the same episode must be refused (409)")
        error = refused.body.get("error") if isinstance(refused.body, dict) else None
        if not isinstance(error, str) or not error.startswith("stale attempt"):
            raise Failed("a fenced registration's error must start with 'stale attempt'", refused)
        self.next_group()
        old, new = self.key(0, 0), self.key(0, 1)
        self.policy.hold(lambda key, t: t >= 1)
        self.start(old)
        self.wait_call(old, 1)
        self.start(new)  # a newer attempt of the running episode: `old` must play no further turn
        self.policy.hold(lambda key, t: key != old and t >= 1)
        ended = self.wait_end(old)
        status = ended.body.get("status") if isinstance(ended.body, dict) else None
        later = [c.turn for c in self.policy.calls_of(old) if c.turn > 1]
        if status != "failed" or later:
            raise Failed(f"attempt 0 went on after attempt 1 of its episode registered (status {status!r}, calls of "
                         f"turns {later}); it must stop without running the turn's tool", ended)
        self.call("POST", "/reset", {}, want=200)
        self.start(self.key(0, 0), what="after POST /reset the server forgets the attempts it saw")

    CHECKS: tuple[tuple[str, str], ...] = (
        ("export_equals_restore", "check_export_equals_restore"),
        ("export_is_the_commit_copy", "check_export_is_the_commit_copy"),
        ("lease_releases_dispatch", "check_lease_releases_dispatch"),
        ("retired_key_never_returns", "check_retired_key_never_returns"),
        ("restored_twice_not_duplicated", "check_restored_twice_not_duplicated"),
        ("killed_between_prepare_and_commit", "check_killed_between_prepare_and_commit"),
        ("malformed_requests_get_4xx", "check_malformed_requests_get_4xx"),
        ("fencing", "check_fencing"),
    )

    def run(self, only: Callable[[str], bool] | None = None) -> list[Result]:
        results = [self._one("health", self.check_health)]
        if results[0].status != "pass":
            return results + [Result(name, "skipped", "GET /health failed") for name, _ in self.CHECKS]
        self.policy = FixedPolicy(self.token)
        try:
            for name, method in self.CHECKS:
                if only is None or only(name):
                    results.append(self._one(name, getattr(self, method)))
        finally:
            self.policy.close()
        return results

    def _one(self, name: str, check: Callable[[], None]) -> Result:
        self.next_group()
        try:
            if self.policy is not None:
                self.call("POST", "/reset", {}, want=200, what="POST /reset {} must answer 200")
            check()
            return Result(name, "pass")
        except Skipped as e:
            return Result(name, "skipped", str(e))
        except Failed as e:
            request, got = _shown(e.answer)
            return Result(name, "fail", e.detail, request, got)
        except (OSError, subprocess.TimeoutExpired) as e:
            return Result(name, "fail", f"the server did not answer: {type(e).__name__}: {e}")
        finally:
            if self.policy is not None:
                self.policy.release()
                try:
                    self.client.call("POST", "/reset", {}, timeout=10)
                except OSError:
                    pass


GUARANTEES = ("health",) + tuple(name for name, _ in Kit.CHECKS)


def run_kit(url: str, token: str | None, *, restart_cmd: str | None = None, lease_s: float = 1.0,
            timeout: float = 30.0) -> list[Result]:
    """Every check against the server at `url`, in order; `health` first."""
    return Kit(url, token, restart_cmd=restart_cmd, lease_s=lease_s, timeout=timeout).run()


def failed(results: list[Result]) -> list[str]:
    return [r.guarantee for r in results if r.status == "fail"]


def results_table(results: list[Result]) -> str:
    rows = [("guarantee", "result", "what", "request", "got")]
    rows += [(r.guarantee, r.status, r.detail, r.request, r.got) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = []
    for row in rows:
        line = f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}"
        extra = "  ".join(part for part in row[2:] if part)
        lines.append((line + "  " + extra).rstrip())
    return "\n".join(lines)


def results_json(results: list[Result]) -> str:
    return json.dumps({"ok": not failed(results), "results": [asdict(r) for r in results]})
