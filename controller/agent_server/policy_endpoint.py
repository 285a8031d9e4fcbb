"""The policy as an OpenAI-compatible endpoint, served by the controller on loopback.

`POST /v1/completions` takes token ids as the prompt and answers token ids, logprobs and
the policy version of each token; `GET /health` says the engine is up. Every call must
carry the header `X-Rolloutdb-Episode: <key>` naming an episode the controller started
(and `X-Rolloutdb-Turn`): the call becomes the engine request `<key>-t<turn>`, exactly the
id an in-process turn gets, so abort, refit versions, capture and the trace treat it
the same. A call for an episode the controller does not run (finished, abandoned,
another run's) is refused with 409: an abandoned attempt's agent cannot add work.

A client that hangs up mid-call (its agent was retired, its server died) aborts the
engine call: no slot decodes for nobody.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from rolloutdb.controller.agent_server.http_loop import HttpLoop
from rolloutdb.controller.agent_server.wire import (
    EPISODE_HEADER,
    MAX_BODY_BYTES,
    TURN_HEADER,
    HttpError,
    bad,
    completion_response,
    episode_key,
    error_middleware,
    prompt_ids,
    read_json,
    sampling_params,
)
from rolloutdb.gpu_capture.protocol import GenerationRequest, GenerationResult

# (owner, turn, result) -> None: the pool's bookkeeping of a served call (trace, meter)
OnCall = Callable[[Any, int, GenerationResult], None]


class PolicyEndpoint:
    def __init__(self, engine, http: HttpLoop, *, owner: Callable[[str], Any | None], on_call: OnCall | None = None,
                 model: str = "policy", host: str = "127.0.0.1", port: int = 0):
        self.engine = engine
        self.http = http
        self.owner = owner
        self.on_call = on_call
        self.model = model
        self.host, self.port = host, port
        self.calls = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    def start(self) -> str:
        """Listen (port 0: a free one) and return the base URL, e.g. http://127.0.0.1:41234."""
        self.url = self.http.call(self._start(), timeout=30)
        return self.url

    def build_app(self) -> web.Application:
        """The endpoint's routes, not yet served (tests/test_agent_server_docs.py lists them)."""
        app = web.Application(middlewares=[error_middleware()], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completions)
        return app

    async def _start(self) -> str:
        # handler_cancellation: aiohttp (>= 3.9) no longer cancels a handler whose client
        # hung up unless asked; without it a retired agent's call decoded to its end.
        self._runner = web.AppRunner(self.build_app(), access_log=None, handle_signals=False,
                                     handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"http://{self.host}:{port}"

    def close(self) -> None:
        if self._runner is not None:
            try:
                self.http.call(self._runner.cleanup(), timeout=10)
            except Exception:  # noqa: BLE001 - closing
                pass
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model,
                                  "policy_version": int(getattr(self.engine, "policy_version", 0)),
                                  "calls": self.calls})

    async def _completions(self, request: web.Request) -> web.Response:
        raw_key = request.headers.get(EPISODE_HEADER)
        if not raw_key:
            raise bad(f"missing header {EPISODE_HEADER}: every call names the episode the controller started "
                      "(the key of POST /episodes)")
        key = episode_key(raw_key, EPISODE_HEADER)
        try:
            turn = int(request.headers.get(TURN_HEADER, "0"))
        except ValueError:
            raise bad(f"header {TURN_HEADER} must be an integer (the turn's index, from 0)") from None
        if not 0 <= turn <= 1_000_000:
            raise bad(f"header {TURN_HEADER} must be in [0, 1000000]")
        body = await read_json(request)
        prompt = prompt_ids(body)
        params = sampling_params(body)
        owner = self.owner(key)
        if owner is None:
            raise HttpError(409, f"episode {key} is not running in this controller (finished, abandoned or "
                                 "another run's); stop the episode")
        rid = f"{key}-t{turn}"
        try:
            future = self.engine.submit(GenerationRequest(request_id=rid, prompt_ids=prompt, params=params))
        except ValueError as e:
            raise HttpError(409 if "already running" in str(e) else 400, str(e)) from None
        except RuntimeError as e:
            raise HttpError(503, f"the engine is not taking calls: {e}") from None
        try:
            result = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The agent hung up: abort its call so no slot decodes for nobody.
            try:
                self.engine.abort([rid])
            except Exception:  # noqa: BLE001 - a closed engine aborted it already
                pass
            raise
        self.calls += 1
        if self.on_call is not None:
            self.on_call(owner, turn, result)
        return web.json_response(completion_response(result, model=self.model, prompt_tokens=len(prompt),
                                                     created=int(time.time())))
