"""Starting and stopping an agent server process the controller owns.

The server prints `rolloutdb-agent-server listening on URL` once it accepts requests (it
binds port 0, so no free-port race); its log goes to a file in the run's logs. It gets
the controller's pid and stops by itself when the controller is gone (a SIGKILLed
controller leaves no orphan serving a dead run). `stop` is SIGTERM, then SIGKILL.
Its token travels in its environment (`auth.TOKEN_ENV`), never on its command line,
which every local user can read in `ps`; its policy endpoint is fixed (`--policy-url`).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

from rolloutdb.controller.agent_server.auth import TOKEN_ENV

LISTENING = "rolloutdb-agent-server listening on "


class ServerStartError(RuntimeError):
    pass


class ServerProcess:
    def __init__(self, *, config_path: Path, name: str, policy_dir: Path, log_path: Path, start_timeout_s: float,
                 token: str, policy_url: str | None = None, mode: str | None = None, tool: str | None = None):
        self.config_path, self.name, self.policy_dir = Path(config_path), name, Path(policy_dir)
        self.token = token
        self.policy_url = policy_url  # set before start when the endpoint listens
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.mode = mode
        self.tool = tool  # FILE:FUNCTION, the server's --tool
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.starts = 0

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "rolloutdb.controller.agent_server.env_server", "--config", str(self.config_path),
               "--server", self.name, "--policy-dir", str(self.policy_dir), "--port", "0",
               "--parent-pid", str(os.getpid())]
        cmd += ["--policy-url", self.policy_url] if self.policy_url else []
        cmd += ["--tool", self.tool] if self.tool else []
        return cmd + (["--mode", self.mode] if self.mode else [])

    def start(self) -> str:
        """Start the process and return its URL once it listens (blocking)."""
        self.stop()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
        try:
            self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", TOKEN_ENV: self.token})
        finally:
            log.close()
        self.starts += 1
        self.url = self._wait_listening()
        return self.url

    def _wait_listening(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout_s
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        buf = b""
        try:
            while time.monotonic() < deadline:
                if sel.select(timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
                    chunk = os.read(self.proc.stdout.fileno(), 4096)
                    buf += chunk
                    for line in buf.decode(errors="replace").splitlines():
                        if line.startswith(LISTENING):
                            return line[len(LISTENING):].strip()
                    if not chunk and self.proc.poll() is not None:
                        break
                elif self.proc.poll() is not None:
                    break
        finally:
            sel.close()
        code = self.proc.poll()
        self.stop()
        tail = self._log_tail()
        what = f"exited with status {code}" if code is not None else f"did not listen within {self.start_timeout_s:g} s"
        raise ServerStartError(f"agent server {self.name} {what}; its log {self.log_path} ends: {tail}")

    def _log_tail(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return lines[-1][:300] if lines else "(empty)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if proc.stdout is not None:
            proc.stdout.close()
