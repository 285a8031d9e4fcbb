"""What both Alembic environments (the store's, `env.py`, and the trace's,
`trace/env.py`) do; each env.py names only its kind of file and its models.

Two ways in:
- from code (`rolloutdb.store.sqlite.revision.run_migrations`): a SQLAlchemy connection is
  passed in ``config.attributes["connection"]`` and used as is;
- from the command line: ``alembic -x db=PATH upgrade head`` (also ``check`` and
  ``revision --autogenerate``; see README in this folder).

Batch mode is on because SQLite cannot ALTER most things in place: batch migrations
copy the table, which is what SQLite's own docs recommend. Only the command line loads the
live models (autogenerate compares a file with them); the migrations themselves stay frozen.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import URL, MetaData, create_engine, pool


def run_env(context, kind: str, load_metadata: Callable[[], MetaData]) -> None:
    """Run the migrations Alembic asked for on a `kind` file ("store", "trace")."""
    if context.is_offline_mode():
        raise SystemExit(f"error: offline (--sql) migrations are not supported for rolloutdb {kind} files")
    xargs = context.get_x_argument(as_dictionary=True)
    connection = context.config.attributes.get("connection")
    # From the command line (`alembic check`, `revision --autogenerate`) autogenerate compares
    # the file with the live models; from code only migrations run, so the models stay unloaded.
    target = load_metadata() if connection is None else None

    def run(connection) -> None:
        context.configure(connection=connection, target_metadata=target, render_as_batch=True, compare_type=True)
        with context.begin_transaction():
            context.run_migrations()

    if connection is not None:
        run(connection)
        return
    db = xargs.get("db")
    if not db:
        raise SystemExit(f"error: name the {kind} file: alembic -x db=PATH upgrade head")
    engine = create_engine(URL.create("sqlite", database=db), poolclass=pool.NullPool)
    with engine.connect() as connection:
        connection.exec_driver_sql("PRAGMA foreign_keys = OFF")  # batch copies tables
        run(connection)
        connection.commit()
