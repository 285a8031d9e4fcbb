"""The stop signals (SIGINT, SIGTERM) a reading command received (rolloutdb/cli.py installs
`on_stop_signal` for them).

A handler's exception can be lost: raised inside a weakref callback or a `__del__` that
garbage collection runs, Python prints "Exception ignored in ..." and goes on. Seen: Ctrl-C
at `inspect --sql`'s start-up landed in SQLAlchemy's `_collection_gced`, and the runaway
query then ran to its --timeout. So the signal is also recorded here, and the record
outlives the exception: a query checks it (`run_readonly_query`'s `stop`), and the CLI ends a
command that returns, or fails in any way, after one as the signal says (`cli._call`).
"""

from __future__ import annotations

import signal
from typing import NoReturn

_received: list[int] = []


class Terminated(BaseException):
    """SIGTERM arrived; a BaseException so that no `except Exception` swallows it."""


def on_stop_signal(signum, _frame) -> NoReturn:  # noqa: ANN001
    _received.append(signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated


def stop_signal_received() -> int | None:
    """The first stop signal this command received, or None."""
    return _received[0] if _received else None


def forget() -> None:
    """A new command starts with no record (tests run several in one process)."""
    _received.clear()
