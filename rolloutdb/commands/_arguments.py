"""Argument types the subcommands share (the leading underscore keeps it out of command
discovery)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

DEFAULT_TIMEOUT_S = 30.0  # a user's query (inspect --sql, sql) stops after this long unless told otherwise


def path_argument(text: str) -> Path:
    """argparse `type=` for a PATH argument: one the OS cannot even look up (a NUL byte,
    a name longer than the file system allows, a parent that may not be searched) is a
    usage error, one line. A missing path passes: each command says what it expected."""
    try:
        os.lstat(text)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} contains a NUL byte") from None
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e.strerror}") from None
    return Path(text)


def positive_seconds(text: str) -> float:
    """argparse `type=` for a --timeout: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value
