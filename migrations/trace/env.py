"""Alembic environment for rolloutdb trace files.

From code (`rolloutdb.store.trace.run_trace_migrations`) a SQLAlchemy connection comes in
``config.attributes["connection"]``. For developers, with a config whose script_location
is this folder: ``alembic -x db=PATH upgrade head``. Autogenerate (``-x autogenerate=1``)
compares against `rolloutdb.store.trace.trace_metadata`.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

config = context.config


def _target_metadata():
    if context.get_x_argument(as_dictionary=True).get("autogenerate"):
        from rolloutdb.store.trace import trace_metadata

        return trace_metadata
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
        raise SystemExit("error: name the trace file: alembic -x db=PATH upgrade head")
    engine = create_engine(f"sqlite:///{db}", poolclass=pool.NullPool)
    with engine.connect() as connection:
        connection.exec_driver_sql("PRAGMA foreign_keys = OFF")  # batch copies tables
        _run(connection)
        connection.commit()


if context.is_offline_mode():
    raise SystemExit("error: offline (--sql) migrations are not supported for rolloutdb trace files")
run_migrations_online()
