"""Stopping a DuckDB query on a signal or a deadline without raising into DuckDB.

DuckDB's Python client runs Python's signal handlers from inside its own execution loop
(it calls `PyErr_CheckSignals` between tasks), so a handler that raises (Python's default
SIGINT handler, or the CLI's) raises through DuckDB's C++ frames while its worker threads
still run the query. Seen 2026-12-04 with `rolloutdb sql` and a runaway query: the process
printed "error: interrupted" and then died of SIGSEGV at exit, and twice (once in a CI run)
it hung, deaf to further SIGINT and SIGTERM, with the CPU idle.

`interruptible` does what the query timeout always did, which works: while the block runs,
SIGINT and SIGTERM only record the signal and wake a watcher thread, and that thread calls
`con.interrupt()` (DuckDB stops the query at its next task and the call in the main thread
returns with `duckdb.InterruptException`). On leaving the block the handlers in place before
are restored and the signal is raised again under them, so the caller unwinds (closing the
connection, removing its working directory) and the process ends as the signal says: the
same contract as `run_readonly_query` for SQLite.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

# How often the watcher asks `stop()` whether a stop signal was recorded before the block
# (its exception lost in a `__del__`: rolloutdb/commands/_stop_signals.py), and repeats a
# due interrupt; the check is one list lookup.
_POLL_S = 0.1


class Interruptible(Protocol):
    """What `interruptible` needs of a connection: DuckDB's `interrupt`, callable from any
    thread."""

    def interrupt(self) -> None: ...


@dataclass
class Interruption:
    """What stopped the block's query, read by the caller to name the error: `timed_out`
    (the deadline passed) or `signum` (a stop signal, raised again when the block exits)."""

    timed_out: bool = False
    signum: int | None = None
    _wake: threading.Event = field(default_factory=threading.Event)


@contextlib.contextmanager
def interruptible(connection: Callable[[], Interruptible | None], *, timeout_s: float | None = None,
                  stop: Callable[[], int | None] | None = None) -> Iterator[Interruption]:
    """Run the block with SIGINT/SIGTERM (main thread only) and a `timeout_s` deadline turned
    into `connection().interrupt()` from a watcher thread. `connection` is called when the
    interrupt is due (None: no connection yet, nothing to interrupt). `stop()`: a stop signal
    the caller recorded before the block, or None; the block's query stops as if it arrived
    during it. If a signal was recorded, it is raised again after the block, under the
    handler that was in place (and KeyboardInterrupt if that handler ignores it)."""
    state = Interruption()
    earlier = stop or (lambda: None)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    lock, done = threading.Lock(), threading.Event()

    def on_signal(signum, _frame):  # noqa: ANN001 - runs in the main thread, inside DuckDB's loop
        if state.signum is None:
            state.signum = signum
        state._wake.set()

    def due() -> bool:
        if state.signum is None and (signum := earlier()) is not None:
            state.signum = signum
        if state.signum is not None:
            return True
        if deadline is not None and time.monotonic() >= deadline:
            state.timed_out = True
            return True
        return False

    def watch() -> None:
        while not done.is_set():
            if due():
                # Again at every poll until the block ends: DuckDB forgets an interrupt that
                # lands before its query starts (a signal as the query starts then left it
                # running forever). Under the lock, so that none lands after the block.
                with lock:
                    con = None if done.is_set() else connection()
                    if con is not None:
                        con.interrupt()
                done.wait(_POLL_S)
                continue
            left = _POLL_S if deadline is None else min(_POLL_S, max(0.0, deadline - time.monotonic()))
            state._wake.wait(left)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    watcher = threading.Thread(target=watch, name="rolloutdb-duckdb-interrupt", daemon=True)
    try:
        if state.signum is None:
            state.signum = earlier()
        if state.signum is not None:
            return  # stopped before it started: the block does not run, the signal is raised below
        watcher.start()
        yield state
    finally:
        with lock:
            done.set()
        state._wake.set()
        if watcher.is_alive():
            watcher.join()
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if state.signum is not None:
            if previous:
                signal.raise_signal(state.signum)  # under the caller's handler, now restored
            raise KeyboardInterrupt  # the caller's handler ignored it (or none ran): stop anyway
