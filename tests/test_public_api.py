"""Outside the store, code reaches it only through its public API: the facade
`rolloutdb.store` and the names in its `__all__`. No submodule (`rolloutdb.store.live...`),
never the table map `T` or the `schema` module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rolloutdb.store
from conftest import REPO

# Folders outside the store whose modules are part of rolloutdb.
CLIENTS = ("controller", "rolloutdb", "gpu_capture")
FORBIDDEN_NAMES = {"T", "schema"}


def _violations(path: Path, public: set[str]) -> list[str]:
    """One line per store import in `path` that is not `from rolloutdb.store import NAME`
    with NAME public, or `import rolloutdb.store`."""
    where = path.relative_to(REPO)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rolloutdb.store."):
                    out.append(f"{where}:{node.lineno}: import {alias.name} (a store submodule; use `from rolloutdb.store import ...`)")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("rolloutdb.store."):
                names = ", ".join(a.name for a in node.names)
                out.append(f"{where}:{node.lineno}: from {node.module} import {names} (a store submodule; "
                           "use `from rolloutdb.store import ...`)")
            elif node.module == "rolloutdb.store":
                for alias in node.names:
                    if alias.name in FORBIDDEN_NAMES or alias.name not in public:
                        out.append(f"{where}:{node.lineno}: from rolloutdb.store import {alias.name} "
                                   "(not in rolloutdb.store.__all__)")
    return out


def store_import_violations(roots: tuple[str, ...] = CLIENTS) -> list[str]:
    public = set(rolloutdb.store.__all__)
    lines: list[str] = []
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            lines += _violations(path, public)
    return lines


def test_code_outside_the_store_imports_only_names_the_facade_exports():
    violations = store_import_violations()
    assert not violations, "imports past the store's public API:\n" + "\n".join(violations)


def test_the_facade_exports_no_table_map_and_every_exported_name_exists():
    public = rolloutdb.store.__all__
    assert not FORBIDDEN_NAMES & set(public)
    assert len(public) == len(set(public)), "a name listed twice in __all__"
    missing = [name for name in public if not hasattr(rolloutdb.store, name)]
    assert not missing, missing


def test_a_submodule_import_and_a_private_name_are_each_reported_with_file_and_line(tmp_path, monkeypatch):
    """The checker itself: it names the file, the line and the import."""
    import test_public_api as me

    fake = tmp_path / "controller"
    fake.mkdir()
    (fake / "bad.py").write_text(
        "from rolloutdb.store import Store\n"
        "from rolloutdb.store.live.schema import T\n"
        "import rolloutdb.store.sqlite.database\n"
        "from rolloutdb.store import _BUMP\n"
    )
    monkeypatch.setattr(me, "REPO", tmp_path)
    lines = me.store_import_violations(("controller",))
    assert [line.split(" (")[0] for line in lines] == [
        "controller/bad.py:2: from rolloutdb.store.live.schema import T",
        "controller/bad.py:3: import rolloutdb.store.sqlite.database",
        "controller/bad.py:4: from rolloutdb.store import _BUMP",
    ]


SQL_WORDS = ("SELECT ", "INSERT ", "UPDATE ", "DELETE ")
SQL_BUILDERS = {"select", "insert", "update", "delete", "func", "text"}
# DuckDB reading a user's dataset file (controller/tasks/datasets.py) is not SQL against the store.
USER_FILE_READS = re.compile(r"\bFROM\s+read_(parquet|json|json_auto|csv|csv_auto)\(", re.I)


def controller_sql(root: str = "controller") -> list[str]:
    """One line per raw SQL string or SQLAlchemy statement builder in `root`: every read a
    pump needs is a named function of `rolloutdb.store.queries`."""
    out = []
    for path in sorted((REPO / root).rglob("*.py")):
        where = path.relative_to(REPO)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lstrip().upper().startswith(SQL_WORDS) \
                    and not USER_FILE_READS.search(node.value):
                out.append(f"{where}:{node.lineno}: SQL text {node.value[:40]!r}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
                built = sorted(a.name for a in node.names if a.name in SQL_BUILDERS)
                if built:
                    out.append(f"{where}:{node.lineno}: from {node.module} import {', '.join(built)}")
    return out


def test_the_controller_builds_no_sql():
    found = controller_sql()
    assert not found, "SQL in the controller (add a function to store/live/queries.py):\n" + "\n".join(found)


def test_the_sql_check_names_a_query_string_and_a_statement_builder(tmp_path, monkeypatch):
    import test_public_api as me

    (tmp_path / "controller").mkdir()
    (tmp_path / "controller" / "pump.py").write_text(
        "from sqlalchemy import Connection, func, select\n"
        "def f(tx):\n"
        "    return tx.exec_driver_sql(\"SELECT group_id FROM rollouts WHERE state = 'running'\")\n"
    )
    monkeypatch.setattr(me, "REPO", tmp_path)
    assert me.controller_sql() == [
        "controller/pump.py:1: from sqlalchemy import func, select",
        "controller/pump.py:3: SQL text 'SELECT group_id FROM rollouts WHERE stat'",
    ]
