"""`rolloutdb upgrade PATH`: migrate a store or snapshot file to the newest schema.

The file is checked first (a SQLite file, whole, passing integrity_check, at a revision
this rolloutdb knows), then a copy beside it is migrated and renamed over it, so the
file is either the old one or the fully upgraded one, never half of each. A refused
file keeps its bytes and no side files are left behind.
"""

from __future__ import annotations

import argparse

from rolloutdb.store.errors import NotAStoreError, StoreError
from rolloutdb.store.revision import head_revision, upgrade_file

DESCRIPTION = """\
Migrate a rolloutdb store or snapshot file to the newest schema revision this rolloutdb
knows (head: {head}). A copy is migrated and then atomically put in place of the file;
on any error the file is left exactly as it was.

Refused, with one line starting with "error:": a missing path, a directory, a file that
is not SQLite, a truncated or damaged file (integrity_check), and a file whose revision
is newer than this rolloutdb (upgrade rolloutdb instead). Stop the run that uses the file
first: a file in use by another process is refused.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "upgrade",
        help="migrate a store or snapshot file to the newest schema revision",
        description=DESCRIPTION.format(head=head_revision()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="PATH", help="the .sqlite store or snapshot file to upgrade in place")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        old, new = upgrade_file(args.path)
    except StoreError as e:
        # One line, whatever SQLite put in the message.
        raise type(e)(" ".join(str(e).split())) from e
    except OSError as e:
        # A read-only directory or a full disk: the rename never happened.
        raise NotAStoreError(f"{args.path}: cannot write the upgraded copy beside it ({e.strerror or e}); "
                             "free space or fix permissions, then retry") from e
    if old == new:
        print(f"{args.path}: up to date ({new})")
    else:
        print(f"{args.path}: upgraded {old} -> {new}")
    return 0
