"""Alembic migrations of the rolloutdb store, shipped inside the package.

Each revision is a schema version; its id (``v1_0_a``, ``v1_1_a``, ...) is what a store
file records in ``alembic_version`` and what a snapshot manifest mirrors. Revisions are
frozen: they define the tables they touch locally and never import the live models.
"""

from __future__ import annotations

import re
from pathlib import Path

_REVISION_LINE = re.compile(r"^(down_revision|revision)\s*=\s*['\"]?([\w.]+)?['\"]?\s*$", re.M)


def head_of_revision_files(versions: Path = Path(__file__).parent / "versions") -> str:
    """The head revision, read from the revision files' ``revision = ...`` and
    ``down_revision = ...`` lines without importing Alembic (with SQLAlchemy ~0.3 s): for
    the --help texts, which must answer at once. Alembic's head is the authority
    (`rolloutdb.store.head_revision`); tests/test_cli_startup.py checks the two agree."""
    revises: dict[str, str | None] = {}
    for path in sorted(versions.glob("*.py")):
        found = {m.group(1): m.group(2) for m in _REVISION_LINE.finditer(path.read_text(encoding="utf-8"))}
        if found.get("revision"):
            revises[found["revision"]] = found.get("down_revision")
    heads = set(revises) - set(revises.values())
    return heads.pop() if len(heads) == 1 else "unknown"
