"""`rolloutdb upgrade PATH`: migrate a store or snapshot file to the newest schema.

The file is checked first (a SQLite file, whole, passing integrity_check, at a revision
this rolloutdb knows), then a copy beside it is migrated and renamed over it, so the
file is either the old one or the fully upgraded one, never half of each. A refused
file keeps its bytes and no side files are left behind.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

from rolloutdb.migrations import head_of_revision_files

DESCRIPTION = """\
Migrate a rolloutdb store or snapshot file to the newest schema revision this rolloutdb
knows (head: {head}). A copy is migrated and then atomically put in place of the file;
on any error the file is left exactly as it was.

With --out COPY, the upgraded file is written to COPY (a new file) and PATH is only
read. A file of a published snapshot (a manifest.json beside it lists it) is never
changed in place: upgrade a copy with --out (a resume from the snapshot upgrades a copy
itself). Leftovers of an upgrade that was killed are removed by the next upgrade.

Refused, with one line starting with "error:": a missing path, a directory, a file that
is not SQLite, a truncated or damaged file (integrity_check), a file whose alembic_version
is not exactly one known revision or whose schema is not that revision's, and a file of a
published snapshot, a read-only file or directory, and an --out name that is one of
PATH's own -wal/-shm/-journal files. Stop the run that uses the file first: a file another
process has open is refused, naming its pid (an idle connection in rollback-journal mode
cannot be seen; live stores use WAL, where every connection can). A run's live store
(RUN_DIR/rollout_state.sqlite) is upgraded under the run's lock, so the run cannot start
meanwhile; any other writer that opens the file during the upgrade waits, and the upgrade
then refuses, changing nothing.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "upgrade",
        help="migrate a store or snapshot file to the newest schema revision",
        description=DESCRIPTION.format(head=head_of_revision_files()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="PATH", help="the .sqlite store or snapshot file to upgrade in place")
    parser.add_argument("--out", metavar="COPY", help="write the upgraded file to COPY (a new file); PATH is only read")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rolloutdb.store import NotAStoreError, StoreError, upgrade_file

    try:
        old, new = upgrade_file(args.path, args.out, hold=run_lock_of_live_store)
    except StoreError as e:
        # One line, whatever SQLite put in the message.
        raise type(e)(" ".join(str(e).split())) from e
    except OSError as e:
        # A read-only directory or a full disk: the rename never happened.
        raise NotAStoreError(f"{args.out or args.path}: cannot write the upgraded copy beside it ({e.strerror or e}); "
                             "free space or fix permissions, then retry") from e
    if args.out is not None:
        print(f"{args.path}: upgraded {old} -> {new} into {args.out} ({args.path} left as it is)")
    elif old == new:
        print(f"{args.path}: up to date ({new})")
    else:
        print(f"{args.path}: upgraded {old} -> {new}")
    return 0


@contextlib.contextmanager
def run_lock_of_live_store(target: Path) -> Iterator[None]:
    """The run's lock while `target` is a run directory's live store: `rolloutdb train`
    takes it before it opens the store, so a run cannot start (or resume) and commit into
    a file that the upgrade is about to replace. The lock file is left as it was."""
    from rolloutdb.controller.run.run_dir import RunDir, RunLock

    run_dir = RunDir(target.parent)
    if target != run_dir.store or not run_dir.is_run_dir():
        yield
        return
    lock = RunLock.acquire(run_dir.lock_file, then=f"upgrade {target}")
    try:
        yield
    finally:
        lock.undo()
