"""Alembic's own commands from the repository root, as a developer runs them (see
migrations/README): `check` compares a file with the live models (no drift on a head file,
drift named when they disagree) and `revision --autogenerate` drafts the next revision."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (alembic.ini section, a column the models have that we drop from a head file to plant drift)
KINDS = {"store": ("alembic", "snapshot_attempts", "error"), "trace": ("trace", "runs", "host")}


def alembic(*args: str, ini: Path = ROOT / "alembic.ini", section: str = "alembic") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "alembic", "-c", str(ini), "-n", section, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def head_file(tmp_path: Path, kind: str) -> Path:
    db = tmp_path / f"{kind}.sqlite"
    done = alembic("-x", f"db={db}", "upgrade", "head", section=KINDS[kind][0])
    assert done.returncode == 0, done.stderr
    return db


def drop_column(db: Path, table: str, column: str) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    assert column not in [r[1] for r in sqlite3.connect(db).execute(f"PRAGMA table_info({table})")]


@pytest.mark.parametrize("kind", KINDS)
def test_alembic_check_reports_no_drift_on_a_head_file(tmp_path, kind):
    db = head_file(tmp_path, kind)
    done = alembic("-x", f"db={db}", "check", section=KINDS[kind][0])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No new upgrade operations detected" in done.stdout + done.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_alembic_check_names_the_column_a_file_lacks_against_the_models(tmp_path, kind):
    section, table, column = KINDS[kind]
    db = head_file(tmp_path, kind)
    drop_column(db, table, column)
    done = alembic("-x", f"db={db}", "check", section=section)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "New upgrade operations detected" in out and "add_column" in out and f"'{column}'" in out, out


@pytest.mark.parametrize("kind", KINDS)
def test_revision_autogenerate_drafts_the_next_revision_adding_the_missing_column(tmp_path, kind):
    section, table, column = KINDS[kind]
    db = head_file(tmp_path, kind)
    drop_column(db, table, column)
    # Draft into a copy of the migrations, so migrations/versions never gains a file.
    shipped = ROOT / "migrations" if kind == "store" else ROOT / "migrations" / "trace"
    scripts = tmp_path / "scripts"
    shutil.copytree(shipped, scripts, ignore=shutil.ignore_patterns("__pycache__"))
    ini = tmp_path / "alembic.ini"
    ini.write_text((ROOT / "alembic.ini").read_text().replace(
        f"script_location = %(here)s/{shipped.relative_to(ROOT)}\n", f"script_location = {scripts}\n"))
    before = sorted(p.name for p in (shipped / "versions").iterdir())
    done = alembic("-x", f"db={db}", "revision", "--autogenerate", "-m", "draft", ini=ini, section=section)
    assert done.returncode == 0, done.stdout + done.stderr
    drafts = sorted(set(p.name for p in (scripts / "versions").glob("*.py")) - set(before))
    assert len(drafts) == 1, drafts
    text = (scripts / "versions" / drafts[0]).read_text()
    assert "add_column" in text and f"'{column}'" in text and f"'{table}'" in text, text
    assert sorted(p.name for p in (shipped / "versions").iterdir()) == before
