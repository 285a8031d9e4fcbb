"""The agent server: a separate process that runs multi-turn episodes of the built-in
tasks and calls the policy over HTTP for every turn.

    python -m rolloutdb.controller.agent_server.env_server --config RUN.yaml --server NAME \\
        --policy-dir RUN_DIR/policy --token-file FILE [--policy-url URL] [--host 127.0.0.1] [--port 0]

(or `rolloutdb-agent-server ...`). It prints one line `rolloutdb-agent-server listening on
http://HOST:PORT` once it accepts requests; SIGTERM stops it cleanly. docs/agent_server.md
describes every endpoint; this is the reference implementation of that protocol.

Every request must carry the run's bearer token (`auth`: from `--token-file` or
ROLLOUTDB_AGENT_TOKEN); the server sends it with its own policy calls, and calls one
policy endpoint only: `--policy-url`, or else the first one an episode names after the
start or a `reset` (an episode naming another is refused). It holds at most `max_agents`
agents (episodes not yet deleted plus installed agents).

An agent is one attempt's episode (`controller/episodes.Episode`: the same state machine
the in-process pump drives, so an episode here makes the same calls with the same seeds).
Its turn loop: build the next call, POST it to the policy endpoint with the episode's
header, absorb the reply (step the environment), until the episode is done.

Checkpoints (mode `export_restore`): `prepare` closes registration of new episodes and
pauses deadlines (turns in progress go on), and starts the lease; `commit` copies every
agent's state as it is at that instant; `drain` returns once no turn is half applied
(a turn is applied in one step of the event loop, so there is nothing to wait for here;
a server whose tools run outside the loop waits in drain); `export` returns the copy;
`resume` reopens. If `resume` does not come within the lease (the controller died), the
server reopens by itself and drops the copy: a snapshot that died never gets it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from rolloutdb.controller.agent_server import auth, fencing, wire
from rolloutdb.controller.agent_server.fencing import Tool, TurnContext
from rolloutdb.controller.agent_server.wire import HttpError, bad, want, want_int
from rolloutdb.controller.rollout.episodes import Episode
from rolloutdb.gpu_capture.protocol import SamplingParams

log = logging.getLogger("rolloutdb.agent_server")

LONG_POLL_MAX_S = 60.0
DEFAULT_MAX_AGENTS = 4096  # environment.servers[].max_agents


@dataclass(eq=False)
class Agent:
    key: str
    prompt_id: int
    episode: Episode
    policy_url: str
    params: SamplingParams
    started: float
    paused_before: float  # the server's total paused time when the agent started
    episode_id: str  # the episode across attempts (fencing.py)
    attempt: int
    status: str = "running"  # running | finished | failed
    reason: str | None = None  # failed: "error" or "deadline"
    error: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    def view(self) -> dict:
        """The agent as exported (and installed): turn, state, transcript."""
        e = self.episode
        return {"turn": e.turn, "state": {"env": e.state, "done": e.done, "reward": e.reward,
                                          "finish_reasons": list(e.finish_reasons)},
                "token_ids": list(e.token_ids), "logprobs": list(e.logprobs), "token_versions": list(e.token_versions)}


class AgentServer:
    def __init__(self, env, *, name: str, mode: str, task: dict, token: str, policy_url: str | None = None,
                 max_agents: int = DEFAULT_MAX_AGENTS, episode_timeout_s: float = 600.0, num_prompts: int | None = None,
                 tool: Tool | None = None):
        if mode not in wire.MODES:
            raise ValueError(f"mode {mode!r}: use one of {', '.join(wire.MODES)}")
        if mode == "stateless" and env.max_turns > 1:
            raise ValueError(f"a stateless server keeps nothing between turns; its task runs {env.max_turns} turns "
                             "(use restart_only)")
        self.env = env
        self.name, self.mode, self.task = name, mode, task
        self.token = auth.checked(token, "the server's token")
        # Where this server's agents may call: fixed by --policy-url, else pinned by the
        # first episode after start or reset (the controller resets at its start).
        self.policy_fixed = policy_url is not None
        self.policy_url = policy_url.rstrip("/") if policy_url else None
        self.max_agents = max_agents
        self.episode_timeout_s = episode_timeout_s
        self.num_prompts = num_prompts
        self.agents: dict[str, Agent] = {}
        self.installed: dict[str, dict] = {}
        self.fence = fencing.Fence()
        self.tool = tool
        self.open = asyncio.Event()
        self.open.set()
        self.checkpoint_id: str | None = None
        self._lease: asyncio.TimerHandle | None = None
        self._committed: dict[str, dict] | None = None
        self._paused_since: float | None = None
        self._paused_total = 0.0
        self.lease_expirations = 0
        self.session: ClientSession | None = None

    # ------------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(middlewares=[wire.error_middleware(wire.MAX_BODY_BYTES), auth.middleware([self.token])],
                              client_max_size=wire.MAX_BODY_BYTES)
        r = app.router
        r.add_get("/health", self.health)
        r.add_post("/episodes", self.start_episode)
        r.add_get("/episodes/{key}", self.episode_result)
        r.add_delete("/episodes/{key}", self.forget_episode)
        r.add_post("/checkpoint/retire", self.retire)
        r.add_post("/checkpoint/prepare", self.prepare)
        r.add_post("/checkpoint/commit", self.commit)
        r.add_post("/checkpoint/drain", self.drain)
        r.add_get("/checkpoint/export", self.export)
        r.add_post("/checkpoint/resume", self.resume)
        r.add_post("/agents/install", self.install)
        r.add_post("/agents/uninstall", self.uninstall)
        r.add_post("/reset", self.reset)
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close)
        return app

    async def _open_session(self, app) -> None:
        # Unlimited connections: one policy call in flight per agent, hundreds of agents.
        self.session = ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=None, sock_connect=30),
                                     headers=auth.header(self.token))

    async def _close(self, app) -> None:
        await self._cancel(list(self.agents.values()))
        if self.session is not None:
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        running = sum(1 for a in self.agents.values() if a.status == "running")
        return web.json_response({
            "status": "ok", "server": "rolloutdb-agent-server", "protocol": wire.PROTOCOL, "name": self.name,
            "mode": self.mode, "task": self.task, "max_turns": self.env.max_turns, "episodes": len(self.agents),
            "running": running, "installed": len(self.installed), "max_agents": self.max_agents,
            "dispatch": "open" if self.open.is_set() else "closed",
            "checkpoint_id": self.checkpoint_id, "lease_expirations": self.lease_expirations, "pid": os.getpid(),
            "fencing": True,
        })

    # ------------------------------------------------------------------ episodes

    async def start_episode(self, request: web.Request) -> web.Response:
        body = await wire.read_json(request)
        key = wire.episode_key(want(body, "key", str))
        episode_id, attempt = fencing.requested_identity(body, key)
        prompt_id = want_int(body, "prompt_id", 0, 2**31 - 1)
        seed = want_int(body, "seed", 0, 2**63 - 1)
        policy = want(body, "policy", dict)
        url = want(policy, "url", str).rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise bad("field 'policy.url' must be the policy endpoint's base URL, e.g. http://127.0.0.1:8000")
        if self.policy_url is not None and url != self.policy_url:
            how = "--policy-url" if self.policy_fixed else "the first episode since the start or the last reset"
            raise HttpError(403, f"field 'policy.url' {url[:80]!r} is not the policy endpoint this server calls "
                                 f"({self.policy_url}, from {how}); it calls no other")
        params = wire.sampling_params(policy)
        continue_from = body.get("continue_from")
        if continue_from is not None:
            continue_from = wire.episode_key(continue_from, "continue_from")
        self.fence.check(episode_id, attempt)
        if not self.open.is_set():
            raise HttpError(409, f"dispatch is closed: checkpoint {self.checkpoint_id} is in progress; retry once it "
                                 "resumes")
        if key in self.agents:
            raise HttpError(409, f"episode {key} exists already; an attempt runs once (start a new attempt key)")
        if continue_from not in self.installed:
            self._room_for(1)  # continuing an installed agent takes no new room
        if self.num_prompts is not None and prompt_id >= self.num_prompts:
            raise bad(f"field 'prompt_id' {prompt_id} is outside this task's {self.num_prompts} prompts")
        if continue_from is not None:
            if continue_from not in self.installed:
                raise HttpError(404, f"no installed agent {continue_from}; POST /agents/install it first")
            saved = self.installed.pop(continue_from)
            episode = self._resumed(key, prompt_id, seed, saved)
        else:
            episode = Episode.start(self.env, prompt_id, key=key, seed=seed)
        agent = Agent(key, prompt_id, episode, url, params, time.monotonic(), self._paused_total, episode_id, attempt)
        self.fence.register(episode_id, attempt)
        self.policy_url = url
        self.agents[key] = agent
        agent.task = asyncio.get_running_loop().create_task(self._play(agent))
        return web.json_response({"key": key, "turn": episode.turn}, status=201)

    def _room_for(self, n: int) -> None:
        held = len(self.agents) + len(self.installed)
        if held + n > self.max_agents:
            raise HttpError(429, f"this server holds {held} agents and takes at most {self.max_agents} "
                                 "(environment.servers[].max_agents); delete finished episodes, or raise the cap")

    def _resumed(self, key: str, prompt_id: int, seed: int, saved: dict) -> Episode:
        state = saved["state"]
        if "token_ids" not in saved or not isinstance(state.get("env"), dict):
            raise bad(f"installed agent for {key} has no transcript or no 'env' state; it cannot continue here")
        episode = Episode.resumed(self.env, prompt_id, key=key, seed=seed, turn=saved["turn"], state=state["env"],
                                  token_ids=saved["token_ids"], logprobs=saved["logprobs"],
                                  token_versions=saved["token_versions"])
        episode.done = bool(state.get("done", False))
        episode.reward = float(state.get("reward", 0.0))
        episode.finish_reasons = [str(r) for r in state.get("finish_reasons", [])]
        return episode

    async def _play(self, agent: Agent) -> None:
        e = agent.episode
        try:
            while not e.done:
                self._fenced(agent)
                if self._deadline_passed(agent):
                    agent.status, agent.reason = "failed", "deadline"
                    agent.error = f"episode {agent.key} ran past its deadline of {self.episode_timeout_s:g} s"
                    return
                request = e.request(self.env, agent.params)
                result = await self._call_policy(agent, e.turn, request)
                if result.finish_reason == "abort":
                    raise RuntimeError("the policy aborted the call (the controller is stopping)")
                self._fenced(agent)  # a newer attempt may have registered during the call
                if self.tool is not None:
                    self.tool(TurnContext(agent.episode_id, agent.attempt, e.turn, agent.key), list(result.token_ids))
                e.absorb(self.env, result)  # one step of the loop: a turn is never half applied at an await
            agent.status = "finished"
        except asyncio.CancelledError:
            agent.status, agent.reason, agent.error = "failed", "error", "retired"
            raise
        except fencing.StaleAttempt as ex:  # a newer attempt of its episode registered
            agent.status, agent.reason, agent.error = "failed", "error", ex.message
        except Exception as ex:  # noqa: BLE001 - reported through GET /episodes/{key}
            agent.status, agent.reason = "failed", "error"
            agent.error = f"{type(ex).__name__}: {(str(ex).splitlines() or [''])[0]}"
        finally:
            agent.done.set()

    def _fenced(self, agent: Agent) -> None:
        """Stop an attempt a newer one of its episode replaced, before its next turn."""
        self.fence.check(agent.episode_id, agent.attempt)

    def _deadline_passed(self, agent: Agent) -> bool:
        paused = self._paused_total - agent.paused_before
        if self._paused_since is not None:
            paused += time.monotonic() - self._paused_since
        return time.monotonic() - agent.started - paused > self.episode_timeout_s

    async def _call_policy(self, agent: Agent, turn: int, request):
        assert self.session is not None
        headers = {wire.EPISODE_HEADER: agent.key, wire.TURN_HEADER: str(turn)}
        body = wire.completion_body(list(request.prompt_ids), request.params)
        try:
            async with self.session.post(f"{agent.policy_url}/v1/completions", json=body, headers=headers,
                                         allow_redirects=False) as resp:
                answer = await wire.read_answer(resp)
                if resp.status != 200:
                    raise RuntimeError(f"policy endpoint answered {resp.status}: "
                                       f"{(answer or {}).get('error', '') if isinstance(answer, dict) else answer}")
        except ClientError as ex:
            raise RuntimeError(f"policy endpoint unreachable: {type(ex).__name__}: {ex}") from None
        return wire.parse_completion(answer, request.request_id)

    def _agent(self, request: web.Request) -> Agent:
        key = wire.episode_key(request.match_info["key"], "key")
        agent = self.agents.get(key)
        if agent is None:
            raise HttpError(404, f"no episode {key} on this server (never started, forgotten or retired)")
        return agent

    async def episode_result(self, request: web.Request) -> web.Response:
        agent = self._agent(request)
        try:
            wait_s = float(request.query.get("wait_s", "0"))
        except ValueError:
            raise bad("query 'wait_s' must be a number of seconds") from None
        if not 0 <= wait_s <= LONG_POLL_MAX_S:
            raise bad(f"query 'wait_s' must be in [0, {LONG_POLL_MAX_S:g}]")
        if wait_s and not agent.done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(agent.done.wait(), wait_s)
        e = agent.episode
        out: dict[str, Any] = {"key": agent.key, "status": agent.status, "turn": e.turn}
        if agent.status == "finished":
            out.update(reward=e.reward, token_ids=e.token_ids, logprobs=e.logprobs, token_versions=e.token_versions,
                       finish_reasons=e.finish_reasons)
        elif agent.status == "failed":
            out.update(reason=agent.reason, error=agent.error)
        return web.json_response(out, status=200 if agent.status != "running" else 202)

    async def forget_episode(self, request: web.Request) -> web.Response:
        agent = self._agent(request)
        await self._cancel([agent])
        return web.json_response({"key": agent.key, "forgotten": True})

    async def _cancel(self, agents: list[Agent]) -> None:
        tasks = []
        for a in agents:
            self.agents.pop(a.key, None)
            if a.task is not None and not a.task.done():
                a.task.cancel()
                tasks.append(a.task)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ checkpoints

    def _exporting(self) -> None:
        if self.mode != "export_restore":
            raise HttpError(409, f"this server runs {self.mode}: it exports nothing, so the controller does not "
                                 "checkpoint or install its agents (set its mode to export_restore to do so)")

    def _current(self, body: dict) -> str:
        cid = want(body, "checkpoint_id", str)
        if cid != self.checkpoint_id:
            raise HttpError(409, f"checkpoint {cid} is not in progress here (its lease expired, or another one "
                                 f"replaced it: {self.checkpoint_id}); start over with prepare")
        return cid

    async def retire(self, request: web.Request) -> web.Response:
        body = await wire.read_json(request)
        keys = wire.key_list(body)
        gone = [self.agents[k] for k in keys if k in self.agents]
        for k in keys:
            self.installed.pop(k, None)
        await self._cancel(gone)
        return web.json_response({"retired": len(gone)})

    async def prepare(self, request: web.Request) -> web.Response:
        self._exporting()
        body = await wire.read_json(request)
        cid = want(body, "checkpoint_id", str)
        lease_s = want(body, "lease_s", float)
        if not 0 < lease_s <= 3600:
            raise bad("field 'lease_s' must be in (0, 3600] seconds")
        if self.checkpoint_id is not None:
            self._end_checkpoint()  # a newer prepare replaces one its controller abandoned
        self.checkpoint_id = cid
        self.open.clear()
        self._paused_since = time.monotonic()
        self._lease = asyncio.get_running_loop().call_later(lease_s, self._lease_expired, cid)
        return web.json_response({"checkpoint_id": cid, "episodes": len(self.agents)})

    def _lease_expired(self, cid: str) -> None:
        if self.checkpoint_id == cid:
            log.warning("checkpoint %s: lease expired without resume; reopening dispatch", cid)
            self.lease_expirations += 1
            self._end_checkpoint()

    def _end_checkpoint(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None
        if self._paused_since is not None:
            self._paused_total += time.monotonic() - self._paused_since
            self._paused_since = None
        self.checkpoint_id = None
        self._committed = None
        self.open.set()

    async def commit(self, request: web.Request) -> web.Response:
        self._exporting()
        self._current(await wire.read_json(request))
        # One step of the loop: every agent as it is now, none half applied.
        self._committed = {k: a.view() for k, a in self.agents.items() if a.status != "failed"}
        return web.json_response({"episodes": len(self._committed)})

    async def drain(self, request: web.Request) -> web.Response:
        self._exporting()
        self._current(await wire.read_json(request))
        return web.json_response({"drained": True})

    async def export(self, request: web.Request) -> web.Response:
        self._exporting()
        cid = request.query.get("checkpoint_id")
        if not cid:
            raise bad("missing query 'checkpoint_id' (the id sent to POST /checkpoint/prepare)")
        self._current({"checkpoint_id": cid})
        if self._committed is None:
            raise HttpError(409, f"checkpoint {cid} has not committed; POST /checkpoint/commit first")
        return web.json_response({"checkpoint_id": cid, "episodes": self._committed})

    async def resume(self, request: web.Request) -> web.Response:
        body = await wire.read_json(request)
        cid = want(body, "checkpoint_id", str)
        resumed = cid == self.checkpoint_id
        if resumed:
            self._end_checkpoint()
        return web.json_response({"resumed": resumed})

    async def install(self, request: web.Request) -> web.Response:
        self._exporting()
        episodes = wire.agent_states(await wire.read_json(request))
        for key, saved in episodes.items():
            if not isinstance(saved["state"].get("env"), dict) or "token_ids" not in saved:
                raise bad(f"episode {key}: this server continues agents exported by itself (state.env and a "
                          "transcript); nothing was installed")
            if saved["turn"] > self.env.max_turns:
                raise bad(f"episode {key}: turn {saved['turn']} is past this task's {self.env.max_turns} turns; "
                          "nothing was installed")
        self._room_for(len(set(episodes) - set(self.installed)))
        self.installed.update(episodes)
        for key in episodes:
            self.fence.register(*fencing.identity_of(key))
        return web.json_response({"installed": len(episodes)}, status=201)

    async def uninstall(self, request: web.Request) -> web.Response:
        keys = wire.key_list(await wire.read_json(request))
        n = sum(self.installed.pop(k, None) is not None for k in keys)
        return web.json_response({"uninstalled": n})

    async def reset(self, request: web.Request) -> web.Response:
        await wire.read_json(request)  # `{}`: a stray POST with some other body forgets nothing
        n = len(self.agents)
        await self._cancel(list(self.agents.values()))
        self.installed.clear()
        self.fence.forget()  # attempts registered after a reset are newer than any before it
        self._end_checkpoint()
        if not self.policy_fixed:
            self.policy_url = None  # a new controller: its first episode names its endpoint
        return web.json_response({"forgotten": n})


# ---------------------------------------------------------------------- the process


def build_server(config, name: str, policy_dir, *, token: str, policy_url: str | None = None,
                 mode: str | None = None, tool: Tool | None = None) -> AgentServer:
    """The server named `name` in `config.environment.servers`, with its task built the way
    the controller builds it (same dataset, tokenizer and environment)."""
    from rolloutdb.config import config_from_dict
    from rolloutdb.controller.tasks import registry

    env_cfg = config.environment
    spec = next((s for s in env_cfg.servers if s.name == name), None)
    if spec is None:
        known = ", ".join(s.name for s in env_cfg.servers) or "none"
        raise ValueError(f"--server {name}: the config has no such environment server (it has: {known})")
    data = config.model_dump()
    data["environment"].update(kind=env_cfg.kind_of(spec), turns=env_cfg.turns_of(spec), servers=[])
    dataset, env = registry.build_task(config_from_dict(data), policy_dir)
    task = {"task": env_cfg.task, "kind": env_cfg.kind_of(spec), "turns": env_cfg.turns_of(spec),
            "prompts": len(dataset)}
    return AgentServer(env, name=name, mode=mode or spec.mode, task=task, token=token, policy_url=policy_url,
                       max_agents=spec.max_agents, episode_timeout_s=spec.episode_timeout_s, num_prompts=len(dataset),
                       tool=tool)


async def serve(server: AgentServer, host: str, port: int, parent_pid: int | None) -> None:
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"rolloutdb-agent-server listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            if parent_pid is not None and os.getppid() != parent_pid:
                log.warning("the controller (pid %d) is gone; stopping", parent_pid)
                break
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rolloutdb-agent-server", description="Run an agent server for a rolloutdb run "
                                 "(docs/agent_server.md).")
    ap.add_argument("--config", required=True, help="the run's config file (environment.servers names this server)")
    ap.add_argument("--server", required=True, help="the server's name in environment.servers")
    ap.add_argument("--policy-dir", required=True, help="the run's policy directory (its tokenizer builds the task)")
    ap.add_argument("--token-file", default=None, help="a file (mode 0600) holding the token every request must "
                    "carry (Authorization: Bearer); without it, the environment variable " + auth.TOKEN_ENV)
    ap.add_argument("--policy-url", default=None, help="the only policy endpoint this server calls; without it, "
                    "the first one an episode names after the start or a reset")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: a free port (printed on the listening line)")
    ap.add_argument("--mode", choices=wire.MODES, default=None, help="override the config's mode (tests)")
    ap.add_argument("--tool", default=None, help="FILE:FUNCTION called once per turn with the turn's "
                    "idempotency key and attempt (docs/agent_server.md#tools-with-effects-outside-the-episode)")
    ap.add_argument("--parent-pid", type=int, default=None, help="stop when this process is gone (set by the "
                    "controller that starts the server)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from rolloutdb.config import ConfigError, load_config

    try:
        token = auth.read_token_file(args.token_file, "--token-file") if args.token_file else auth.token_from_env()
        if token is None:
            raise ValueError(f"no token: give --token-file FILE (mode 0600) or set {auth.TOKEN_ENV}; every request "
                             "must carry it (docs/agent_server.md#who-may-call)")
        config = load_config(args.config)
        tool = fencing.load_tool(args.tool) if args.tool else None
        server = build_server(config, args.server, args.policy_dir, token=token, policy_url=args.policy_url,
                              mode=args.mode, tool=tool)
    except (ConfigError, ValueError, OSError) as e:
        print(f"rolloutdb-agent-server: {(str(e).splitlines() or [''])[0]}", file=sys.stderr)
        return 2
    asyncio.run(serve(server, args.host, args.port, args.parent_pid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
