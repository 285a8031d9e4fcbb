"""Argument types the subcommands share (the leading underscore keeps it out of command
discovery)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


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
