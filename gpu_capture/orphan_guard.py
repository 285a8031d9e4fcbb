"""Child processes a backend starts must not outlive a SIGKILLed controller.

vLLM's `AsyncLLM` runs its engine core in a child process of ours. A SIGKILL of the
controller (a preemption, the crash harness) runs no cleanup, and the engine core was
seen alive 16 minutes later, holding the GPU's memory (here: the CPU's KV cache) and the
dead controller's stdout/stderr pipes, so whatever waited on those pipes hung. A resumed
run would then start a second engine beside it.

`OrphanGuard` starts one small watcher process per engine (a few lines of Python, no
imports beyond the standard library, stdio on /dev/null so it holds no pipe of ours). It
polls its parent about every `POLL_S`; when the parent is gone it SIGKILLs the processes
it was told about, each only if it is still the same process (its start time in
/proc/<pid>/stat is unchanged: a recycled pid is left alone). `close()` stops the watcher
on an orderly shutdown. Linux only (/proc); elsewhere the guard does nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

POLL_S = 0.2  # how soon after the controller's death its children die (measured: < 1 s)

_WATCHER = r"""
import os, signal, sys, time
parent, poll = int(sys.argv[1]), float(sys.argv[2])
targets = [(int(p), s) for p, s in (a.split(":") for a in sys.argv[3:])]
def started(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None
while os.getppid() == parent:
    time.sleep(poll)
for pid, start in targets:
    if started(pid) == start:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


def children_of(pid: int) -> set[int]:
    """Direct children of `pid`, from /proc (every thread's `children` list)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out.update(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return out


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


class OrphanGuard:
    """Kill `pids` (and their own children, read now) when this process dies."""

    def __init__(self, pids: Iterable[int]):
        self.watcher: subprocess.Popen | None = None
        targets = []
        for pid in sorted(set(pids)):
            for p in (pid, *sorted(children_of(pid))):
                start = _start_time(p)
                if start is not None:
                    targets.append(f"{p}:{start}")
        self.pids = [int(t.split(":")[0]) for t in targets]
        if not targets or not Path("/proc/self/stat").exists():
            return
        self.watcher = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHER, str(os.getpid()), str(POLL_S), *targets],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True)

    def close(self) -> None:
        """An orderly shutdown: the backend stopped its children itself."""
        if self.watcher is not None and self.watcher.poll() is None:
            self.watcher.kill()
            self.watcher.wait()
        self.watcher = None
