"""Planted non-conforming agent servers: the minimal example server
(examples/agent_server_minimal/server.py) with one promise broken each, served over real
HTTP in this process. Each must fail exactly its own check of the conformance kit."""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

from conftest import REPO

_spec = importlib.util.spec_from_file_location("agent_server_minimal", REPO / "examples/agent_server_minimal/server.py")
assert _spec is not None and _spec.loader is not None
minimal = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(minimal)


class IgnoresLease(minimal.Server):
    """Never reopens dispatch by itself: a dead controller's checkpoint holds it forever."""

    def checkpoint(self, route, body):
        status, out = super().checkpoint(route, body)
        if route == "prepare" and self.lease is not None:
            self.lease.cancel()
        return status, out


class ExportsBeforeDraining(minimal.Server):
    """Exports its agents as they are at export time, not the copy commit took and drain
    settled: turns played after the commit leak into the export."""

    def checkpoint(self, route, body):
        status, out = super().checkpoint(route, body)
        if route == "export":
            with self.lock:
                out["episodes"] = {k: a.view() for k, a in self.agents.items() if a.status != "failed"}
        return status, out


class Answers500ToMalformedJson(minimal.Server):
    """Parses bodies without a guard: a body that is not a JSON object is a 500."""

    def route(self, method, path, query, body):
        if method == "POST" and not isinstance(body, dict):
            raise minimal.Refused(500, "internal error: AttributeError: 'NoneType' object has no attribute 'get'")
        return super().route(method, path, query, body)


@contextlib.contextmanager
def serving(server: object) -> Iterator[str]:
    """`server` (a minimal.Server) over HTTP on a free loopback port: its base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), minimal.handler(server))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name="planted-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)
