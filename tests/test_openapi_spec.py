"""The OpenAPI documents (docs/openapi/*.json, written by scripts/openapi_doc.py from
controller/agent_server/openapi.py) cannot drift from the code: the files are what the
script writes; every route each server's app registers is in its document and every
path and method there is a route; and real requests to the real servers (one agent
server process, the policy endpoint over a real engine) and their real answers,
successes and refusals, validate against the documents' schemas (jsonschema)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import jsonschema  # in the test extras (pyproject): a skip would hide a drifted spec
import pytest

from agent_server_world import request
from one_server_world import OneServer, open_one_server

pytest.importorskip("aiohttp")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "openapi_doc.py"
METHODS = {"get", "post", "put", "patch", "delete"}


def load(name: str) -> dict:
    return json.loads((REPO / "docs" / "openapi" / name).read_text())


def script():
    spec = importlib.util.spec_from_file_location("openapi_doc", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documents_are_what_the_script_writes():
    assert script().main(["--check"]) == 0, "run python scripts/openapi_doc.py"


def spec_routes(doc: dict) -> set[tuple[str, str]]:
    return {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops if m in METHODS}


def app_routes(app) -> set[tuple[str, str]]:
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}


def test_every_route_a_server_answers_is_in_its_document_and_every_documented_route_is_answered():
    from rolloutdb.controller.agent_server.env_server import AgentServer
    from rolloutdb.controller.agent_server.policy_endpoint import PolicyEndpoint

    agent = AgentServer(None, name="spec", mode="export_restore", task={}, token="spec-token-0123456789")
    policy = PolicyEndpoint(None, None, owner={}.get, tokens=["spec-token-0123456789"])  # type: ignore[arg-type]
    for doc, app in [(load("agent_server.json"), agent.app()), (load("policy_endpoint.json"), policy.build_app())]:
        code, documented = app_routes(app), spec_routes(doc)
        assert code, "no routes read from the app"
        assert code == documented, f"{doc['info']['title']}: only in code {sorted(code - documented)}, " \
                                   f"only in the document {sorted(documented - code)}"


class Checked:
    """Send requests and validate each request body and each answer against a document."""

    def __init__(self, doc: dict, base: str):
        self.doc, self.base = doc, base
        self.seen: set[tuple[str, str, int]] = set()

    def schema(self, schema: dict) -> Any:
        # the refs are `#/components/...`: resolve them against a root that holds the components
        return jsonschema.Draft202012Validator({**schema, "components": self.doc["components"]})

    def __call__(self, method: str, template: str, path: str | None = None, body: Any = None,
                 headers: dict | None = None, malformed: bool = False) -> tuple[int, Any]:
        """`malformed`: a body the document must refuse, as the server does (400)."""
        op = self.doc["paths"][template][method.lower()]
        if body is not None and "requestBody" in op:
            checker = self.schema(op["requestBody"]["content"]["application/json"]["schema"])
            assert checker.is_valid(body) is not malformed, f"{method} {template}: the document and the server " \
                                                            f"disagree on {body}"
        status, text = request(self.base, method, path or template, body, headers=headers)
        answer = json.loads(text)
        assert str(status) in op["responses"], f"{method} {template} answered {status}, not in the document: {text}"
        self.schema(op["responses"][str(status)]["content"]["application/json"]["schema"]).validate(answer)
        self.seen.add((method, template, status))
        return status, answer


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with open_one_server(tmp_path_factory.mktemp("openapi")) as w:
        yield w


def test_a_stale_spec_schema_is_caught_by_the_validation(world: OneServer):
    doc = load("agent_server.json")
    doc["paths"]["/health"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]["required"].append(
        "no_such_field")
    with pytest.raises(jsonschema.ValidationError):
        Checked(doc, world.url)("GET", "/health")


def test_real_agent_server_requests_and_answers_follow_the_document(world: OneServer):
    from rolloutdb.controller.agent_server import fencing, wire
    from rolloutdb.gpu_capture.protocol import SamplingParams

    call = Checked(load("agent_server.json"), world.url)
    assert call("GET", "/health")[1]["fencing"] is True
    # the body the controller's client sends (client.run_episode)
    policy = wire.completion_body([0], SamplingParams(max_tokens=4, seed=3))
    policy.pop("prompt"), policy.pop("model")
    key = "60.0-a1"
    world.owners[key] = key
    body = {"key": key, **fencing.identity(key), "prompt_id": 2, "seed": 9,
            "policy": {"url": world.policy_url, **policy}}
    world.engine.hold = lambda rid: rid == f"{key}-t1"
    assert call("POST", "/episodes", body=body)[0] == 201
    world.engine.wait_held(1)
    assert call("GET", "/episodes/{key}", f"/episodes/{key}")[0] == 202
    assert call("POST", "/episodes", body=body)[0] == 409  # the key exists
    assert call("POST", "/episodes", body={**body, "key": "60.0-a0", "attempt": 0})[0] == 409  # stale
    cid = {"checkpoint_id": "spec-1"}
    assert call("POST", "/checkpoint/prepare", body={**cid, "lease_s": 60})[0] == 200
    assert call("POST", "/episodes", body={**body, "key": "61.0-a0", **fencing.identity("61.0-a0")})[0] == 409
    assert call("GET", "/checkpoint/export", "/checkpoint/export?checkpoint_id=spec-1")[0] == 409  # not committed
    assert call("POST", "/checkpoint/commit", body=cid)[0] == 200
    assert call("POST", "/checkpoint/drain", body=cid)[0] == 200
    status, exported = call("GET", "/checkpoint/export", "/checkpoint/export?checkpoint_id=spec-1")
    assert status == 200 and key in exported["episodes"]
    assert call("POST", "/checkpoint/resume", body=cid)[1] == {"resumed": True}
    world.engine.release()
    assert call("GET", "/episodes/{key}", f"/episodes/{key}?wait_s=30")[1]["status"] == "finished"
    assert call("DELETE", "/episodes/{key}", f"/episodes/{key}")[0] == 200
    assert call("GET", "/episodes/{key}", f"/episodes/{key}")[0] == 404
    assert call("POST", "/agents/install", body={"episodes": {"60.0-a2": exported["episodes"][key]}})[0] == 201
    assert call("POST", "/agents/uninstall", body={"keys": ["60.0-a2"]})[1] == {"uninstalled": 1}
    assert call("POST", "/checkpoint/retire", body={"keys": ["60.0-a3"]})[1] == {"retired": 0}
    assert call("POST", "/episodes", body={"key": "bad"}, malformed=True)[0] == 400
    assert call("GET", "/health", headers={"Authorization": "Bearer wrong-token-0123456789"})[0] == 401
    assert call("POST", "/reset", body={})[0] == 200


def test_real_policy_endpoint_requests_and_answers_follow_the_document(world: OneServer):
    from rolloutdb.controller.agent_server import wire
    from rolloutdb.gpu_capture.protocol import SamplingParams

    call = Checked(load("policy_endpoint.json"), world.policy_url)
    assert call("GET", "/health")[0] == 200
    world.owners["70.0-a0"] = "70.0-a0"
    body = wire.completion_body([1, 2, 3], SamplingParams(max_tokens=4, seed=1))  # what an agent sends
    turn = {wire.EPISODE_HEADER: "70.0-a0", wire.TURN_HEADER: "0"}
    status, answer = call("POST", "/v1/completions", body=body, headers=turn)
    assert status == 200 and len(answer["choices"][0]["token_ids"]) == len(answer["choices"][0]["policy_versions"])
    assert call("POST", "/v1/completions", body=body, headers={**turn, wire.EPISODE_HEADER: "71.0-a0"})[0] == 409
    assert call("POST", "/v1/completions", body=body)[0] == 400  # no episode header
    assert call("POST", "/v1/completions", body={**body, "prompt": []}, headers=turn, malformed=True)[0] == 400
