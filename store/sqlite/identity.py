"""Strict schema identification: which revision a store file is at, proven by its schema.

A file is at revision X only when
1. ``alembic_version`` exists and holds exactly one row, a non-empty text id X
   (`revision.file_revision`);
2. X is one of our revisions. An id outside our history is *unknown*: Alembic cannot
   place it after head without the newer migration scripts, so we cannot tell a newer
   rolloutdb's file from a foreign one, and say so instead of calling it newer;
3. the file's schema equals the one the migrations build for X: tables, their columns
   (declared type, NOT NULL, primary key), indexes (uniqueness, columns), views and
   triggers. Column order is not compared: batch mode appends a column that a fresh
   file has in the middle. SQLite's own tables (``sqlite_stat1``, ...) are ignored.

The fingerprint of each revision is computed from the migrations, never written by
hand: every migration runs once, stepwise, on an in-memory database, and the schema is
read after each step (measured: ~0.15 s for all revisions, once per process, on first
use only, so `rolloutdb --help` and commands that never identify a file do not pay it).
"""

from __future__ import annotations

import functools
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from ..errors import NotAStoreError, SchemaTooNewError, StoreError
from .revision import alembic_config, classify_revision, file_revision, known_revisions

# (table name -> (sorted columns, sorted indexes)), plus ("view"/"trigger", name) entries.
Fingerprint = dict


def schema_fingerprint(conn: sqlite3.Connection) -> Fingerprint:
    """The normalized schema of an open SQLite connection (see the module docstring)."""
    out: Fingerprint = {}
    rows = conn.execute("SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite\\_%' ESCAPE '\\' "
                        "AND type IN ('table', 'view', 'trigger') ORDER BY type, name").fetchall()
    for kind, name in rows:
        if kind != "table":
            out[(kind, name)] = kind
            continue
        columns = tuple(sorted((c[1], (c[2] or "").upper(), bool(c[3]), c[5])
                               for c in conn.execute("SELECT * FROM pragma_table_info(?)", (name,))))
        indexes = []
        for _seq, index, unique, origin, _partial in conn.execute("SELECT * FROM pragma_index_list(?)", (name,)):
            cols = tuple(c[2] for c in conn.execute("SELECT * FROM pragma_index_info(?)", (index,)))
            # An automatic index (a UNIQUE or PRIMARY KEY constraint) is named by SQLite
            # after the order tables were created: identify it by what it indexes.
            indexes.append((index if origin == "c" else f"<{origin}>", bool(unique), cols))
        out[name] = (columns, tuple(sorted(indexes)))
    return out


@functools.cache
def revision_fingerprints() -> dict[str, Fingerprint]:
    """The fingerprint of every known revision, base to head, from the migrations."""
    from alembic import command
    from sqlalchemy import create_engine, event
    from sqlalchemy.pool import StaticPool

    engine = create_engine("sqlite://", poolclass=StaticPool)

    @event.listens_for(engine, "connect")
    def _fk_off(dbapi_conn, _record):  # noqa: ANN001 - as revision.run_migrations does
        dbapi_conn.execute("PRAGMA foreign_keys = OFF")

    cfg = alembic_config()
    prints: dict[str, Fingerprint] = {}
    try:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            for revision in known_revisions():
                command.upgrade(cfg, revision)
                prints[revision] = schema_fingerprint(conn.connection.driver_connection)
    finally:
        engine.dispose()
    return prints


def _describe(fp: Fingerprint) -> dict[str, str]:
    """Each object of a fingerprint as words, for naming differences."""
    words = {}
    for key, value in fp.items():
        if isinstance(key, tuple):
            words[f"{key[0]} {key[1]}"] = key[0]
            continue
        columns, indexes = value
        words[f"table {key}"] = "table"
        for name, type_, notnull, pk in columns:
            words[f"column {key}.{name}"] = f"{type_ or 'untyped'}{' NOT NULL' if notnull else ''}{' pk' if pk else ''}"
        for name, unique, cols in indexes:
            label = name if not name.startswith("<") else f"{'unique ' if unique else ''}key"
            words[f"index {key}.{label}({', '.join(cols)})"] = "unique" if unique else "index"
    return words


def schema_differences(found: Fingerprint, expected: Fingerprint) -> list[str]:
    """What `expected` has that `found` lacks, the other way round, and what differs, as
    short phrases; the columns and indexes of a missing or unexpected table are not
    named one by one."""
    have, want = _describe(found), _describe(expected)
    gone = {n.removeprefix("table ") for n in want if n.startswith("table ") and n not in have}
    extra = {n.removeprefix("table ") for n in have if n.startswith("table ") and n not in want}

    def of_table(name: str, tables: set[str]) -> bool:  # "column t.c", "index t.i(c)"
        kind, _, rest = name.partition(" ")
        return kind in ("column", "index") and rest.split(".", 1)[0] in tables

    out = [f"{n} is missing" for n in want if n not in have and not of_table(n, gone)]
    out += [f"unexpected {n}" for n in have if n not in want and not of_table(n, extra)]
    out += [f"{n} is {have[n]}, expected {want[n]}" for n in want if n in have and have[n] != want[n]]
    return out


def check_schema(conn: sqlite3.Connection, path: str | Path, revision: str) -> None:
    """Refuse a file whose schema is not the one its revision's migrations build."""
    prints = revision_fingerprints()
    found = schema_fingerprint(conn)
    if found == prints[revision]:
        return
    differences = schema_differences(found, prints[revision])
    first = "; ".join(differences[:2]) + (f"; and {len(differences) - 2} more" if len(differences) > 2 else "")
    matches = [r for r, fp in prints.items() if fp == found]
    which = f"its schema is that of {matches[0]}" if matches else "it matches no known revision"
    raise NotAStoreError(
        f"{path}: schema does not match revision {revision} ({first}); {which}: the file was mislabelled or "
        "changed by hand; restore it from another snapshot"
    )


def identify(conn: sqlite3.Connection, path: str | Path) -> tuple[str, str]:
    """(revision, 'head' or 'old') of an open store file, or a one-line refusal: no or an
    ambiguous alembic_version (NotAStoreError), an unknown revision (SchemaTooNewError),
    or a schema that is not its revision's (NotAStoreError)."""
    revision = file_revision(conn, path)
    status = classify_revision(Path(path), revision)
    check_schema(conn, path, revision)
    return revision, status


@dataclass(frozen=True)
class RevisionRead:
    """A store file's revision, read once (`read_revision`): the id (None: no
    ``alembic_version`` table), 'head' or 'old' (None when the id is none of ours), and
    for an id that is none of ours the refusal `classify_revision` gives it, for the
    caller to raise when its own checks come first."""

    revision: str | None
    status: str | None
    refusal: StoreError | None = None


def read_revision(conn: sqlite3.Connection, path: str | Path) -> RevisionRead:
    """The revision of an open file and where it stands, in one question: exactly one
    ``alembic_version`` row (or none: `revision` None), the schema of a known revision
    checked (both raise NotAStoreError, as `identify`); an id outside our history is
    returned with its refusal, not raised."""
    revision = file_revision(conn, path)
    if revision in known_revisions():
        check_schema(conn, path, revision)
    try:
        return RevisionRead(revision, classify_revision(Path(path), revision))
    except (SchemaTooNewError, NotAStoreError) as e:
        return RevisionRead(revision, None, e)
