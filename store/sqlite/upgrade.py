"""Upgrading a store file to head through a copy, and the checks before it.

Every refusal happens before anything is written (`upgrade_file`); the copy is migrated
(`revision.run_migrations`), checked (`integrity.integrity_problems`) and renamed into
place (`fsio.replace_file`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from pathlib import Path

from .. import faults
from ..errors import NotAStoreError, StoreBusyError
from ..fsio import TEMP_SUFFIX, remove_sqlite_file, replace_file, temp_path_beside
from .identity import identify
from .integrity import check_sqlite_file, first_problem, integrity_problems
from .inuse import describe_holder, open_elsewhere
from .readonly import MANIFEST_NAME, listing_manifest, open_readonly
from .revision import head_revision, run_migrations


def _checked_open(path: Path) -> tuple[sqlite3.Connection, str, str]:
    """A read-only connection on a file that passed ``PRAGMA integrity_check`` and strict
    identification (`identity.identify`), with (revision, 'head' or 'old')."""
    path = check_sqlite_file(path)
    conn = open_readonly(path)
    try:
        problems = integrity_problems(conn, 1)
        if problems:
            raise NotAStoreError(f"{path}: damaged (integrity_check: {first_problem(problems)}); "
                                 "restore it from another snapshot")
        conn.set_authorizer(None)  # our own reads: the table-valued pragmas of the fingerprint
        return conn, *identify(conn, path)
    except sqlite3.DatabaseError as e:
        conn.close()
        raise NotAStoreError(f"{path}: unreadable SQLite file ({e}); restore it from another snapshot") from e
    except BaseException:
        conn.close()
        raise


def check_readable_store(path: str | Path) -> tuple[str, str]:
    """Refuse a file that is missing, not SQLite, truncated, damaged or not strictly
    identified; return (revision, 'head' or 'old'). Opens it read-only (`open_readonly`:
    no byte, mtime or side file changes)."""
    conn, revision, status = _checked_open(Path(path))
    conn.close()
    return revision, status


def refuse_if_open(path: str | Path, shown: str | Path | None = None, *, doing: str = "upgrade") -> None:
    """Refuse to replace a file another process has open (`inuse`): that process would
    go on writing into the unlinked old file and lose what it commits. Changes nothing."""
    pid = open_elsewhere(path)
    if pid is not None:
        raise StoreBusyError(f"{shown or path}: open in another process ({describe_holder(pid)}); stop it, then "
                             f"{doing} (its next commits would be lost if the file were replaced under it)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_upgrade_leftovers(target: Path) -> list[Path]:
    """Remove what killed upgrades of `target` left beside it: the names `temp_path_beside`
    gives (``.NAME.upgrade.PID.tmp``) and their SQLite side files, of processes that are
    gone (or of this one). A live process's copy is left to it."""
    prefix, removed = f".{target.name}.upgrade.", []
    for p in target.parent.iterdir():
        if not p.name.startswith(prefix):
            continue
        pid, sep, tail = p.name[len(prefix):].partition(TEMP_SUFFIX)
        if not (sep and pid.isdigit() and tail in ("", "-journal", "-wal", "-shm")):
            continue
        if int(pid) == os.getpid() or not _alive(int(pid)):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _wal_header_mode(path: Path) -> str:
    """The journal mode a file's header records (bytes 18-19 are 2 in WAL mode)."""
    with open(path, "rb") as f:
        header = f.read(20)
    return "wal" if header[18:20] == b"\x02\x02" else "delete"


def _finish_copy(tmp: Path, shown: Path, old: str, journal_mode: str) -> None:
    """Migrate the copy `tmp` to head, VACUUM it (batch mode copies tables and leaves
    the old pages free: about half the file), check it and set its journal mode."""
    try:
        run_migrations(tmp, private_copy=True)  # tmp is ours alone until replace_file publishes it
    except Exception as e:  # noqa: BLE001 - any failure leaves the original as is
        raise NotAStoreError(
            f"{shown}: migrating a copy from {old} to {head_revision()} failed "
            f"({type(e).__name__}: {e}); original left as is"
        ) from e
    with contextlib.closing(sqlite3.connect(tmp, isolation_level=None)) as conn:
        # The same private copy (run_migrations' private_copy): VACUUM without a journal
        # or fsyncs; replace_file fsyncs the finished file before the rename.
        conn.execute("PRAGMA journal_mode = OFF")
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("VACUUM")
        if integrity_problems(conn, 1):
            raise NotAStoreError(f"{shown}: the upgraded copy failed integrity_check; original left as is")
        conn.execute(f"PRAGMA journal_mode = {journal_mode}")


def upgrade_file(path: str | Path, out: str | Path | None = None) -> tuple[str, str]:
    """Migrate `path` to head through a copy and put the copy in its place atomically;
    with `out`, write the upgraded copy there and leave `path` as it is.

    Returns (old revision, new revision); equal when the file was up to date (then
    nothing was written, unless `out` asks for a copy). Every refusal (damaged or
    unidentified file, unknown revision, a file of a published snapshot, a file another
    process has open) happens before anything is written, so a refused file keeps its
    bytes, and so do its -wal and -shm. The copy is taken with the backup API so a WAL's
    content is included; in place, the source's WAL is folded back first so no stale WAL
    outlives the swap. A symlink is followed: the file it points to is replaced, the
    link stays. Leftovers of killed upgrades of the same file are removed first.
    """
    path = Path(path)
    if out is not None:
        return _upgrade_to(path, Path(out))
    old, status = check_readable_store(path)
    if status == "head":
        return old, old
    target = Path(os.path.realpath(path))
    manifest = listing_manifest(path) or listing_manifest(target)
    if manifest is not None:
        raise NotAStoreError(
            f"{path}: a file of a published snapshot ({manifest} lists it), which is never changed; upgrade a copy: "
            f"`rolloutdb upgrade {path} --out COPY.sqlite` (a resume from the snapshot upgrades a copy itself)"
        )
    refuse_if_open(target, path)
    remove_upgrade_leftovers(target)
    tmp = temp_path_beside(target, "upgrade")
    try:
        try:
            with contextlib.closing(sqlite3.connect(target, isolation_level=None)) as src:
                # Only a process that opened the file since `refuse_if_open` can make this busy.
                src.execute("PRAGMA busy_timeout = 2000")
                journal_mode = src.execute("PRAGMA journal_mode").fetchone()[0]
                if src.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]:
                    raise StoreBusyError(f"{path}: in use by another process; stop the run, then upgrade")
                with contextlib.closing(sqlite3.connect(tmp)) as dst:
                    src.backup(dst)
        except sqlite3.OperationalError as e:
            raise NotAStoreError(f"{path}: cannot read it for the upgrade ({e}); stop the run, then upgrade") from e
        faults.point("upgrade.copied")
        _finish_copy(tmp, path, old, journal_mode)
        faults.point("upgrade.migrated")
        shutil.copymode(target, tmp)
        replace_file(tmp, target)
    finally:
        remove_sqlite_file(tmp)
    for suffix in ("-wal", "-shm"):
        Path(f"{target}{suffix}").unlink(missing_ok=True)
    return old, head_revision()


def _upgrade_to(path: Path, out: Path) -> tuple[str, str]:
    """`upgrade_file(path, out)`: `path` is only read (`open_readonly`)."""
    if out.exists() or out.is_symlink():
        raise NotAStoreError(f"{out}: already exists; pass --out a new file name")
    if not out.parent.is_dir():
        raise NotAStoreError(f"{out.parent}: no such directory; pass --out a file in an existing directory")
    if (out.parent / MANIFEST_NAME).exists():
        raise NotAStoreError(f"{out}: inside a snapshot directory (a manifest.json is there), which is never changed; "
                             "pass --out a file elsewhere")
    conn, old, _status = _checked_open(path)
    tmp = temp_path_beside(out, "upgrade")
    try:
        remove_upgrade_leftovers(out)
        try:
            with contextlib.closing(sqlite3.connect(tmp)) as dst:
                conn.backup(dst)
        finally:
            conn.close()
        _finish_copy(tmp, path, old, _wal_header_mode(path))
        replace_file(tmp, out)
    finally:
        remove_sqlite_file(tmp)
    return old, head_revision()
