"""One real agent server process (mode export_restore, the 3-turn digits task, a toy
tool with an effect outside the episode: tests/effect_tools.py) and a real policy endpoint
over a real engine behind a gate (`HeldEngine`), for the tests of fencing
(test_agent_server_fencing.py) and of the OpenAPI documents (test_openapi_spec.py).
One server starts in ~8 s idle, much longer on busy cores.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from agent_server_world import TOKEN, HeldEngine, ok, request
from rolloutdb.config import load_config
from rolloutdb.controller.agent_server.http_loop import HttpLoop
from rolloutdb.controller.agent_server.policy_endpoint import PolicyEndpoint
from rolloutdb.controller.agent_server.process import ServerProcess
from rolloutdb.controller.job import build
from rolloutdb.gpu_capture.reference_engine import ReferenceEngine

TOOL = f"{Path(__file__).with_name('effect_tools.py')}:record_effect"
CONFIG = """
run: {seed: 0}
generation: {max_tokens: 4}
environment:
  task: digits
  kind: copy
  n_digits: 2
  turns: 3
  dataset_size: 8
  servers:
    - {name: agents, mode: export_restore}
rollout_recovery: {target_level: turn}
"""


class OneServer:
    """The server (`url`, its `proc`), the endpoint (`policy_url`, `engine`) and the files
    the tool writes (`plays`: every play of a turn; `effects`: each key once)."""

    proc: ServerProcess
    url: str
    engine: HeldEngine
    endpoint: PolicyEndpoint
    policy_url: str

    def __init__(self, root: Path):
        self.root = root
        self.plays, self.effects = root / "plays.txt", root / "effects.txt"
        self.owners: dict[str, str] = {}

    def start(self, key: str, **extra) -> tuple[int, str]:
        self.owners[key] = key
        return request(self.url, "POST", "/episodes", {"key": key, "prompt_id": 1, "seed": 5, "policy": {
            "url": self.policy_url, "max_tokens": 4}, **extra})

    def result(self, key: str) -> dict:
        return ok(self.url, "GET", f"/episodes/{key}?wait_s=30")

    def played(self, episode: str) -> list[tuple[str, int]]:
        lines = self.plays.read_text().split("\n") if self.plays.exists() else []
        return [(k, int(a)) for k, a in (line.split() for line in lines if line) if k.startswith(episode + "/")]


@contextlib.contextmanager
def open_one_server(root: Path) -> Iterator[OneServer]:
    """Start the server and the endpoint under `root`; stop them on exit."""
    cfg = root / "run.yaml"
    cfg.write_text(CONFIG)
    policy = build.build_policy(load_config(cfg), root / "policy")
    f = OneServer(root)
    saved = {k: os.environ.get(k) for k in ("ROLLOUTDB_TEST_PLAYS", "ROLLOUTDB_TEST_EFFECTS")}
    os.environ.update(ROLLOUTDB_TEST_PLAYS=str(f.plays), ROLLOUTDB_TEST_EFFECTS=str(f.effects))
    with contextlib.ExitStack() as stack:
        for k, v in saved.items():
            stack.callback(lambda k=k, v=v: os.environ.pop(k, None) if v is None else os.environ.update({k: v}))
        f.proc = ServerProcess(config_path=cfg, name="agents", policy_dir=policy, log_path=root / "agents.log",
                               start_timeout_s=600, token=TOKEN, tool=TOOL)
        stack.callback(f.proc.stop)
        f.url = f.proc.start()
        real = ReferenceEngine(policy, max_batch_size=16, num_threads=1)
        stack.callback(real.close)
        loop = HttpLoop()
        stack.callback(loop.close)
        f.engine = HeldEngine(real)
        stack.callback(f.engine.release)
        f.endpoint = PolicyEndpoint(f.engine, loop, owner=f.owners.get, tokens=[TOKEN])
        f.policy_url = f.endpoint.start()
        stack.callback(f.endpoint.close)
        yield f
