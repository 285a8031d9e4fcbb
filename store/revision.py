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

from .errors import NotAStoreError, SchemaTooNewError, SchemaTooOldError
from .fsio import replace_file, temp_path_beside
from .fsio import refuse_special_file

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


def file_revision(conn: sqlite3.Connection) -> str | None:
    """The Alembic revision recorded in an open store file, or None if it has none."""
    try:
        rows = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    except sqlite3.DatabaseError as e:
        if "no such table" in str(e):
            return None
        raise
    return rows[0][0] if rows else None


def classify_revision(path: Path, revision: str | None) -> str:
    """'head', 'old' or raise: a newer or unknown revision is refused with what to do."""
    if revision is None:
        raise NotAStoreError(f"{path}: not a rolloutdb store (no alembic_version table)")
    known = known_revisions()
    if revision == known[-1]:
        return "head"
    if revision in known:
        return "old"
    raise SchemaTooNewError(
        f"{path}: schema revision {revision} is newer than this rolloutdb knows "
        f"(head {known[-1]}); upgrade rolloutdb (pip install -U rolloutdb)"
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


def check_readable_store(path: str | Path) -> str | None:
    """Refuse a file that is missing, not SQLite, truncated or damaged; return its
    revision. Opens it read-only (no side files, no change to its bytes) and runs
    ``PRAGMA integrity_check``, so a bit-flipped page is refused before anything reads
    rows from it."""
    from .readonly import open_readonly  # readonly imports this module

    path = check_sqlite_file(path)
    conn = open_readonly(path)
    try:
        problems = [row[0] for row in conn.execute("PRAGMA integrity_check").fetchall()]
        if problems != ["ok"]:
            first = " ".join(problems[0].replace("*** in database main ***", "").split())
            raise NotAStoreError(
                f"{path}: damaged (integrity_check: {first}); restore it from another snapshot"
            )
        return file_revision(conn)
    except sqlite3.DatabaseError as e:
        raise NotAStoreError(f"{path}: unreadable SQLite file ({e}); restore it from another snapshot") from e
    finally:
        conn.close()


def upgrade_file(path: str | Path) -> tuple[str, str]:
    """Migrate `path` to head through a copy and put the copy in its place atomically.

    Returns (old revision, new revision); equal when the file was up to date (then
    nothing was written). Every refusal (damaged file, unknown or newer revision, file
    in use) happens before anything is written, so a refused file keeps its bytes.
    The copy is taken with the backup API so a WAL's content is included; the source's
    WAL is folded back first so no stale WAL outlives the swap. A symlink is followed:
    the file it points to is replaced, the link stays.
    """
    path = Path(path)
    old = check_readable_store(path)
    if classify_revision(path, old) == "head":
        return old, old
    target = Path(os.path.realpath(path))
    tmp = temp_path_beside(target, "upgrade")
    try:
        try:
            with contextlib.closing(sqlite3.connect(target, isolation_level=None)) as src:
                src.execute("PRAGMA busy_timeout = 2000")
                journal_mode = src.execute("PRAGMA journal_mode").fetchone()[0]
                busy = src.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
                if busy:
                    raise NotAStoreError(f"{path}: in use by another process; stop the run, then upgrade")
                with contextlib.closing(sqlite3.connect(tmp)) as dst:
                    src.backup(dst)
        except sqlite3.OperationalError as e:
            raise NotAStoreError(f"{path}: cannot read it for the upgrade ({e}); stop the run, then upgrade") from e
        try:
            run_migrations(tmp)
        except Exception as e:  # noqa: BLE001 - any failure leaves the original as is
            raise NotAStoreError(
                f"{path}: migrating a copy from {old} to {head_revision()} failed "
                f"({type(e).__name__}: {e}); original left as is"
            ) from e
        with contextlib.closing(sqlite3.connect(tmp, isolation_level=None)) as conn:
            if conn.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
                raise NotAStoreError(f"{path}: the upgraded copy failed integrity_check; original left as is")
            conn.execute(f"PRAGMA journal_mode = {journal_mode}")
        shutil.copymode(target, tmp)
        replace_file(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
        Path(f"{tmp}-journal").unlink(missing_ok=True)
    for suffix in ("-wal", "-shm"):
        Path(f"{target}{suffix}").unlink(missing_ok=True)
    return old, head_revision()
