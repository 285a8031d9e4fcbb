"""The policy as an OpenAI-compatible endpoint, served by the controller on loopback.

`POST /v1/completions` takes token ids as the prompt and answers token ids, logprobs and
the policy version of each token; `GET /health` says the engine is up. Every call must
carry the header `X-Rolloutdb-Episode: <key>` naming an episode the controller started
(and `X-Rolloutdb-Turn`): the call becomes the engine request `<key>-t<turn>`, exactly the
id an in-process turn gets, so abort, refit versions, capture and the trace treat it
the same. A call for an episode the controller does not run (finished, abandoned,
another run's) is refused with 409: an abandoned attempt's agent cannot add work.
Every request, /health included, must carry one of the run's bearer tokens (`auth`):
an episode key read from the store is not enough to spend the engine's time.

A client that hangs up mid-call (its agent was retired, its server died) aborts the
engine call: no slot decodes for nobody.

Prefix level: an episode restored from a snapshot whose cut froze its call may come with
that call's output so far (`prefix_for(key)`: the turn and the prefix, taken by the
episode's first call). When the first call is of that turn and asks the same limits, the
engine gets the prompt and the prefix (`GenerationRequest.prefix_*`: it counts the prefix
as output for limits, penalties, stop strings and the seed's stream) and the reply is the
whole output, the prefix with its original logprobs and versions first: the agent sees
exactly the reply the uninterrupted call would have given. Otherwise the prefix is
dropped and the call decodes from its start (the turn path), with the reason reported.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

from aiohttp import web

from rolloutdb.controller.agent_server import auth
from rolloutdb.controller.agent_server.http_loop import HttpLoop
from rolloutdb.controller.agent_server.wire import (
    EPISODE_HEADER,
    POLICY_MAX_BODY_BYTES,
    TURN_HEADER,
    HttpError,
    bad,
    completion_response,
    episode_key,
    error_middleware,
    json_response,
    prompt_ids,
    read_json,
    sampling_params,
)
from rolloutdb.gpu_capture.protocol import GenerationRequest, GenerationResult

# (owner, turn, result, prefix tokens) -> None: the pool's bookkeeping of a served call (trace, meter)
OnCall = Callable[[Any, int, GenerationResult, int], None]
# key -> (turn, prefix) or None, taken once: a restored call's output so far. The prefix has
# `token_ids`, `logprobs` (or None), `token_versions`, `max_tokens`, `min_tokens` (a `CallPrefix`).
PrefixFor = Callable[[str], "tuple[int, Any] | None"]
# (key, turn, prefix tokens, result or None, reason it was dropped or None) -> None
OnSplice = Callable[[str, int, int, "GenerationResult | None", "str | None"], None]


def spliced(request: GenerationRequest, saved: tuple[int, Any] | None, turn: int) -> tuple[GenerationRequest, str | None]:
    """`request` continued from `saved` = (turn, prefix) when it is that turn's call with
    the limits the prefix was decoded under (the same call: same conversation, seed and
    limits); else `request` unchanged and why the prefix cannot be used."""
    if saved is None:
        return request, None
    at, prefix = saved
    if at != turn:
        return request, f"the episode's first call is of turn {turn}, the prefix of turn {at}"
    p = request.params
    if (prefix.max_tokens, prefix.min_tokens) != (p.max_tokens, p.min_tokens):
        return request, (f"limits differ: the prefix was decoded under max_tokens {prefix.max_tokens}, min_tokens "
                         f"{prefix.min_tokens}, the call asks {p.max_tokens}, {p.min_tokens}")
    return replace(request, prefix_ids=list(prefix.token_ids), prefix_versions=list(prefix.token_versions),
                   prefix_logprobs=list(prefix.logprobs or ()), prefix_sampler=prefix.sampler), None


class PolicyEndpoint:
    def __init__(self, engine, http: HttpLoop, *, owner: Callable[[str], Any | None], tokens: Collection[str],
                 on_call: OnCall | None = None,
                 prefix_for: PrefixFor | None = None, on_splice: OnSplice | None = None,
                 model: str = "policy", host: str = "127.0.0.1", port: int = 0):
        self.engine = engine
        self.http = http
        self.tokens = tuple(tokens)  # the run's token and each server's at a url with its own
        self.owner = owner
        self.on_call = on_call
        self.prefix_for = prefix_for
        self.on_splice = on_splice
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
        app = web.Application(middlewares=[error_middleware(POLICY_MAX_BODY_BYTES), auth.middleware(self.tokens)],
                              client_max_size=POLICY_MAX_BODY_BYTES)
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
        return json_response({"status": "ok", "model": self.model,
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
        saved = self.prefix_for(key) if self.prefix_for is not None else None
        call, dropped = spliced(GenerationRequest(request_id=rid, prompt_ids=prompt, params=params), saved, turn)
        prefix_tokens = len(call.prefix_ids)
        try:
            future = self.engine.submit(call)
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
        bad_logprob = next((lp for lp in result.logprobs if not math.isfinite(lp)), None)
        if bad_logprob is not None:
            # Within the sampling bounds only broken weights get here; the train pump
            # stops the run on them too (a sample's logprob must be finite).
            raise HttpError(500, f"the engine reported logprob {bad_logprob} for call {rid}: the policy's weights "
                                 "give non-finite logits")
        self.calls += 1
        if saved is not None and self.on_splice is not None:
            self.on_splice(key, turn, len(saved[1].token_ids), result if dropped is None else None, dropped)
        if self.on_call is not None:
            self.on_call(owner, turn, result, prefix_tokens)
        return json_response(completion_response(result, model=self.model, prompt_tokens=len(prompt),
                                                     created=int(time.time())))
