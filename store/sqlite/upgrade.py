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
import stat
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from .. import faults
from ..errors import NotAStoreError, StoreBusyError
from ..fsio import TEMP_SUFFIX, remove_sqlite_file, replace_file, temp_path_beside
from .identity import identify
from .integrity import check_sqlite_file, first_problem, integrity_problems
from .inuse import describe_holder, open_elsewhere, open_elsewhere_while_locked
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


def _read_only(path: Path) -> str | None:
    """Why `path` must not be written, or None. The mode bits count even for root (who
    may write anyway): a file or directory made read-only says "do not write here"."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if not mode & 0o222:
        return f"read-only (mode {mode:04o})"
    if not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
        return f"not writable by this user (mode {mode:04o})"
    return None


def _refuse_in_place_write(target: Path, shown: Path) -> None:
    """An upgrade in place writes its copy beside the file and renames it over the file."""
    why = _read_only(target)
    if why is not None:
        raise NotAStoreError(f"{shown}: {why}, and an upgrade in place replaces it; make it writable first "
                             f"(chmod u+w), or write an upgraded copy: `rolloutdb upgrade {shown} --out COPY.sqlite`")
    why = _read_only(target.parent)
    if why is not None:
        raise NotAStoreError(f"{shown}: its directory {target.parent} is {why}, and an upgrade in place writes its "
                             f"copy there; make it writable, or write an upgraded copy elsewhere: "
                             f"`rolloutdb upgrade {shown} --out COPY.sqlite`")


def upgrade_file(path: str | Path, out: str | Path | None = None, *,
                 hold: Callable[[Path], AbstractContextManager[object]] | None = None) -> tuple[str, str]:
    """Migrate `path` to head through a copy and put the copy in its place atomically;
    with `out`, write the upgraded copy there and leave `path` as it is.

    Returns (old revision, new revision); equal when the file was up to date (then
    nothing was written, unless `out` asks for a copy). Every refusal (damaged or
    unidentified file, unknown revision, a file of a published snapshot, a read-only file
    or directory, a file another process has open) happens before anything is written,
    so a refused file keeps its bytes, and so do its -wal and -shm. The copy is taken with
    the backup API so a WAL's content is included; in place, the source's WAL is folded
    back first so no stale WAL outlives the swap. A symlink is followed: the file it
    points to is replaced, the link stays. Leftovers of killed upgrades of the same file
    are removed first.

    In place, nobody commits to the file between the in-use check and the rename: `hold`
    (the caller's lock on the file's owner, such as a run directory's run lock, given the
    resolved path) is held over both, and the source's SQLite write lock from the copy to
    the rename (`_migrate_in_place`), after which the check is made again.
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
    _refuse_in_place_write(target, path)
    with hold(target) if hold is not None else contextlib.nullcontext():
        refuse_if_open(target, path)
        remove_upgrade_leftovers(target)
        tmp = temp_path_beside(target, "upgrade")
        try:
            _migrate_in_place(target, tmp, path, old)
        finally:
            remove_sqlite_file(tmp)
    return old, head_revision()


def _migrate_in_place(target: Path, tmp: Path, shown: Path, old: str) -> None:
    """Copy `target` into `tmp`, migrate the copy and rename it over `target`, with no
    commit to `target` in between that the copy would lack.

    A process may open the file after `refuse_if_open` (the migration takes 5-20 s on a
    busy machine). Its commits would go to the old file, unlinked by the rename: lost. So
    the source's write lock is taken before the copy (BEGIN IMMEDIATE: the WAL write lock,
    or RESERVED in rollback-journal mode) and kept until the migrated copy is ready: a
    writer waits or fails with SQLITE_BUSY, never commits. Then, still under the lock,
    the check is made again (by /proc descriptors: testing the locks would drop ours), and
    a process found refuses the upgrade, changing nothing; its waiting write then goes to
    the file, kept. Closing the source, the last connection, folds the WAL and removes
    -wal and -shm; one still there (or a journal) is a connection opened in the instant
    since, and refuses too. Only a process that opens the file between that look and the
    rename, microseconds, is not seen.
    """
    try:
        src = sqlite3.connect(target, isolation_level=None)
    except sqlite3.OperationalError as e:
        raise NotAStoreError(f"{shown}: cannot open it for the upgrade ({e}); check its permissions") from e
    try:
        try:
            # Only a process that opened the file since `refuse_if_open` can make this busy.
            src.execute("PRAGMA busy_timeout = 2000")
            journal_mode = src.execute("PRAGMA journal_mode").fetchone()[0]
            if src.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]:
                raise StoreBusyError(f"{shown}: in use by another process; stop the run, then upgrade")
            src.execute("BEGIN IMMEDIATE")
            # The backup API refuses a source connection in a write transaction: a second
            # connection reads, under our lock (it sees what the WAL holds, too).
            with contextlib.closing(sqlite3.connect(target)) as reader, \
                    contextlib.closing(sqlite3.connect(tmp)) as dst:
                reader.backup(dst)
        except sqlite3.OperationalError as e:
            raise NotAStoreError(f"{shown}: cannot read it for the upgrade ({e}); stop the run, then upgrade") from e
        faults.point("upgrade.copied")
        _finish_copy(tmp, shown, old, journal_mode)
        faults.point("upgrade.migrated")
        shutil.copymode(target, tmp)
        pid = open_elsewhere_while_locked(target)
        if pid is not None:
            raise StoreBusyError(_opened_meanwhile(shown, describe_holder(pid)))
        src.execute("ROLLBACK")
    finally:
        src.close()
    journal = Path(f"{target}-journal")
    if Path(f"{target}-wal").exists() or journal.exists() and journal.stat().st_size:
        raise StoreBusyError(_opened_meanwhile(shown, "pid unknown"))
    replace_file(tmp, target)


def _opened_meanwhile(shown: Path, who: str) -> str:
    return (f"{shown}: opened by another process during the upgrade ({who}); nothing was changed (its commits "
            "stay in the file); stop it, then upgrade")


def _side_file_of(source: Path, out: Path) -> str | None:
    """The suffix when `out` names one of `source`'s own SQLite side files."""
    sources = {os.path.abspath(source), os.path.realpath(source)}
    outs = {os.path.abspath(out), os.path.realpath(out)}
    for suffix in ("-wal", "-shm", "-journal"):
        if outs & {name + suffix for name in sources}:
            return suffix
    return None


def _upgrade_to(path: Path, out: Path) -> tuple[str, str]:
    """`upgrade_file(path, out)`: `path` is only read (`open_readonly`)."""
    if out.exists() or out.is_symlink():
        raise NotAStoreError(f"{out}: already exists; pass --out a new file name")
    if not out.parent.is_dir():
        raise NotAStoreError(f"{out.parent}: no such directory; pass --out a file in an existing directory")
    if (out.parent / MANIFEST_NAME).exists():
        raise NotAStoreError(f"{out}: inside a snapshot directory (a manifest.json is there), which is never changed; "
                             "pass --out a file elsewhere")
    suffix = _side_file_of(path, out)
    if suffix is not None:
        raise NotAStoreError(f"{out}: the name of {path}'s own {suffix} file, which SQLite reads as part of {path}; "
                             "pass --out another file name")
    stale = [f"{out}{s}" for s in ("-wal", "-journal") if os.path.lexists(f"{out}{s}")]
    if stale:
        raise NotAStoreError(f"{out}: {stale[0]} exists beside that name (left by an earlier database), and SQLite "
                             "would read it as part of the new file; remove it or pass --out another file name")
    why = _read_only(out.parent)
    if why is not None:
        raise NotAStoreError(f"{out}: cannot write into {out.parent}: the directory is {why}; "
                             "pass --out a file in a directory you can write")
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
