"""docs/schema.md is what scripts/schema_doc.py writes from the models, every BLOB column's
format is on it, and every column of a store file built by the real migrations (and of a
real trace file) is listed under its table."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sqlite3
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "scripts" / "schema_doc.py"
PAGE = REPO / "docs" / "schema.md"


def _generator():
    spec = importlib.util.spec_from_file_location("schema_doc", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented_columns(text: str) -> dict[str, set[str]]:
    """Table -> the columns its section of the page lists."""
    out: dict[str, set[str]] = {}
    table = None
    for line in text.splitlines():
        heading = re.match(r"^### `(\w+)`$", line)
        if heading:
            table = heading.group(1)
            out[table] = set()
        elif table and (row := re.match(r"^\| `(\w+)` \| [A-Z]", line)):
            out[table].add(row.group(1))
    return out


def file_columns(path) -> dict[str, set[str]]:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                             "AND name NOT LIKE 'sqlite_%' AND name != 'alembic_version'")]
        return {t: {r[1] for r in conn.execute(f'PRAGMA table_info("{t}")')} for t in tables}


def test_the_page_is_what_the_generator_writes_from_the_models():
    check = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    assert PAGE.read_text() == _generator().render()


def test_every_blob_column_of_the_models_has_its_format_on_the_page():
    generator = _generator()
    assert generator.blob_columns_without_format() == []
    text = PAGE.read_text()
    for fmt in set(generator.FORMATS.values()):
        assert fmt in text, fmt


def test_every_column_of_a_migrated_store_and_a_real_trace_file_is_documented_under_its_table(store, tmp_path):
    from rolloutdb.store import open_tracer

    documented = documented_columns(PAGE.read_text())
    on_disk = file_columns(store.path)
    tracer = open_tracer(tmp_path / "logs")
    tracer.close()
    on_disk.update(file_columns(tmp_path / "logs" / "rollout_trace.sqlite"))
    missing = {t: sorted(cols - documented.get(t, set())) for t, cols in on_disk.items() if cols - documented.get(t, set())}
    assert not missing, f"columns not on docs/schema.md: {missing}"
    assert {"samples", "rollouts", "train_step", "payload"} <= set(documented)


def test_the_check_fails_naming_the_page_when_it_is_out_of_date(tmp_path, monkeypatch):
    generator = _generator()
    stale = tmp_path / "schema.md"
    stale.write_text(PAGE.read_text().replace("| `num_tokens` |", "| `num_token` |", 1))
    monkeypatch.setattr(generator, "PAGE", stale)
    assert generator.main(["--check"]) == 1
