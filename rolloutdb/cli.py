"""The `rolloutdb` command. Each subcommand lives in its own module and registers itself
here; every error the user can cause prints one line starting with `error:` and exits 2."""

from __future__ import annotations

import argparse
import os
import sys

from rolloutdb.store.errors import StoreError

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    from rolloutdb import commands

    parser = argparse.ArgumentParser(
        prog="rolloutdb",
        description="Keep the in-flight state of asynchronous RL in SQLite; inspect, upgrade and verify it.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in commands.REGISTRY:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (StoreError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `rolloutdb inspect ... | head`: the reader left; that is not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
