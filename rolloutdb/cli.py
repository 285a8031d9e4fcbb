"""The `rolloutdb` command. Each subcommand lives in its own module and registers itself
here; every error the user can cause prints one line starting with `error:` and exits 2.

The causes are fixed where they arise (special files refused by stat, manifests checked
for type and depth, queries bounded); `main` also catches whatever is left (an OSError,
a SQLite error, a RecursionError, any other exception) as one `error:` line, so a user
never sees a traceback of ours. ``ROLLOUTDB_TRACEBACK=1`` re-raises instead, for debugging. The
one exception is the user's own code (a reward, a factory, what a factory made) failing: its
traceback is theirs, printed above the `error:` line, which names their file:line; exit 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import sys
import threading
from typing import NoReturn

from rolloutdb.commands._stop_signals import Terminated, forget, on_stop_signal, stop_signal_received

EXIT_USAGE = 2
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGTERM = 128 + signal.SIGTERM
# Commands that only read: SIGTERM unwinds them (closing connections, removing private
# copies) instead of killing them where they stand. `train` installs its own handlers
# once its controller exists (commands/_graceful_stop.py: a final snapshot within
# run.shutdown_grace_s); before that it keeps the default, which its crash tests prove safe.
READING_COMMANDS = {"inspect", "verify", "snapshots", "trace", "sql"}
MAX_MESSAGE = 2000


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error:` line (and exit 2) like every other
    error, instead of a usage block followed by the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {self.prog}: {_one_line(message)}; see {self.prog} --help\n")


def _one_line(text: object) -> str:
    s = str(text).replace("\r", "\\r").replace("\n", "\\n")
    return s if len(s) <= MAX_MESSAGE else s[: MAX_MESSAGE - 3] + "..."


def build_parser() -> argparse.ArgumentParser:
    # Building the parser imports every command module but none of their dependencies
    # (torch, DuckDB, SQLAlchemy, Alembic: each imports them inside its `run`), so that
    # --help and --version answer at once; tests/test_cli_startup.py holds them to it.
    from rolloutdb import commands

    parser = OneLineParser(
        prog="rolloutdb",
        description="Keep the in-flight state of asynchronous RL in SQLite; inspect, upgrade and verify it.",
    )
    parser.add_argument("--version", action="version", version=f"rolloutdb {installed_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in commands.REGISTRY:
        register(sub)
    return parser


def installed_version() -> str:
    """The version of the installed distribution (its metadata, what pip shows)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rolloutdb")
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        from rolloutdb import __version__

        return f"{__version__} (not installed)"


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # a usage error (already printed as one line) or --help
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C before a command started: one line, not a traceback
        return _error("interrupted", EXIT_SIGINT)
    previous = {}
    forget()
    if args.command in READING_COMMANDS and threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, on_stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(args)
    # The one place a stop signal becomes its line: from the command (`_call`), or while
    # _run imports the store (~0.5 s of SQLAlchemy; seen: SIGTERM 0.8 s into `trace`).
    except KeyboardInterrupt:
        return _error("interrupted", EXIT_SIGINT)
    except Terminated:
        return _error("terminated (SIGTERM)", EXIT_SIGTERM)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _error(message: object, code: int = EXIT_USAGE) -> int:
    print(f"error: {_one_line(message)}", file=sys.stderr)
    return code


def _call(args: argparse.Namespace) -> int:
    """The command. Once a stop signal is recorded, whatever the command ended with becomes
    that signal's exception: its own may have been lost (commands/_stop_signals.py), or a
    library turned it into an error of its own (DuckDB's client raises RuntimeError('Query
    interrupted'), for a SIGTERM too)."""
    try:
        code = int(args.func(args) or 0)
    except BaseException:
        if stop_signal_received() is None:
            raise
    signum = stop_signal_received()
    if signum is not None:
        raise (KeyboardInterrupt if signum == signal.SIGINT else Terminated)() from None
    return code


def _run(args: argparse.Namespace) -> int:
    from rolloutdb.store import StoreError

    try:
        return _call(args)
    except (StoreError, FileExistsError, ValueError) as e:
        return _error_of(e)
    except BrokenPipeError:
        # `rolloutdb inspect ... | head`: the reader left; that is not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # noqa: BLE001 - the backstop: one line, never a traceback of ours
        theirs = _user_error(e)
        if theirs is not None:
            return _error_of(theirs)
        if os.environ.get("ROLLOUTDB_TRACEBACK"):
            raise
        return _error(_backstop_message(e))


def _error_of(e: Exception) -> int:
    """A user's code that failed (controller/tasks/user_code.py, UserCodeError) gets its traceback
    printed first: it is their code and they need it; the one `error:` line comes last."""
    user_traceback = getattr(e, "user_traceback", None)
    if user_traceback:
        print(user_traceback, file=sys.stderr)
    return _error(e)


def _user_error(e: Exception) -> Exception | None:
    """The user's error when `e` came out of their code (an environment or trainer their
    factory made, failing mid-run); only a run that loaded a plugin has loaded this."""
    user_code = sys.modules.get("rolloutdb.controller.tasks.user_code")
    return None if user_code is None else user_code.user_error_from(e)


def _backstop_message(e: Exception) -> str:
    if isinstance(e, RecursionError):
        return "input nested too deeply to process (RecursionError)"
    if isinstance(e, MemoryError):
        return "out of memory"
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror or e}"
    if isinstance(e, sqlite3.Error):
        return f"SQLite: {e}"
    return (f"unexpected {type(e).__name__}: {e} (a defect in rolloutdb; "
            "ROLLOUTDB_TRACEBACK=1 shows where)")


if __name__ == "__main__":
    sys.exit(main())
