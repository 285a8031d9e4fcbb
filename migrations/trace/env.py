"""Alembic environment for rolloutdb trace files (see `../envcommon.py`).

From code: `rolloutdb.store.sqlite.revision.run_trace_migrations`. For developers, with a config
whose script_location is this folder: ``alembic -x db=PATH upgrade head``.
"""

from alembic import context

from rolloutdb.migrations.envcommon import run_env


def _metadata():
    from rolloutdb.store.trace.events import trace_metadata

    return trace_metadata


run_env(context, "trace", _metadata)
