"""Environments as separate servers (docs/agent_server.md has the HTTP protocol).

An agent server is a separate process that runs episodes and calls the policy over HTTP.
The pieces, one module each:

- `wire`: the JSON shapes both sides send, their validation and one-line errors;
- `http_loop`: the one asyncio loop thread (`rolloutdb-http`) the controller runs its
  HTTP server and clients on;
- `policy_endpoint`: the controller's OpenAI-compatible `/v1/completions` over its
  engine; every call is tied to a running attempt by a header;
- `env_server`: the agent server process (`python -m rolloutdb.controller.agent_server.env_server`
  or `rolloutdb-agent-server`): runs the built-in tasks' episodes, exports them at a cut;
- `fencing`: each turn's idempotency key, the rule that stops stale attempts, and the
  tools the agent server calls with them;
- `openapi`: the protocol as OpenAPI documents (scripts/openapi_doc.py writes them);
- `process`: starting, health-waiting, restarting and stopping a server process;
- `client`: the controller's side: episodes run on servers (`AgentPool`) and the HTTP
  `EnvironmentCheckpoint` backend.

Nothing outside this package imports aiohttp: a run without servers never loads it.
"""
