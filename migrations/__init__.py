"""Alembic migrations of the rolloutdb store, shipped inside the package.

Each revision is a schema version; its id (``v1_0_a``, ``v1_1_a``, ...) is what a store
file records in ``alembic_version`` and what a snapshot manifest mirrors. Revisions are
frozen: they define the tables they touch locally and never import the live models.
"""
