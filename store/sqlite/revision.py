"""Schema versions are Alembic revisions: create, check and upgrade store files.

``script_location`` comes from the installed package, so this works from a wheel as well
as from a checkout. Files are only ever created by running the migrations.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import URL, create_engine, event
from sqlalchemy.pool import NullPool

from .. import faults
from ..errors import NotAStoreError, SchemaTooNewError, SchemaTooOldError, StoreBusyError
from ..fsio import TEMP_SUFFIX, refuse_special_file, replace_file, temp_path_beside

SQLITE_MAGIC = b"SQLite format 3\x00"


def alembic_config(package: str = "rolloutdb.migrations") -> Config:
    """Alembic config for a migrations package shipped inside rolloutdb: the store's
    (default) or the trace's (``rolloutdb.migrations.trace``)."""
    import importlib

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(importlib.import_module(package).__file__).parent))
    return cfg


def script_directory() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    return script_directory().get_current_head()


def known_revisions() -> list[str]:
    """Revision ids from base to head."""
    return [s.revision for s in reversed(list(script_directory().walk_revisions()))]


def sqlite_url(path: str | Path) -> URL:
    """A SQLAlchemy URL for a file path; built, not formatted, so a `?` or `#` in the
    path is part of the name and not a query string."""
    return URL.create("sqlite", database=str(path))


def _migration_engine(path: Path):
    engine = create_engine(sqlite_url(path), poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _fk_off(dbapi_conn, _record):  # noqa: ANN001
        # Batch mode copies tables; foreign keys are checked after, by verify.
        dbapi_conn.execute("PRAGMA foreign_keys = OFF")

    return engine


def run_migrations(path: str | Path, target: str = "head", *, downgrade: bool = False, config: Config | None = None) -> None:
    """Run Alembic on `path` in place (callers work on a copy or on a new file); the
    store's migrations unless another package's `config` is given."""
    cfg = config or alembic_config()
    engine = _migration_engine(Path(path))
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            (command.downgrade if downgrade else command.upgrade)(cfg, target)
    finally:
        engine.dispose()


def check_sqlite_file(path: str | Path) -> Path:
    """Refuse anything that is not an existing, readable SQLite file."""
    path = Path(path)
    refuse_special_file(path, NotAStoreError)  # FIFOs, devices, sockets: refused before any open
    if not path.exists():
        raise NotAStoreError(f"{path}: no such file; pass the path of a store or snapshot file")
    if path.is_dir():
        raise NotAStoreError(f"{path}: is a directory; pass a .sqlite file inside it")
    with open(path, "rb") as f:
        header = f.read(100)
    if len(header) < 100 or not header.startswith(SQLITE_MAGIC):
        raise NotAStoreError(f"{path}: not a SQLite database (bad header); is this the right file?")
    page_size = int.from_bytes(header[16:18], "big") or 65536
    pages = int.from_bytes(header[28:32], "big")
    wal = Path(f"{path}-wal")
    # With a non-empty WAL beside it (a live store, or one killed mid-checkpoint) the
    # file may legitimately be shorter than its header says: the WAL holds the rest.
    live_wal = wal.exists() and wal.stat().st_size > 0
    if not live_wal and path.stat().st_size < page_size * pages:
        raise NotAStoreError(
            f"{path}: truncated ({path.stat().st_size} bytes, header says {page_size * pages}); "
            "restore it from another snapshot"
        )
    return path


def file_revision(conn: sqlite3.Connection, path: str | Path | None = None) -> str | None:
    """The Alembic revision recorded in an open file; None only when it has no
    ``alembic_version`` table. Anything else that is not exactly one non-empty text id
    (an empty table, two rows, a NULL) is refused: Alembic would read such a file as
    being at no revision or at several, and so can we not."""
    where = f"{path}: " if path is not None else ""
    try:
        rows = conn.execute("SELECT version_num FROM alembic_version LIMIT 3").fetchall()
    except sqlite3.DatabaseError as e:
        if "no such table" in str(e):
            return None
        raise
    if not rows:
        raise NotAStoreError(f"{where}alembic_version is empty (a store records exactly one revision); "
                             "restore it from another snapshot")
    if len(rows) > 1:
        (n,) = conn.execute("SELECT count(*) FROM alembic_version").fetchone()
        ids = ", ".join(repr(r[0]) for r in rows[:2]) + (", ..." if n > 2 else "")
        raise NotAStoreError(f"{where}alembic_version holds {n} rows ({ids}); a store records exactly one "
                             "revision; restore it from another snapshot")
    (revision,) = rows[0]
    if revision is None or not isinstance(revision, str) or not revision.strip():
        what = "a NULL" if revision is None else f"{revision!r}, not a revision id,"
        raise NotAStoreError(f"{where}alembic_version holds {what} where the revision id belongs; "
                             "restore it from another snapshot")
    return revision


def classify_revision(path: Path, revision: str | None) -> str:
    """'head', 'old' or raise. Only ids in our history are known; any other id is
    reported as unknown, never guessed to be newer (see `identity`)."""
    if revision is None:
        raise NotAStoreError(f"{path}: not a rolloutdb store (no alembic_version table)")
    known = known_revisions()
    if revision == known[-1]:
        return "head"
    if revision in known:
        return "old"
    raise SchemaTooNewError(
        f"{path}: unknown schema revision {revision} (known: {', '.join(known)}); not written by this "
        "rolloutdb: if a newer rolloutdb wrote it, upgrade rolloutdb (pip install -U rolloutdb)"
    )


def require_head(path: Path, revision: str | None) -> None:
    if classify_revision(path, revision) == "old":
        raise SchemaTooOldError(
            f"{path}: schema revision {revision} is older than head {head_revision()}; "
            f"run `rolloutdb upgrade {path}`"
        )


def create_store_file(path: str | Path) -> Path:
    """A new, empty store at head, built by running every migration, in WAL mode."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path}: already exists; open it instead of creating it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_beside(path, "create")
    try:
        run_migrations(tmp)
        replace_file(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
    return path


def _checked_open(path: Path) -> tuple[sqlite3.Connection, str, str]:
    """A read-only connection on a file that passed ``PRAGMA integrity_check`` and strict
    identification (`identity.identify`), with (revision, 'head' or 'old')."""
    from .identity import identify
    from .readonly import open_readonly

    path = check_sqlite_file(path)
    conn = open_readonly(path)
    try:
        problems = [row[0] for row in conn.execute("PRAGMA integrity_check").fetchall()]
        if problems != ["ok"]:
            first = " ".join(problems[0].replace("*** in database main ***", "").split())
            raise NotAStoreError(f"{path}: damaged (integrity_check: {first}); restore it from another snapshot")
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
    from .inuse import describe_holder, open_elsewhere

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
        run_migrations(tmp)
    except Exception as e:  # noqa: BLE001 - any failure leaves the original as is
        raise NotAStoreError(
            f"{shown}: migrating a copy from {old} to {head_revision()} failed "
            f"({type(e).__name__}: {e}); original left as is"
        ) from e
    with contextlib.closing(sqlite3.connect(tmp, isolation_level=None)) as conn:
        conn.execute("VACUUM")
        if conn.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
            raise NotAStoreError(f"{shown}: the upgraded copy failed integrity_check; original left as is")
        conn.execute(f"PRAGMA journal_mode = {journal_mode}")


def _remove_temp(tmp: Path) -> None:
    for suffix in ("", "-journal", "-wal", "-shm"):
        Path(f"{tmp}{suffix}").unlink(missing_ok=True)


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
    from .readonly import listing_manifest

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
        _remove_temp(tmp)
    for suffix in ("-wal", "-shm"):
        Path(f"{target}{suffix}").unlink(missing_ok=True)
    return old, head_revision()


def _upgrade_to(path: Path, out: Path) -> tuple[str, str]:
    """`upgrade_file(path, out)`: `path` is only read (`open_readonly`)."""
    from ..checkpoints.manifest import MANIFEST_NAME
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
        _remove_temp(tmp)
    return old, head_revision()
