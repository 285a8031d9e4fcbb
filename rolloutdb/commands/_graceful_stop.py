"""How `rolloutdb train` stops on SIGTERM and SIGINT: the one place their handlers live.

Schedulers send SIGTERM before they kill (SLURM `KillWait`, Kubernetes
`terminationGracePeriodSeconds`: 30 s by default, then SIGKILL), and Ctrl-C sends
SIGINT. The first of either asks the controller to stop gracefully
(`Controller.request_shutdown`: no new group handed out, the step in progress ends, a due
or in-progress trainer checkpoint is published, a final rollout snapshot is taken) and
arms a timer of `run.shutdown_grace_s`. A second signal, or the timer, ends the process at
once with what is durable: every snapshot published so far (publication is a rename, so
none is ever half there), and every committed mutation of the live store. With a grace of
0 the first signal does that.

Exit codes: 128 + the first signal's number, as a shell reports a process the signal
killed (143 for SIGTERM, 130 for SIGINT), whether the stop was graceful or at once: job
scripts that requeue on 143 keep working. Either way the last lines on stderr say what was
saved and the command that continues the run.

Python runs a handler on the main thread between bytecodes, so it may interrupt that
thread anywhere, inside a lock included. The graceful path therefore only sets one
attribute (`request_shutdown`) and the timer (one system call); the at-once path writes
its lines with `os.write` and leaves with `os._exit`, both safe at any point (and it must
not unwind: `finally` blocks would wait on the very threads and locks it is leaving).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """Installed around `Controller.run` (`install`/`uninstall`). `request(reason)` asks for
    the graceful stop; `saved()` says, from attributes only, what a stop now leaves."""

    def __init__(self, grace_s: float, continue_with: str, *, request: Callable[[str], None],
                 saved: Callable[[], str]):
        self.grace_s = grace_s
        self.continue_with = continue_with  # the command that continues the run
        self.request = request
        self.saved = saved
        self.signum: int | None = None  # the first signal
        self._previous: dict[int, Any] = {}  # what signal.signal returned

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum or signal.SIGTERM)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "no signal"

    def install(self) -> bool:
        """Only the main thread can set handlers: elsewhere (a library caller's thread) the
        process keeps the handlers it has. Returns whether they were installed."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._on_alarm)
        return True

    def uninstall(self) -> None:
        if not self._previous:
            return
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self._previous.items():
            # None: a handler not set from Python; the default is what the process had.
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            self._exit_now(f"a second signal ({name})")
        self.signum = signum
        if self.grace_s <= 0:
            self._exit_now(f"{name}, run.shutdown_grace_s is 0")
        self.request(name)
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def _on_alarm(self, _signum: int, _frame: FrameType | None) -> None:
        self._exit_now(f"{self.signal_name}, and run.shutdown_grace_s ({self.grace_s:g} s) ran out")

    def _exit_now(self, why: str) -> None:
        text = (f"rolloutdb: stopped at once ({why}); saved: {self.saved()}\n"
                f"rolloutdb: to continue: {self.continue_with}\n")
        try:
            os.write(2, text.encode("utf-8", "replace"))
        finally:
            os._exit(self.exit_code)
