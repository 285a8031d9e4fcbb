"""The controller's side of its agent servers: episodes run on them (`AgentPool`) and
their checkpoint protocol over HTTP (`HttpEnvironmentCheckpoint`).

An episode on a server, as the rollout pump sees it: `AgentPool.run(...)` returns a
`concurrent.futures.Future` of an `EpisodeOutcome` (the engine's `submit` shape, so the
pump's completion queue takes both). Behind it, on the `rolloutdb-http` loop:
register the episode (`POST /episodes`, retried while a checkpoint holds dispatch),
long-poll its result (`GET /episodes/{key}?wait_s=30`), then forget it on the server
(`DELETE`). The key is the ledger's episode key `<group>.<generation>-a<attempt>`; the
policy endpoint refuses model calls of any key the pool is not running.

A server that stops answering (killed, crashed) fails every episode it held with outcome
`error`; the pump abandons those attempts (reason `error`) and starts new ones, and the
first new one to reach the server restarts it (a server the controller owns) or waits
for it to come back (a server at a configured URL), once, under a lock.

Why `acknowledged`: a snapshot's export must hold every attempt the server had accepted
before the checkpoint began and the ledger still runs at the cut. An attempt leaves the
set when its outcome arrives, before the `DELETE`: so an attempt missing from the export
is one the server lost, never one the pump is about to commit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector

from rolloutdb.controller.agent_server import auth, fencing, wire
from rolloutdb.controller.agent_server.http_loop import HttpLoop
from rolloutdb.controller.agent_server.policy_endpoint import PolicyEndpoint
from rolloutdb.controller.agent_server.process import ServerProcess
from rolloutdb.controller.rollout.agent_episodes import EpisodeOutcome
from rolloutdb.gpu_capture.protocol import SamplingParams

log = logging.getLogger("rolloutdb.controller")

LONG_POLL_S = 30.0
CLOSED_RETRY_S = 0.02  # registration retry while a checkpoint holds dispatch


class ServerDown(Exception):
    """The server did not answer (refused, reset, timed out)."""


class AgentProtocolError(RuntimeError):
    """The server answered something the protocol does not allow: a bug on one side; the run stops."""


class EnvironmentPhaseError(RuntimeError):
    """A checkpoint call failed: the snapshot attempt fails, the run goes on."""


class AgentServerClient:
    """One configured server: its URL, its process (when the controller owns it), the
    episodes it acknowledged."""

    def __init__(self, spec, pool: AgentPool, process: ServerProcess | None, token: str):
        self.spec = spec
        self.headers = auth.header(token)
        self.name = spec.name
        self.pool = pool
        self.process = process
        self.url = spec.url.rstrip("/") if spec.url else ""
        self.acknowledged: set[str] = set()
        self.suspect = False  # a request failed: check (and restart) before the next one
        self.restarts = 0
        self._lock: asyncio.Lock | None = None

    # ---------------------------------------------------------------- transport

    async def call(self, method: str, path: str, body: dict | None = None, query: dict | None = None,
                   timeout: float = 30.0) -> tuple[int, Any]:
        try:
            async with self.pool.session.request(method, self.url + path, json=body, params=query,
                                                 headers=self.headers, allow_redirects=False,
                                                 timeout=ClientTimeout(total=timeout)) as resp:
                data = await wire.read_answer(resp)
                return resp.status, data
        except (ClientError, asyncio.TimeoutError, ConnectionError, ValueError) as e:
            self.suspect = True
            raise ServerDown(f"agent server {self.name} at {self.url} did not answer {method} {path}: "
                             f"{type(e).__name__}: {e}") from None

    def _refused(self, what: str, status: int, data: Any) -> str:
        reason = data.get("error") if isinstance(data, dict) else str(data)[:200]
        return f"agent server {self.name}: {what} answered {status}: {reason}"

    async def health(self) -> dict | None:
        try:
            status, data = await self.call("GET", "/health", timeout=5.0)
        except ServerDown:
            return None
        return data if status == 200 and isinstance(data, dict) else None

    def check_health(self, h: dict) -> None:
        """The server is one this protocol version talks to, in the configured mode."""
        if h.get("protocol") != wire.PROTOCOL:
            raise ValueError(f"environment.servers: {self.name} at {self.url} speaks protocol {h.get('protocol')!r}, "
                             f"this controller {wire.PROTOCOL}; run a matching agent server")
        if h.get("mode") != self.spec.mode:
            raise ValueError(f"environment.servers: {self.name} at {self.url} runs mode {h.get('mode')!r} but the "
                             f"config says {self.spec.mode!r}; start the server in that mode or change the config")

    async def ensure_up(self) -> None:
        """After a failed request: return once the server answers /health, restarting
        a server the controller owns (once, whoever asks first)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if not self.suspect:
                return
            if await self.health() is not None:
                self.suspect = False
                return
            if self.process is not None:
                log.warning("rolloutdb: agent server %s stopped answering; restarting it", self.name)
                self.url = await asyncio.get_running_loop().run_in_executor(None, self.process.start)
                self.restarts += 1
                self.pool.note(kind="agent_server_restart", server=self.name, url=self.url, restarts=self.restarts)
            deadline = time.monotonic() + self.spec.start_timeout_s
            while time.monotonic() < deadline:
                h = await self.health()
                if h is not None:
                    self.check_health(h)
                    self.suspect = False
                    return
                await asyncio.sleep(0.5)
            raise AgentProtocolError(f"agent server {self.name} at {self.url} did not come back within "
                                     f"{self.spec.start_timeout_s:g} s (environment.servers.start_timeout_s)")

    # ---------------------------------------------------------------- episodes

    async def run_episode(self, key: str, prompt_id: int, seed: int, params: SamplingParams,
                          continue_from: str | None) -> EpisodeOutcome:
        if self.suspect:
            await self.ensure_up()
        policy = wire.completion_body([0], params)
        policy.pop("prompt"), policy.pop("model")
        body: dict[str, Any] = {"key": key, **fencing.identity(key), "prompt_id": prompt_id, "seed": seed,
                                "policy": {"url": self.pool.policy_url, **policy}}
        restarted = False
        if continue_from is not None:
            body["continue_from"] = continue_from
        try:
            while True:
                status, data = await self.call("POST", "/episodes", body)
                if status == 201:
                    break
                error = data.get("error", "") if isinstance(data, dict) else ""
                if status == 409 and error.startswith("dispatch is closed"):
                    await asyncio.sleep(CLOSED_RETRY_S)
                    continue
                if status == 404 and "continue_from" in body:
                    # The server lost what the restore installed (it restarted): start over.
                    body.pop("continue_from")
                    restarted = True
                    continue
                raise AgentProtocolError(self._refused(f"POST /episodes for {key}", status, data))
            self.acknowledged.add(key)
            while True:
                status, data = await self.call("GET", f"/episodes/{key}", query={"wait_s": str(LONG_POLL_S)},
                                               timeout=LONG_POLL_S + 15)
                if status == 202:
                    continue
                if status == 200:
                    break
                if status == 404:
                    return EpisodeOutcome("error", self.name, error=self._refused(f"GET /episodes/{key}", status, data))
                raise AgentProtocolError(self._refused(f"GET /episodes/{key}", status, data))
        except ServerDown as e:
            return EpisodeOutcome("error", self.name, error=str(e))
        finally:
            self.acknowledged.discard(key)
        asyncio.get_running_loop().create_task(self._forget(key))
        return self._outcome(key, data, restarted)

    async def _forget(self, key: str) -> None:
        # RuntimeError: the pool closed its session at the end of the run meanwhile.
        with contextlib.suppress(ServerDown, RuntimeError):
            await self.call("DELETE", f"/episodes/{key}")

    def _outcome(self, key: str, data: Any, restarted: bool) -> EpisodeOutcome:
        if not isinstance(data, dict) or data.get("key") != key:
            raise AgentProtocolError(f"agent server {self.name}: the result of {key} names another episode")
        if data.get("status") == "failed":
            reason = data.get("reason") if data.get("reason") in ("error", "deadline") else "error"
            return EpisodeOutcome(reason, self.name, turn=int(data.get("turn") or 0),
                                  error=f"agent server {self.name}: {data.get('error')}", restarted=restarted)
        if data.get("status") != "finished":
            raise AgentProtocolError(f"agent server {self.name}: episode {key} has status {data.get('status')!r}")
        try:
            saved = wire.agent_state({**data, "state": {}}, key)
            reward = wire.want(data, "reward", float)
        except wire.HttpError as e:
            raise AgentProtocolError(f"agent server {self.name}: the result of {key} is malformed: {e.message}") from None
        if "token_ids" not in saved:
            raise AgentProtocolError(f"agent server {self.name}: the result of {key} has no transcript")
        return EpisodeOutcome("finished", self.name, turn=saved["turn"], reward=reward, token_ids=saved["token_ids"],
                              logprobs=saved["logprobs"], token_versions=saved["token_versions"],
                              finish_reasons=[str(r) for r in data.get("finish_reasons") or []], restarted=restarted)


class AgentPool:
    """The run's agent servers and its policy endpoint, on one HTTP loop."""

    def __init__(self, config, engine, *, config_path: Path, policy_dir: Path, log_dir: Path, token_path: Path,
                 log_event: Callable[[dict], None] | None = None):
        self.config = config
        # One token per server: its token_file's (a server at a url started with it), else
        # the run's, fresh at every start (written only when a server needs it).
        tokens = {s.name: auth.read_token_file(s.token_file, f"environment.servers: {s.name}: token_file")
                  for s in config.environment.servers if s.token_file}
        if len(tokens) < len(config.environment.servers):
            run_token = auth.write_run_token(token_path)
            tokens = {s.name: tokens.get(s.name, run_token) for s in config.environment.servers}
        self.http = HttpLoop()
        self._owners: dict[str, Any] = {}
        self.on_call: Callable[[Any, int, Any, int], None] | None = None
        self.log_event = log_event
        # key -> (turn, prefix): a restored call's output so far, for the episode's first call
        self._prefixes: dict[str, tuple[int, Any]] = {}
        self.endpoint = PolicyEndpoint(engine, self.http, owner=self._owners.get, tokens=sorted(set(tokens.values())),
                                       on_call=self._served,
                                       prefix_for=self._take_prefix, on_splice=self._spliced)
        self.session: ClientSession = self.http.call(self._open_session())
        self.policy_url = ""
        self.clients: list[AgentServerClient] = []
        self._closed = False
        for spec in config.environment.servers:
            process = None if spec.url else ServerProcess(
                config_path=config_path, name=spec.name, policy_dir=policy_dir, token=tokens[spec.name],
                log_path=Path(log_dir) / f"agent_server_{spec.name}.log", start_timeout_s=spec.start_timeout_s)
            self.clients.append(AgentServerClient(spec, self, process, tokens[spec.name]))

    async def _open_session(self) -> ClientSession:
        return ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=None))

    def note(self, **event) -> None:
        if self.log_event is not None:
            self.log_event({**event, "t": time.time()})

    def _served(self, owner: Any, turn: int, result: Any, prefix_tokens: int = 0) -> None:
        if self.on_call is not None:
            self.on_call(owner, turn, result, prefix_tokens)

    def _take_prefix(self, key: str) -> tuple[int, Any] | None:
        # Popped by the episode's first call, whatever its turn: an agent that restarted
        # from turn 0 instead (its server lost the installed agent) never reaches the
        # saved call with the same conversation.
        return self._prefixes.pop(key, None)

    def _spliced(self, key: str, turn: int, prefix_tokens: int, result: Any, reason: str | None) -> None:
        """The metrics line of a restored prefix at its episode's first call: spliced
        (`reason` None; `engine_prefix_tokens` is what the engine reports it continued
        from), or dropped with the reason."""
        self.note(kind="agent_prefix", key=key, turn=turn, prefix_tokens=prefix_tokens, spliced=reason is None,
                  reason=reason, tokens=None if result is None else len(result.token_ids),
                  engine_prefix_tokens=None if result is None else (result.extra or {}).get("num_prefix_tokens"))

    # ---------------------------------------------------------------- life

    def start(self) -> None:
        """Serve the policy, start (or reach) every server, check its health and mode,
        and reset it (a server that outlived an earlier controller forgets that run's
        episodes; a restore installs what it needs afterwards)."""
        try:
            self.policy_url = self.endpoint.start()
            owned = [c for c in self.clients if c.process is not None]
            for c in owned:
                if c.process is not None:
                    c.process.policy_url = self.policy_url  # the only endpoint it may call
            with ThreadPoolExecutor(max(1, len(owned)), thread_name_prefix="rolloutdb-agent-start") as pool:
                for c, url in zip(owned, pool.map(lambda c: c.process.start(), owned)):
                    c.url = url
            for c in self.clients:
                self.http.call(self._connect(c), timeout=c.spec.start_timeout_s + 10)
        except BaseException:
            self.close()
            raise

    async def _connect(self, c: AgentServerClient) -> None:
        deadline = time.monotonic() + c.spec.start_timeout_s
        while (h := await c.health()) is None:
            if time.monotonic() > deadline:
                raise ValueError(f"environment.servers: {c.name} at {c.url} did not answer GET /health within "
                                 f"{c.spec.start_timeout_s:g} s; start it, or fix its url")
            await asyncio.sleep(0.25)
        c.check_health(h)
        c.suspect = False
        status, data = await c.call("POST", "/reset", {})
        if status != 200:
            raise ValueError(c._refused("POST /reset", status, data))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.endpoint.close()
        with contextlib.suppress(Exception):
            self.http.call(self.session.close(), timeout=10)
        for c in self.clients:
            if c.process is not None:
                c.process.stop()
        self.http.close()

    # ---------------------------------------------------------------- episodes

    def server_for(self, prompt_id: int) -> AgentServerClient:
        """A prompt always meets the same server (its id modulo the number of servers)."""
        return self.clients[prompt_id % len(self.clients)]

    def exports(self, prompt_id: int) -> bool:
        return self.server_for(prompt_id).spec.mode == "export_restore"

    def continues_prefix(self, prompt_id: int, continued: bool) -> bool:
        """Whether a restored call's prefix applies to this prompt's new attempt: an
        `export_restore` server's agent continued from its export (`continued`), or a
        `stateless` server's episode (one turn, restarted identically). A `restart_only`
        server's never (the cut saves none)."""
        mode = self.server_for(prompt_id).spec.mode
        return (mode == "export_restore" and continued) or mode == "stateless"

    def run(self, owner: Any, *, key: str, prompt_id: int, seed: int, params: SamplingParams,
            continue_from: str | None = None, prefix: Any = None, prefix_turn: int = 0) -> concurrent.futures.Future:
        """Run one attempt's episode on its server; the future's result is an `EpisodeOutcome`.
        `prefix` (a `CallPrefix`): the output its call of turn `prefix_turn` had decoded at
        the restored cut; the policy endpoint continues that call from it."""
        self._owners[key] = owner
        if prefix is not None:
            self._prefixes[key] = (prefix_turn, prefix)
        future = self.http.submit(self.server_for(prompt_id).run_episode(key, prompt_id, seed, params, continue_from))
        future.add_done_callback(lambda _f: (self._owners.pop(key, None), self._prefixes.pop(key, None)))
        return future

    def checkpoint(self) -> HttpEnvironmentCheckpoint:
        return HttpEnvironmentCheckpoint(self)


class HttpEnvironmentCheckpoint:
    """`EnvironmentCheckpoint` over HTTP, for the servers in mode `export_restore` (the
    others are never asked: a restart_only or stateless server never holds a snapshot
    up). Calls go to every exporting server at once."""

    def __init__(self, pool: AgentPool):
        self.pool = pool
        self.servers = [c for c in pool.clients if c.spec.mode == "export_restore"]
        self.holds_rollout_state = bool(self.servers)
        self._cid: str | None = None
        self._expected: set[str] = set()
        self._t_prepare: float | None = None
        self.holds: list[float] = []  # prepare -> resume, seconds, per snapshot (bounded)

    def _each(self, make: Callable[[AgentServerClient], Any], timeout: float = 60.0) -> list[Any]:
        async def run_all():
            return await asyncio.gather(*(make(c) for c in self.servers), return_exceptions=True)

        results = self.pool.http.call(run_all(), timeout=timeout)
        for r in results:
            if isinstance(r, BaseException):
                if isinstance(r, ServerDown):
                    raise EnvironmentPhaseError(str(r))
                raise r
        return results

    async def _post(self, c: AgentServerClient, path: str, body: dict) -> Any:
        status, data = await c.call("POST", path, body)
        if status not in (200, 201):
            raise EnvironmentPhaseError(c._refused(f"POST {path}", status, data))
        return data

    def retire(self, abandoned_episode_keys: Sequence[str]) -> None:
        keys = list(abandoned_episode_keys)
        if keys and self.servers:
            self._each(lambda c: self._post(c, "/checkpoint/retire", {"keys": keys}))

    def prepare(self) -> None:
        if not self.servers:
            return
        self._cid = uuid.uuid4().hex[:12]
        self._t_prepare = time.perf_counter()
        cid = self._cid
        self._each(lambda c: self._post(c, "/checkpoint/prepare", {"checkpoint_id": cid, "lease_s": c.spec.lease_s}))

    def commit(self) -> None:
        if not self.servers:
            return
        cid = self._cid

        async def one(c: AgentServerClient) -> set[str]:
            await self._post(c, "/checkpoint/commit", {"checkpoint_id": cid})
            # Read once the copy is made, on the loop that changes the set: an attempt
            # still acknowledged now got no outcome yet, so no DELETE went out for it, and
            # registration closed at prepare: it is in the copy unless the server lost it.
            # (Read before the copy, an outcome and its DELETE could land in between: an
            # attempt the ledger still runs at the cut, missing from a sound export.)
            return set(c.acknowledged)

        self._expected = set().union(*self._each(one))

    def drain(self) -> None:
        if self.servers:
            cid = self._cid
            self._each(lambda c: self._post(c, "/checkpoint/drain", {"checkpoint_id": cid}))

    def export(self) -> dict[str, dict]:
        if not self.servers:
            return {}
        cid = self._cid

        async def one(c: AgentServerClient) -> dict[str, dict]:
            status, data = await c.call("GET", "/checkpoint/export", query={"checkpoint_id": cid}, timeout=120)
            if status != 200:
                raise EnvironmentPhaseError(c._refused("GET /checkpoint/export", status, data))
            try:
                return wire.agent_states(data)
            except wire.HttpError as e:
                raise EnvironmentPhaseError(f"agent server {c.name}: its export is malformed: {e.message}") from None

        merged: dict[str, dict] = {}
        for part in self._each(one, timeout=180):
            clash = set(part) & set(merged)
            if clash:
                raise EnvironmentPhaseError(f"two agent servers exported the same episodes: {sorted(clash)[:3]}")
            merged.update(part)
        return merged

    def expected_keys(self) -> set[str]:
        """Attempts the exporting servers had acknowledged when the export was committed."""
        return set(self._expected)

    def resume(self) -> None:
        """Always called after prepare. A server that does not answer reopens when its
        lease expires; the failure is logged, not raised."""
        cid, self._cid = self._cid, None
        if cid is None or not self.servers:
            return
        try:
            self._each(lambda c: self._post(c, "/checkpoint/resume", {"checkpoint_id": cid}))
        except Exception as e:  # noqa: BLE001 - the lease reopens it
            log.warning("rolloutdb: resume after checkpoint %s failed (%s); the server reopens when its lease expires",
                        cid, e)
        if self._t_prepare is not None:
            self.holds = (self.holds + [time.perf_counter() - self._t_prepare])[-1024:]
            self._t_prepare = None

    @contextlib.contextmanager
    def restore_scope(self, episodes: dict[str, dict]) -> Iterator[None]:
        """Install saved agents (`{old key: {"prompt_id": ..., "turn", "state", transcript}}`)
        on the servers their prompts meet; uninstall them if the block raises."""
        by_server: dict[str, dict[str, dict]] = {}
        for key, saved in episodes.items():
            c = self.pool.server_for(int(saved["prompt_id"]))
            if c.spec.mode != "export_restore":
                continue  # restart_only / stateless: the attempt restarts
            by_server.setdefault(c.name, {})[key] = {k: v for k, v in saved.items() if k != "prompt_id"}
        clients = {c.name: c for c in self.servers}
        done: list[str] = []
        try:
            for name, eps in by_server.items():
                self.pool.http.call(self._post(clients[name], "/agents/install", {"episodes": eps}), timeout=120)
                done.append(name)
            yield
        except BaseException:
            for name in done:
                with contextlib.suppress(Exception):
                    self.pool.http.call(self._post(clients[name], "/agents/uninstall",
                                                   {"keys": list(by_server[name])}), timeout=30)
            raise
