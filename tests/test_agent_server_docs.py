"""docs/agent_server.md describes every endpoint of both servers, for a team writing its own:
each route the code registers has a heading `### METHOD PATH` in its server's section
(`## The policy endpoint ...`, `## The agent server ...`), and every such heading names a
route the code registers. Routes are read from the apps themselves (`AgentServer.app()`,
`PolicyEndpoint.build_app()`), never started."""

from __future__ import annotations

import re

import pytest

from package_layout import ROOT

pytest.importorskip("aiohttp")

DOC = ROOT / "docs" / "agent_server.md"
ROUTE_HEADING = re.compile(r"^### (GET|POST|PUT|PATCH|DELETE) (/\S*)\s*$")
SECTIONS = {"policy": "## The policy endpoint", "agent": "## The agent server"}


def documented(text: str) -> dict[str, set[tuple[str, str]]]:
    """Route headings per server section, by the section's title prefix."""
    found: dict[str, set[tuple[str, str]]] = {}
    section = None
    for line in text.splitlines():
        if line.startswith("## "):
            section = next((k for k, title in SECTIONS.items() if line.startswith(title)), None)
            continue
        m = ROUTE_HEADING.match(line)
        if m:
            assert section is not None, f"route heading {line!r} outside the two server sections"
            found.setdefault(section, set()).add((m.group(1), m.group(2)))
    return found


def routes(app) -> set[tuple[str, str]]:
    # aiohttp adds HEAD beside every GET; the doc names the GET
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}


def registered() -> dict[str, set[tuple[str, str]]]:
    from rolloutdb.controller.agent_server.env_server import AgentServer
    from rolloutdb.controller.agent_server.policy_endpoint import PolicyEndpoint

    agent = AgentServer(None, name="docs", mode="export_restore", task={}, token="docs-token-0123456789")
    policy = PolicyEndpoint(None, None, owner={}.get, tokens=["docs-token-0123456789"])  # type: ignore[arg-type]
    return {"policy": routes(policy.build_app()), "agent": routes(agent.app())}


def test_the_heading_pattern_reads_routes_per_section():
    text = "## The policy endpoint (x)\n### POST /v1/x\n## Other\n## The agent server (y)\n### GET /a/{key}\n"
    assert documented(text) == {"policy": {("POST", "/v1/x")}, "agent": {("GET", "/a/{key}")}}


def test_every_route_of_both_servers_has_its_section_in_the_doc_and_every_section_a_route():
    code, doc = registered(), documented(DOC.read_text())
    assert code["agent"] and code["policy"], "no routes read from the apps: the listing is broken"
    for server in SECTIONS:
        undocumented = sorted(code[server] - doc.get(server, set()))
        stale = sorted(doc.get(server, set()) - code[server])
        assert not undocumented, f"{server}: routes without a `### METHOD PATH` heading in {DOC.name}: {undocumented}"
        assert not stale, f"{server}: headings in {DOC.name} that name no route: {stale}"
