"""A server process at a fixed loopback port that the conformance kit can kill and start
again (`restart_cmd`: SIGKILL the pid in a pid file, start the same command line). Used
for the kit's killed_between_prepare_and_commit check on real processes."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def token_file(root: Path, token: str) -> Path:
    path = root / "server.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return path


class Restartable:
    def __init__(self, root: Path, argv: list[str], port: int):
        self.root, self.argv, self.port = root, argv, port
        self.pid_file, self.log = root / "server.pid", root / "server.log"
        self.url = f"http://127.0.0.1:{port}"
        line = " ".join(shlex.quote(a) for a in argv)
        # the started server's output goes to a file: a pipe inherited by it would keep the
        # kit's subprocess.run waiting for the server to exit
        self.start_cmd = (f"cd {shlex.quote(str(REPO))} && nohup {line} >> {shlex.quote(str(self.log))} 2>&1 "
                          f"< /dev/null & echo $! > {shlex.quote(str(self.pid_file))}")
        self.restart_cmd = f"kill -9 $(cat {shlex.quote(str(self.pid_file))}); {self.start_cmd}"

    def start(self, timeout: float = 300.0) -> str:
        subprocess.run(self.start_cmd, shell=True, check=True)
        deadline = time.monotonic() + timeout
        while "listening on" not in (self.log.read_text() if self.log.exists() else ""):
            assert time.monotonic() < deadline, f"server did not start: {self.log.read_text()[-2000:]}"
            time.sleep(0.1)
        return self.url

    def stop(self) -> None:
        try:
            os.kill(int(self.pid_file.read_text()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def minimal_server(root: Path, token: str, turns: int = 3, prompts: int = 64,
                   policy_dir: Path | None = None) -> Restartable:
    """examples/agent_server_minimal/server.py: the toy task, or with `policy_dir` the
    digits copy task (2 digits, seed 0)."""
    port = free_port()
    argv = [sys.executable, str(REPO / "examples/agent_server_minimal/server.py"), "--token-file",
            str(token_file(root, token)), "--port", str(port), "--turns", str(turns), "--prompts", str(prompts)]
    argv += ["--policy-dir", str(policy_dir)] if policy_dir is not None else []
    return Restartable(root, argv, port)
