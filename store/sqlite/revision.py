"""Schema versions are Alembic revisions: the store's and the trace's migrations, the
revision a file records, and creating a store file (upgrading one: `upgrade.py`).

``script_location`` comes from the installed package, so this works from a wheel as well
as from a checkout. Files are only ever created by running the migrations.
"""

from __future__ import annotations

import contextlib
import sqlite3
from functools import lru_cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import URL, create_engine, event
from sqlalchemy.pool import NullPool

from ..errors import NotAStoreError, SchemaTooNewError, SchemaTooOldError
from ..fsio import write_file_atomic

# Stable constraint names, so batch-mode migrations and compare_metadata agree (the
# store's models and the trace's tables both use it).
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
STORE_MIGRATIONS = "rolloutdb.migrations"
TRACE_MIGRATIONS = "rolloutdb.migrations.trace"


def alembic_config(package: str = STORE_MIGRATIONS) -> Config:
    """Alembic config for a migrations package shipped inside rolloutdb: the store's
    (default) or the trace's (``rolloutdb.migrations.trace``)."""
    import importlib

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(importlib.import_module(package).__file__).parent))
    return cfg


@lru_cache(maxsize=None)
def _revision_ids(package: str) -> tuple[str, ...]:
    """A migrations package's revision ids, base to head, read once per process: the
    revisions ship inside the installed package and do not change while it runs, and
    reading them (Alembic imports every revision file) cost ~30 ms a call, two calls in
    every restore's schema phase (0.065 s of a 0.47 s restore, bench/bench_restore.py)."""
    script = ScriptDirectory.from_config(alembic_config(package))
    ids = tuple(s.revision for s in reversed(list(script.walk_revisions())))
    head = script.get_current_head()  # raises if the history ever forks into two heads
    assert ids[-1] == head, (ids, head)
    return ids


def head_revision() -> str:
    return _revision_ids(STORE_MIGRATIONS)[-1]


def known_revisions() -> list[str]:
    """Revision ids from base to head."""
    return list(_revision_ids(STORE_MIGRATIONS))


def trace_alembic_config() -> Config:
    return alembic_config(TRACE_MIGRATIONS)


def trace_head_revision() -> str:
    return _revision_ids(TRACE_MIGRATIONS)[-1]


def trace_known_revisions() -> list[str]:
    """The trace's revision ids, base to head."""
    return list(_revision_ids(TRACE_MIGRATIONS))


def run_trace_migrations(path: str | Path, target: str = "head") -> None:
    """Run the trace migrations on `path` in place (a new file or one we own)."""
    run_migrations(path, target, config=trace_alembic_config())


def sqlite_url(path: str | Path) -> URL:
    """A SQLAlchemy URL for a file path; built, not formatted, so a `?` or `#` in the
    path is part of the name and not a query string."""
    return URL.create("sqlite", database=str(path))


def _migration_engine(path: Path, private_copy: bool = False):
    engine = create_engine(sqlite_url(path), poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _fk_off(dbapi_conn, _record):  # noqa: ANN001
        # Batch mode copies tables; foreign keys are checked after, by verify.
        dbapi_conn.execute("PRAGMA foreign_keys = OFF")
        if private_copy:  # see run_migrations
            dbapi_conn.execute("PRAGMA journal_mode = OFF")
            dbapi_conn.execute("PRAGMA synchronous = OFF")

    return engine


def run_migrations(path: str | Path, target: str = "head", *, downgrade: bool = False, config: Config | None = None,
                   private_copy: bool = False) -> None:
    """Run Alembic on `path` in place (callers work on a copy or on a new file); the
    store's migrations unless another package's `config` is given.

    `private_copy`: `path` is a copy no one else opens, thrown away if anything fails
    and published only by `fsio.replace_file` (fsync, rename, fsync of the directory)
    once whole: no rollback journal and no fsync per commit (journal_mode OFF,
    synchronous OFF). A crash or a failed migration leaves a torn copy, which is never
    read: the original stays in place until the rename. upgrade_file of 100k groups:
    bench/bench_compaction_upgrade.py."""
    cfg = config or alembic_config()
    engine = _migration_engine(Path(path), private_copy)
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            (command.downgrade if downgrade else command.upgrade)(cfg, target)
    finally:
        engine.dispose()


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
    if revision.startswith("trace_"):
        raise NotAStoreError(_trace_file_message(path, revision))
    raise SchemaTooNewError(
        f"{path}: unknown schema revision {revision} (known: {', '.join(known)}); not written by this "
        "rolloutdb: if a newer rolloutdb wrote it, upgrade rolloutdb (pip install -U rolloutdb)"
    )


def _trace_file_message(path: Path, revision: str) -> str:
    """What a run's trace file given to a store command is, and which command reads it.
    The trace has its own migrations (rolloutdb.migrations.trace): a resumed run upgrades
    its trace file itself and `rolloutdb trace` reads an older one through an upgraded
    copy, so `rolloutdb upgrade` never needs to touch it."""
    path = Path(path)
    run_dir = path.parent.parent if path.parent.name == "logs" else path.parent
    reader = f"rolloutdb trace {run_dir}" if path.name == "rollout_trace.sqlite" else "rolloutdb trace RUN_DIR"
    if revision not in trace_known_revisions():
        return (f"{path}: a run's trace file, at trace revision {revision}, newer than this rolloutdb reads "
                f"(trace head {trace_head_revision()}); it is not a store or snapshot file: upgrade rolloutdb "
                f"(pip install -U rolloutdb), then read it with `{reader}`")
    return (f"{path}: a run's trace file (trace revision {revision}), not a store or snapshot file; read it "
            f"with `{reader}` (older trace revisions too, through an upgraded copy; `rolloutdb upgrade` "
            "upgrades store and snapshot files only)")


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
    write_file_atomic(path, run_migrations, tag="create")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
    return path
