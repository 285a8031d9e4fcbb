"""The HTTP protocol's JSON shapes, shared by the policy endpoint, the agent server and
the client: validation with one-line errors, and the error middleware both servers use.

docs/agent_server.md describes every endpoint for a team writing its own server; the
test that ties code to docs (tests/test_agent_server_docs.py) fails when a route exists
here or in the servers without its section there.

Errors are `{"error": "<one line: what is wrong and what to do>"}` with a 4xx status;
an unexpected failure is a 500 with the exception's first line, never a traceback.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

from rolloutdb import sampling_limits as limits
from rolloutdb.gpu_capture.protocol import GenerationResult, SamplingParams

PROTOCOL = 1
# Every model call an agent makes names the attempt it belongs to, with the header the
# controller issued when it started the episode; the turn rides along for the trace.
EPISODE_HEADER = "X-Rolloutdb-Episode"
TURN_HEADER = "X-Rolloutdb-Turn"
MODES = ("export_restore", "restart_only", "stateless")
# `<group>.<generation>-a<attempt>` as store.episode_key writes it, and only so (fullmatch,
# no leading zero): `0005.0-a0` or `5.0-a0\n` would be a second key for one attempt.
EPISODE_KEY = re.compile(r"(?:0|[1-9][0-9]{0,17})\.(?:0|[1-9][0-9]{0,8})-a(?:0|[1-9][0-9]{0,8})")
MAX_BODY_BYTES = 64 * 1024 * 1024  # an export of 256 long episodes fits many times over
# A completion request is a prompt of token ids: 16 MiB is ~2M ids, more than any context.
POLICY_MAX_BODY_BYTES = 16 * 1024 * 1024
# List sizes (the body caps bound the bytes; these bound the work per entry).
MAX_KEYS = 1_000_000  # keys of one retire / uninstall
MAX_TOKENS = 4_194_304  # token ids (a prompt, a transcript)
MAX_STOP = 64  # stop strings of one call, each at most MAX_STOP_CHARS
MAX_STOP_CHARS = 1024

log = logging.getLogger("rolloutdb.agent_server")


class HttpError(Exception):
    """A request refused with `status` and a one-line reason."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message.splitlines()[0] if message else "error"
        self.headers = dict(headers or {})


def bad(message: str) -> HttpError:
    return HttpError(400, message)


_MISSING = object()


def want(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
    """`body[name]` of JSON type `kind` (bool is never an int), or `default` when absent."""
    if name not in body or body[name] is None:
        if default is _MISSING:
            raise bad(f"missing field {name!r}")
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise bad(f"field {name!r} must be {_names(kinds)}, not a boolean")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds):
        raise bad(f"field {name!r} must be {_names(kinds)}, not {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(f"field {name!r} must be a finite number")
    return value


def _names(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object", bool: "a boolean"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def want_int(body: Mapping[str, Any], name: str, lo: int, hi: int, default: Any = _MISSING) -> int:
    value = want(body, name, int, default)
    if value is not default and not lo <= value <= hi:
        raise bad(f"field {name!r} must be in [{lo}, {hi}], got {value}")
    return value


def capped(value: Any, name: str, most: int) -> None:
    if isinstance(value, (list, dict)) and len(value) > most:
        raise bad(f"field {name!r} holds {len(value)} entries; at most {most} are accepted")


def int_list(value: Any, name: str, lo: int = 0, hi: int = 2**31 - 1) -> list[int]:
    capped(value, name, MAX_TOKENS)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise bad(f"field {name!r} must be a list of integers")
    if value and not (lo <= min(value) and max(value) <= hi):
        raise bad(f"field {name!r} holds integers outside [{lo}, {hi}]")
    return value


def float_list(value: Any, name: str) -> list[float]:
    capped(value, name, MAX_TOKENS)
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise bad(f"field {name!r} must be a list of numbers")
    out = [float(v) for v in value]
    if not all(math.isfinite(v) for v in out):
        raise bad(f"field {name!r} must hold finite numbers")
    return out


def episode_key(value: Any, name: str = "key") -> str:
    if not isinstance(value, str) or not EPISODE_KEY.fullmatch(value):
        raise bad(f"field {name!r} must be an episode key like '12.3-a0' (<group>.<generation>-a<attempt>, "
                  f"decimal numbers without leading zeros), got {str(value)[:40]!r}")
    return value


def key_list(body: Mapping[str, Any], name: str = "keys") -> list[str]:
    value = want(body, name, list)
    capped(value, name, MAX_KEYS)
    return [episode_key(v, name) for v in value]


# ---------------------------------------------------------------- model calls


# OpenAI / vLLM sampling fields the engines do not implement, with the value that means
# "off": a client's default passes, anything else is refused rather than silently ignored.
UNSUPPORTED_SAMPLING = {"top_k": (-1, 0), "min_p": (0,), "repetition_penalty": (1,), "best_of": (1,),
                        "logit_bias": ({},), "use_beam_search": (False,)}


def sampling_params(body: Mapping[str, Any]) -> SamplingParams:
    """The OpenAI completion fields the engine understands. `n` must be 1 (GRPO's group
    is n episodes, each its own attempt), `logprobs` is always on. The bounds are
    `rolloutdb/sampling_limits.py`'s, the config's and the engines' too."""
    n = want_int(body, "n", 1, 1, 1)
    del n
    max_tokens = want_int(body, "max_tokens", 1, limits.MAX_TOKENS, 16)
    stop = want(body, "stop", (list, str), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise bad("field 'stop' must be a non-empty string or a list of non-empty strings")
    for name, off in UNSUPPORTED_SAMPLING.items():
        value = body.get(name)
        if value is not None and not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in off):
            raise bad(f"field {name!r} is not supported (the engines sample with temperature, top_p and the "
                      f"presence / frequency penalties); leave it out")
    if len(stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad(f"field 'stop': at most {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters each")
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=want_int(body, "min_tokens", 0, max_tokens, 0),
        temperature=want(body, "temperature", float, 1.0),
        top_p=want(body, "top_p", float, 1.0),
        seed=want_int(body, "seed", 0, limits.MAX_SEED, None),
        stop=tuple(stop),
        presence_penalty=want(body, "presence_penalty", float, 0.0),
        frequency_penalty=want(body, "frequency_penalty", float, 0.0),
    )
    problems = limits.sampling_problems(
        temperature=params.temperature, top_p=params.top_p, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, max_tokens=params.max_tokens, min_tokens=params.min_tokens)
    if problems:
        name, problem = problems[0]
        raise bad(f"field {name!r}: {problem}")
    return params


def completion_body(prompt_ids: list[int], params: SamplingParams, model: str = "policy") -> dict:
    """The request an agent sends for one turn (token ids in, token ids out)."""
    body: dict[str, Any] = {
        "model": model, "prompt": list(prompt_ids), "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens, "temperature": params.temperature, "top_p": params.top_p,
        "stop": list(params.stop), "logprobs": 1, "return_token_ids": True,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    # Sent only when set: a policy endpoint that does not know them sees the old body.
    if params.presence_penalty:
        body["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        body["frequency_penalty"] = params.frequency_penalty
    return body


def prompt_ids(body: Mapping[str, Any]) -> list[int]:
    """`prompt`: token ids, or a batch of exactly one list of token ids."""
    prompt = want(body, "prompt", list)
    if prompt and isinstance(prompt[0], list):
        if len(prompt) != 1:
            raise bad("field 'prompt' holds a batch; send one prompt per request (one request per episode turn)")
        prompt = prompt[0]
    ids = int_list(prompt, "prompt")
    if not ids:
        raise bad("field 'prompt' is empty; send the conversation's token ids")
    return ids


def completion_response(result: GenerationResult, *, model: str, prompt_tokens: int, created: int) -> dict:
    n = len(result.token_ids)
    return {
        "id": result.request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{
            "index": 0, "text": result.text, "token_ids": list(result.token_ids),
            "logprobs": {"token_logprobs": list(result.logprobs)},
            "finish_reason": result.finish_reason,
            # rolloutdb's extension: the policy version that produced each token (a call
            # that ran across a refit has two), what batch age and the loss need
            "policy_versions": list(result.token_versions),
        }],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n},
    }


def parse_completion(body: Any, request_id: str) -> GenerationResult:
    """An agent reads the endpoint's answer back into the engine's result type."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or len(body["choices"]) != 1:
        raise ValueError("the policy endpoint's answer has no single choice")
    choice = body["choices"][0]
    tokens = int_list(choice.get("token_ids"), "token_ids")
    logprobs = float_list((choice.get("logprobs") or {}).get("token_logprobs"), "token_logprobs")
    versions = int_list(choice.get("policy_versions"), "policy_versions", lo=-(2**31))
    if not len(tokens) == len(logprobs) == len(versions):
        raise ValueError("the policy endpoint's answer has token ids, logprobs and versions of different lengths")
    return GenerationResult(request_id=request_id, token_ids=tokens, logprobs=logprobs, token_versions=versions,
                            finish_reason=str(choice.get("finish_reason")), text=str(choice.get("text") or ""))


# ---------------------------------------------------------------- exported agents


def agent_state(value: Any, key: str) -> dict:
    """One exported (or installed) agent: `turn`, `state` (a JSON object the server
    owns), and optionally the transcript after the prompt: `token_ids`, `logprobs`,
    `token_versions` (one each per token; -1 marks the environment's tokens)."""
    if not isinstance(value, dict):
        raise bad(f"episode {key}: must be an object with 'turn' and 'state'")
    out = {"turn": want_int(value, "turn", 0, 1_000_000), "state": want(value, "state", dict)}
    present = [f for f in ("token_ids", "logprobs", "token_versions") if value.get(f) is not None]
    if present and len(present) != 3:
        raise bad(f"episode {key}: give all of token_ids, logprobs and token_versions, or none")
    if present:
        ids = int_list(value["token_ids"], "token_ids")
        lps = float_list(value["logprobs"], "logprobs")
        vs = int_list(value["token_versions"], "token_versions", lo=-1)
        if not len(ids) == len(lps) == len(vs):
            raise bad(f"episode {key}: token_ids, logprobs and token_versions differ in length "
                      f"({len(ids)}, {len(lps)}, {len(vs)})")
        out.update(token_ids=ids, logprobs=lps, token_versions=vs)
    return out


def agent_states(body: Mapping[str, Any], name: str = "episodes") -> dict[str, dict]:
    value = want(body, name, dict)
    capped(value, name, MAX_KEYS)
    return {episode_key(k, name): agent_state(v, k) for k, v in value.items()}


# ---------------------------------------------------------------- aiohttp glue


def json_response(data: Any, status: int = 200, headers: Mapping[str, str] | None = None):
    """aiohttp's json_response, but strict JSON: a NaN or an infinity raises instead of
    going out as the bare `NaN` no JSON parser reads (the caller checks its floats)."""
    from aiohttp import web

    return web.json_response(data, status=status, headers=headers, dumps=_strict_dumps)


def _strict_dumps(data: Any) -> str:
    return json.dumps(data, allow_nan=False)


def error_middleware(max_body_bytes: int = MAX_BODY_BYTES):
    """aiohttp middleware: `HttpError` and aiohttp's own errors become one-line JSON;
    anything else a 500 with the exception's first line (the traceback goes to the
    server's log only). `max_body_bytes`: the app's `client_max_size`, for the 413's line."""
    from aiohttp import web

    @web.middleware
    async def middleware(request, handler):
        try:
            return await handler(request)
        except HttpError as e:
            return json_response({"error": e.message}, status=e.status, headers=e.headers)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            reason = e.text if e.text and not e.text.startswith("<") else e.reason
            what = f"{request.method} {request.path}"
            if e.status == 404:
                reason = f"no such endpoint: {what} (docs/agent_server.md lists them)"
            elif e.status == 405:
                reason = f"method not allowed: {what}"
            elif e.status == 413:
                reason = f"request body larger than {max_body_bytes} bytes; send less (docs/agent_server.md#errors)"
            return json_response({"error": str(reason).splitlines()[0]}, status=e.status)
        except Exception as e:  # noqa: BLE001 - never a traceback to the client
            log.exception("request %s %s failed", request.method, request.path)
            first = (str(e).splitlines() or [""])[0]
            return json_response({"error": f"internal error: {type(e).__name__}: {first}"}, status=500)

    return middleware


async def read_answer(resp, limit: int = MAX_BODY_BYTES) -> Any:
    """A client's read of an answer's JSON, at most `limit` bytes (a server that answers
    without end does not fill the reader's memory); ValueError for too large, not JSON
    or nested too deeply; None for an empty body."""
    if resp.content_length is not None and resp.content_length > limit:
        raise ValueError(f"the answer is {resp.content_length} bytes, over the limit of {limit}")
    raw = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        raw += chunk
        if len(raw) > limit:
            raise ValueError(f"the answer is over the limit of {limit} bytes")
    if not raw:
        return None
    try:
        return json.loads(bytes(raw))
    except RecursionError:
        raise ValueError("the answer is nested too deeply to read") from None


async def read_json(request) -> dict:
    try:
        raw = await request.read()
    except Exception as e:  # noqa: BLE001 - a body over the size limit, a broken stream
        if getattr(e, "status", None) == 413:
            raise  # aiohttp's own: error_middleware names the app's limit
        raise HttpError(400, f"could not read the request body: {e}") from None
    if not raw:
        raise bad("empty body; send a JSON object (Content-Type: application/json)")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"body is not JSON: {e}") from None
    except RecursionError:
        # json's C scanner recurses per nesting level: `[` * 100000 would be a 500
        raise bad("body is nested too deeply to read; send a flat JSON object") from None
    if not isinstance(body, dict):
        raise bad(f"body must be a JSON object, not {type(body).__name__}")
    return body
