"""The store's imports run one way (docs/architecture.md, "Subsystems and floors").

Every `store/**.py` is parsed with `ast`; every import in it, at module level or inside a
function, relative or absolute, is resolved to the store module it names and mapped to its
layer. A forbidden edge fails with one line naming the file, the line, the import and the
rule; a cycle between store modules fails naming the modules in it. Function-level imports
count: a lazy import hides an edge from the import system, not from the design.
"""

from __future__ import annotations

import ast
from pathlib import Path
from import_graph import circles

STORE = Path(__file__).resolve().parents[1] / "store"
PACKAGE = "rolloutdb.store"

# Foundation modules import nothing from the store's subpackages.
FOUNDATION = {"errors", "faults", "fsio"}
ALLOWED = {
    "foundation": {"foundation"},
    "sqlite": {"sqlite", "foundation"},
    "live": {"live", "sqlite", "foundation"},
    "trace": {"trace", "sqlite", "foundation"},
    "checkpoints": {"checkpoints", "live", "sqlite", "foundation"},
    "restore": {"restore", "checkpoints", "live", "sqlite", "foundation"},
}
FACADE = PACKAGE


def module_name(path: Path, root: Path = STORE) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE, *parts])


def layer(module: str) -> str:
    """The layer of a store module: foundation, a subsystem, or the facade."""
    if module == FACADE:
        return "facade"
    first = module[len(PACKAGE) + 1 :].split(".")[0]
    return "foundation" if first in FOUNDATION else first


def store_modules(root: Path = STORE) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imports_of(path: Path, known: set[str], root: Path = STORE) -> list[tuple[int, str, str]]:
    """Every store module this file imports: (line, the import as written, target module).

    `from X import name` targets X.name when that is a store module (a submodule import),
    else X itself; so `from .. import faults` is an edge to `faults`, while
    `from .. import Store` is an edge to the facade.
    """
    own = module_name(path, root)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.append((node.lineno, f"import {alias.name}", _nearest(alias.name, known)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "rolloutdb" and any(a.name == "store" for a in node.names):
                found.append((node.lineno, "from rolloutdb import store", FACADE))
                continue
            if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            written = "from " + "." * node.level + (node.module or "") + " import "
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                target = candidate if candidate in known else _nearest(base, known)
                found.append((node.lineno, written + alias.name, target))
    return found


def _nearest(name: str, known: set[str]) -> str:
    while name not in known and "." in name:
        name = name.rpartition(".")[0]
    return name


def edge_violations(root: Path = STORE) -> list[str]:
    modules = store_modules(root)
    known = set(modules)
    problems = []
    for module, path in modules.items():
        source = layer(module)
        if source == "facade":
            continue  # the facade re-exports every subsystem
        rel = path.relative_to(root.parent)
        for line, written, target in imports_of(path, known, root):
            if target == FACADE:
                problems.append(
                    f"{rel}:{line}: `{written}` imports the facade {FACADE}; "
                    f"rule: no store module imports the facade"
                )
                continue
            wanted = layer(target)
            if wanted not in ALLOWED[source]:
                allowed = ", ".join(sorted(ALLOWED[source]))
                problems.append(
                    f"{rel}:{line}: `{written}` is {source} -> {wanted}; "
                    f"rule: {source} may import only {allowed}"
                )
    return problems


def outside_imports(root: Path = STORE) -> list[str]:
    """Imports of rolloutdb modules outside the store (the controller, the CLI, the config):
    the store knows nothing of them."""
    problems = []
    for module, path in store_modules(root).items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [(a.name, f"import {a.name}") for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                names = [(f"{base}.{a.name}", "from " + "." * node.level + (node.module or "") + f" import {a.name}")
                         for a in node.names]
            else:
                continue
            for name, written in names:
                if (name == "rolloutdb" or name.startswith("rolloutdb.")) and not (
                        name == PACKAGE or name.startswith(PACKAGE + ".")):
                    problems.append(f"{path.relative_to(root.parent)}:{node.lineno}: `{written}` reaches outside "
                                    f"the store; rule: the store imports nothing of rolloutdb but {PACKAGE}")
    return problems


def import_cycles(root: Path = STORE) -> list[list[str]]:
    """Strongly connected components (more than one module, or a self-import) of the graph."""
    modules = store_modules(root)
    known = set(modules)
    graph = {
        m: sorted({t for _, _, t in imports_of(p, known, root) if t in known}) for m, p in modules.items()
    }
    return circles(graph)


def test_every_store_import_follows_the_allowed_edges():
    problems = edge_violations()
    assert not problems, "forbidden store imports:\n" + "\n".join(problems)


def test_the_store_imports_nothing_of_rolloutdb_outside_the_store():
    problems = outside_imports()
    assert not problems, "imports from outside the store:\n" + "\n".join(problems)


def test_no_import_cycle_between_store_modules():
    cycles = import_cycles()
    assert not cycles, "import cycles between store modules:\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_checks_see_a_planted_forbidden_import_and_cycle(tmp_path):
    """The checks can fail: a copy of store/ with a bad edge planted in a function body."""
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(STORE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    errors = copy / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _planted():\n    from .live.store import Store\n")
    problems = edge_violations(copy)
    assert any(
        p.startswith("store/errors.py:") and "`from .live.store import Store` is foundation -> live" in p
        for p in problems
    ), problems
    assert any("rolloutdb.store.errors" in c for c in import_cycles(copy))
    fsio = copy / "fsio.py"
    fsio.write_text(fsio.read_text() + "\n\ndef _planted():\n    from rolloutdb.controller import runtime\n")
    assert any(p.startswith("store/fsio.py:") and "`from rolloutdb.controller import runtime`" in p
               for p in outside_imports(copy)), outside_imports(copy)
