"""Alembic environment for rolloutdb stores.

Two ways in:
- from code (`rolloutdb.store.revision`): a SQLAlchemy connection is passed in
  ``config.attributes["connection"]`` and used as is;
- from the command line: ``alembic -x db=PATH upgrade head`` with the root alembic.ini.

Batch mode is on because SQLite cannot ALTER most things in place: batch migrations
copy the table, which is what SQLite's own docs recommend.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

config = context.config


def _target_metadata():
    # Only autogenerate needs the live models; migrations themselves stay frozen.
    if context.get_x_argument(as_dictionary=True).get("autogenerate"):
        from rolloutdb.store.schema import metadata

        return metadata
    return None


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=_target_metadata(),
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    db = context.get_x_argument(as_dictionary=True).get("db")
    if not db:
        raise SystemExit("error: name the store file: alembic -x db=PATH upgrade head")
    engine = create_engine(f"sqlite:///{db}", poolclass=pool.NullPool)
    with engine.connect() as connection:
        connection.exec_driver_sql("PRAGMA foreign_keys = OFF")  # batch copies tables
        _run(connection)
        connection.commit()


if context.is_offline_mode():
    raise SystemExit("error: offline (--sql) migrations are not supported for rolloutdb stores")
run_migrations_online()
