"""The HTTP protocol as OpenAPI 3.1 documents, one per server: the agent server's
(docs/openapi/agent_server.json) and the policy endpoint's (docs/openapi/policy_endpoint.json).

Two documents, not one: they are two servers at two base URLs, implemented by different
parties (a team writes an agent server; the controller serves the policy endpoint), and
an author of one needs only its own. `scripts/openapi_doc.py` writes them from this
module (`--check` fails when the files differ); tests/test_openapi_spec.py ties this
module to the code: every route the apps register is here and every path here is a
route, and real requests and answers of the real servers validate against the schemas.

The bounds come from `wire` (the one place the servers check them), so a changed limit
changes the document. Nothing here runs while a server serves.
"""

from __future__ import annotations

from typing import Any

from rolloutdb import sampling_limits as limits
from rolloutdb.controller.agent_server import auth, wire

OPENAPI = "3.1.0"
VERSION = f"{wire.PROTOCOL}"

Schema = dict[str, Any]


def obj(required: dict[str, Schema], optional: dict[str, Schema] | None = None, *, open_: bool = True,
        description: str | None = None) -> Schema:
    """A JSON object; `open_`: unknown fields pass (the servers ignore them)."""
    out: Schema = {"type": "object", "properties": {**required, **(optional or {})}, "required": sorted(required)}
    if not open_:
        out["additionalProperties"] = False
    if description:
        out["description"] = description
    return out


def integer(lo: int | None = None, hi: int | None = None, description: str | None = None) -> Schema:
    out: Schema = {"type": "integer"}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    if description:
        out["description"] = description
    return out


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


STRING: Schema = {"type": "string"}
NUMBER: Schema = {"type": "number"}
BOOLEAN: Schema = {"type": "boolean"}
ANY_OBJECT: Schema = {"type": "object"}
TOKEN_IDS: Schema = {"type": "array", "items": integer(0, 2**31 - 1), "maxItems": wire.MAX_TOKENS}
LOGPROBS: Schema = {"type": "array", "items": NUMBER, "maxItems": wire.MAX_TOKENS}
VERSIONS: Schema = {"type": "array", "items": integer(-1), "maxItems": wire.MAX_TOKENS,
                    "description": "the policy version of each token; -1 marks the environment's tokens"}

COMMON_SCHEMAS: dict[str, Schema] = {
    "Error": obj({"error": {"type": "string", "pattern": "^[^\\n]+$"}}, open_=False,
                 description="Every refusal and failure: one line saying what is wrong and what to do."),
    "EpisodeKey": {"type": "string", "pattern": f"^{wire.EPISODE_KEY.pattern}$",
                   "description": "<group>.<generation>-a<attempt>, decimal, no leading zeros"},
}

SAMPLING: dict[str, Schema] = {
    "max_tokens": integer(1, limits.MAX_TOKENS),
    "min_tokens": integer(0, limits.MAX_TOKENS),
    "temperature": NUMBER, "top_p": NUMBER,
    "seed": integer(0, limits.MAX_SEED),
    "stop": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": wire.MAX_STOP_CHARS},
                       {"type": "array", "maxItems": wire.MAX_STOP,
                        "items": {"type": "string", "minLength": 1, "maxLength": wire.MAX_STOP_CHARS}}]},
    "presence_penalty": NUMBER, "frequency_penalty": NUMBER,
    "n": {"const": 1}, "logprobs": {}, "return_token_ids": {}, "model": STRING,
}


def error_responses(*statuses: int) -> dict[str, Any]:
    """Every route may also answer 400 (a malformed request), 401 (no or a wrong token),
    413 (a body over the cap) and 500 (an unexpected failure), all as `Error`."""
    described = {400: "malformed request", 401: "no bearer token, or a wrong one (WWW-Authenticate: Bearer)",
                 403: "forbidden", 404: "no such episode or agent", 409: "conflicts with the server's state",
                 413: "body over the size cap", 429: "the server holds max_agents agents",
                 500: "an unexpected failure (its first line)", 503: "the engine is not taking calls"}
    every = sorted(set(statuses) | {400, 401, 413, 500})
    return {str(s): {"description": described[s], "content": {"application/json": {"schema": ref("Error")}}}
            for s in every}


def operation(summary: str, ok: dict[int, Schema], errors: tuple[int, ...] = (), body: Schema | None = None,
              parameters: list[dict] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {
        **{str(s): {"description": "success" if s < 300 else "accepted, still running",
                    "content": {"application/json": {"schema": schema}}} for s, schema in ok.items()},
        **error_responses(*errors)}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if parameters:
        op["parameters"] = parameters
    return op


def document(title: str, description: str, paths: dict[str, Any], schemas: dict[str, Schema]) -> dict[str, Any]:
    return {
        "openapi": OPENAPI,
        "info": {"title": title, "version": VERSION, "description": description},
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": auth.SCHEME.lower(),
                                           "description": "the run's token on every request (docs/agent_server.md"
                                                          "#who-may-call)"}},
            "schemas": {**COMMON_SCHEMAS, **schemas},
        },
    }


# ---------------------------------------------------------------- the agent server

AGENT = obj({"turn": integer(0, 1_000_000), "state": ANY_OBJECT},
            {"token_ids": TOKEN_IDS, "logprobs": LOGPROBS, "token_versions": VERSIONS},
            description="one exported (or installed) agent; token_ids, logprobs and token_versions all or none")
CHECKPOINT_ID = obj({"checkpoint_id": STRING})
KEYS = obj({"keys": {"type": "array", "items": ref("EpisodeKey"), "maxItems": wire.MAX_KEYS}})
EPISODES = {"type": "object", "propertyNames": ref("EpisodeKey"), "additionalProperties": ref("Agent"),
            "maxProperties": wire.MAX_KEYS}
KEY_PARAM = {"name": "key", "in": "path", "required": True, "schema": ref("EpisodeKey")}


def agent_server() -> dict[str, Any]:
    health = obj({"status": {"const": "ok"}, "protocol": {"const": wire.PROTOCOL},
                  "mode": {"enum": list(wire.MODES)}},
                 {"fencing": {**BOOLEAN, "description": "true: the server implements the fencing rule"},
                  "dispatch": {"enum": ["open", "closed"]}, "checkpoint_id": {"type": ["string", "null"]},
                  "name": STRING, "max_turns": integer(1), "episodes": integer(0), "running": integer(0),
                  "installed": integer(0), "max_agents": integer(1), "lease_expirations": integer(0)})
    start = obj({"key": ref("EpisodeKey"), "prompt_id": integer(0, 2**31 - 1), "seed": integer(0, 2**63 - 1),
                 "policy": obj({"url": {"type": "string", "pattern": "^https?://"}}, SAMPLING)},
                {"episode": {**STRING, "description": "the key without its -a<N> suffix (derived when absent)"},
                 "attempt": integer(0, 2**31 - 1, "the fencing token (derived from the key when absent)"),
                 "continue_from": ref("EpisodeKey")})
    running = obj({"key": ref("EpisodeKey"), "status": {"const": "running"}, "turn": integer(0)})
    finished = obj({"key": ref("EpisodeKey"), "status": {"const": "finished"}, "turn": integer(0), "reward": NUMBER,
                    "token_ids": TOKEN_IDS, "logprobs": LOGPROBS, "token_versions": VERSIONS,
                    "finish_reasons": {"type": "array", "items": STRING}})
    failed = obj({"key": ref("EpisodeKey"), "status": {"const": "failed"}, "turn": integer(0),
                  "reason": {"enum": ["error", "deadline"]}, "error": STRING})
    wait = {"name": "wait_s", "in": "query", "required": False,
            "schema": {"type": "number", "minimum": 0, "maximum": 60}}
    cid_query = {"name": "checkpoint_id", "in": "query", "required": True, "schema": STRING}
    paths = {
        "/health": {"get": operation("the server's protocol, mode and counts", {200: health})},
        "/episodes": {"post": operation(
            "register and start one episode (refused: 409 dispatch closed, key exists, stale attempt)",
            {201: obj({"key": ref("EpisodeKey"), "turn": integer(0)})}, (403, 404, 409, 429), start)},
        "/episodes/{key}": {
            "get": operation("the episode: 202 running, 200 finished or failed",
                             {200: {"oneOf": [finished, failed]}, 202: running}, (404,), None, [KEY_PARAM, wait]),
            "delete": operation("forget the episode (cancelling it)",
                                {200: obj({"key": ref("EpisodeKey"), "forgotten": {"const": True}})}, (404,), None,
                                [KEY_PARAM]),
        },
        "/checkpoint/retire": {"post": operation("cancel and forget these keys", {200: obj({"retired": integer(0)})},
                                                 (), KEYS)},
        "/checkpoint/prepare": {"post": operation(
            "close dispatch and start the lease", {200: obj({"checkpoint_id": STRING, "episodes": integer(0)})}, (409,),
            obj({"checkpoint_id": STRING, "lease_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600}}))},
        "/checkpoint/commit": {"post": operation("copy every agent as it is now",
                                                 {200: obj({"episodes": integer(0)})}, (409,), CHECKPOINT_ID)},
        "/checkpoint/drain": {"post": operation("return once no turn is half applied",
                                                {200: obj({"drained": {"const": True}})}, (409,), CHECKPOINT_ID)},
        "/checkpoint/export": {"get": operation(
            "the committed copy", {200: obj({"checkpoint_id": STRING, "episodes": EPISODES})}, (409,), None,
            [cid_query])},
        "/checkpoint/resume": {"post": operation("reopen dispatch (resumed: false for another id)",
                                                 {200: obj({"resumed": BOOLEAN})}, (), CHECKPOINT_ID)},
        "/agents/install": {"post": operation("hold exported agents for continue_from",
                                              {201: obj({"installed": integer(0)})}, (409, 429),
                                              obj({"episodes": EPISODES}))},
        "/agents/uninstall": {"post": operation("drop installed agents", {200: obj({"uninstalled": integer(0)})},
                                                (), KEYS)},
        "/reset": {"post": operation("forget every episode, installed agent, checkpoint and fencing attempt",
                                     {200: obj({"forgotten": integer(0)})}, (), ANY_OBJECT)},
    }
    return document("rolloutdb agent server", "Runs multi-turn episodes and exports them at a checkpoint "
                    "(docs/agent_server.md: the guarantees per phase and per mode).", paths, {"Agent": AGENT})


# ---------------------------------------------------------------- the policy endpoint


def policy_endpoint() -> dict[str, Any]:
    health = obj({"status": {"const": "ok"}, "model": STRING, "policy_version": {"type": "integer"},
                  "calls": integer(0)})
    request = obj({"prompt": {"oneOf": [{**TOKEN_IDS, "minItems": 1},
                                        {"type": "array", "minItems": 1, "maxItems": 1,
                                         "items": {**TOKEN_IDS, "minItems": 1}}]}}, SAMPLING)
    choice = obj({"index": {"const": 0}, "text": STRING, "token_ids": TOKEN_IDS,
                  "logprobs": obj({"token_logprobs": LOGPROBS}), "finish_reason": STRING,
                  "policy_versions": {"type": "array", "items": {"type": "integer"}}})
    answer = obj({"id": STRING, "object": {"const": "text_completion"}, "created": integer(0), "model": STRING,
                  "choices": {"type": "array", "items": choice, "minItems": 1, "maxItems": 1},
                  "usage": obj({"prompt_tokens": integer(0), "completion_tokens": integer(0),
                                "total_tokens": integer(0)})})
    headers = [{"name": wire.EPISODE_HEADER, "in": "header", "required": True, "schema": ref("EpisodeKey"),
                "description": "the attempt the call belongs to (the key of POST /episodes)"},
               {"name": wire.TURN_HEADER, "in": "header", "required": False,
                "schema": {"type": "string", "pattern": "^[0-9]+$"}, "description": "the turn, from 0"}]
    paths = {
        "/health": {"get": operation("the endpoint's model and policy version", {200: health})},
        "/v1/completions": {"post": operation("one turn's model call: token ids in, token ids out",
                                              {200: answer}, (409, 503), request, headers)},
    }
    return document("rolloutdb policy endpoint", "OpenAI-compatible completions over the controller's engine "
                    "(docs/agent_server.md#the-policy-endpoint-served-by-the-controller).", paths, {})


DOCUMENTS = {"agent_server.json": agent_server, "policy_endpoint.json": policy_endpoint}
