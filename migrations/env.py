"""Alembic environment for rolloutdb store files (see `envcommon.py`).

    alembic -x db=PATH upgrade head        # from the repository root
"""

from alembic import context

from rolloutdb.migrations.envcommon import run_env


def _metadata():
    from rolloutdb.store.live.schema import metadata

    return metadata


run_env(context, "store", _metadata)
