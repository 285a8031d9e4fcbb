"""The whole package's imports run one way (docs/architecture.md, "Subsystems and floors").

tests/test_import_edges.py holds the store's own layers. This file holds everything else:
the controller's subpackages, the config and the CLI, gpu_capture and the migrations, each
a *unit* with a rule naming the units it may import. Every `.py` of every package
(pyproject's package-dir, read by tests/package_layout.py) is parsed with `ast`; every
import in it, at module level or inside a function, under `if TYPE_CHECKING:` or not,
absolute or relative, is an edge. A forbidden edge fails with one line naming the file,
the line, the import and the rule; a circle between any two modules of the package fails
naming the modules in it. A lazy import hides an edge from the import system, not from the
design.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

from package_layout import ROOT, source_packages
from import_graph import circles

PACKAGE = "rolloutdb"

# Imported by everything, importing nothing of rolloutdb but the store.
FOUNDATION = {"rolloutdb", "rolloutdb.sampling_limits", "rolloutdb.timefmt", "rolloutdb.plugin_specs"}
# The controller's seams and kill points: the flat modules beside its subpackages.
SEAMS = {"rolloutdb.controller", "rolloutdb.controller.protocols", "rolloutdb.controller.fault_points"}
CONTROLLER_FLOORS = ("run", "tasks", "rollout", "training", "recovery", "agent_server", "job")
BASE = {"foundation", "store"}
RUN_BASE = BASE | {"config", "gpu_capture", "controller.seams"}

# unit -> the other units it may import. Bottom up; each controller floor may import the
# floors listed before it where it needs them, never one after it.
ALLOWED: dict[str, set[str]] = {
    "foundation": {"store"},
    "store": set(),  # tests/test_import_edges.py: the store imports nothing of rolloutdb outside it
    "migrations": {"store"},
    "gpu_capture": {"foundation"},
    "config": BASE,
    "controller.seams": BASE | {"gpu_capture"},
    "controller.run": RUN_BASE,
    "controller.tasks": RUN_BASE,
    "controller.rollout": RUN_BASE | {"controller.run", "controller.tasks"},
    "controller.training": RUN_BASE | {"controller.run", "controller.tasks", "controller.rollout"},
    "controller.recovery": RUN_BASE | {"controller.run", "controller.tasks", "controller.rollout",
                                       "controller.training"},
    # Agent servers run episodes (rollout) and implement the snapshot's environment side
    # (recovery's EnvironmentCheckpoint).
    "controller.agent_server": RUN_BASE | {"controller.run", "controller.tasks", "controller.rollout",
                                           "controller.recovery"},
    "controller.job": RUN_BASE | {f"controller.{f}" for f in CONTROLLER_FLOORS if f != "job"},
    "commands": RUN_BASE | {"migrations"} | {f"controller.{f}" for f in CONTROLLER_FLOORS},
    "cli": RUN_BASE | {"commands"},
    "main": {"cli"},
}


def unit(module: str) -> str:
    """The unit a module of the package belongs to."""
    if module in FOUNDATION:
        return "foundation"
    if module in SEAMS:
        return "controller.seams"
    rest = module[len(PACKAGE) + 1:].split(".")
    if rest[0] == "controller":
        return f"controller.{rest[1]}"
    return {"__main__": "main", "config": "config", "cli": "cli"}.get(rest[0], rest[0])


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    modules = {}
    for package, folder in source_packages(root).items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.name == "__init__.py" else f"{package}.{path.stem}"
            modules.setdefault(name, path)
    return modules


def _nearest(name: str, known: set[str]) -> str | None:
    while name not in known and "." in name:
        name = name.rpartition(".")[0]
    return name if name in known else None


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[int, str, str]]:
    """Every package module this file imports: (line, the import as written, target)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _nearest(alias.name, known)
                if target is not None and alias.name.split(".")[0] == PACKAGE:
                    found.append((node.lineno, f"import {alias.name}", target))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != PACKAGE:
                continue
            written = "from " + "." * node.level + (node.module or "") + " import "
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                target = candidate if candidate in known else _nearest(base, known)
                if target is not None:
                    found.append((node.lineno, written + alias.name, target))
    return found


def graph(root: Path = ROOT) -> dict[str, list[tuple[int, str, str]]]:
    modules = package_modules(root)
    known = set(modules)
    return {m: imports_of(m, p, known) for m, p in modules.items()}


def floor_violations(root: Path = ROOT) -> list[str]:
    modules = package_modules(root)
    problems = []
    for module, edges in graph(root).items():
        source = unit(module)
        if source == "store":
            continue  # the store's layers: tests/test_import_edges.py
        rel = modules[module].relative_to(root).as_posix()
        for line, written, target in edges:
            wanted = unit(target)
            if wanted != source and wanted not in ALLOWED[source]:
                allowed = ", ".join(sorted(ALLOWED[source])) or "nothing"
                problems.append(f"{rel}:{line}: `{written}` is {source} -> {wanted}; "
                                f"rule: {source} may import only {allowed}")
    return problems


def module_cycles(root: Path = ROOT) -> list[list[str]]:
    """Every circle between modules of the package (Tarjan's strongly connected
    components of more than one module, or a module importing itself)."""
    edges = {m: sorted({t for _, _, t in e}) for m, e in graph(root).items()}
    return circles(edges)


def test_every_module_outside_the_store_imports_only_the_floors_its_rule_allows():
    problems = floor_violations()
    assert not problems, "forbidden imports:\n" + "\n".join(problems)


def test_no_two_modules_of_the_package_import_each_other_even_lazily():
    cycles = module_cycles()
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_every_unit_the_package_has_is_given_a_rule():
    units = {unit(m) for m in package_modules()}
    assert units <= set(ALLOWED), f"units without a rule: {sorted(units - set(ALLOWED))}"
    assert {f"controller.{f}" for f in CONTROLLER_FLOORS} <= units, "a floor named here has no folder"


def test_no_flat_controller_module_beside_the_floors_is_over_150_lines():
    flat = [p for p in (ROOT / "controller").glob("*.py") if p.name != "__init__.py"]
    long = {p.name: n for p in flat if (n := len(p.read_text().splitlines())) > 160}
    assert not long, f"flat modules of the controller that belong in a floor: {long}"


def _copy_tree(dest: Path) -> Path:
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for folder in {p.relative_to(ROOT).parts[0] for p in source_packages(ROOT).values()}:
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_the_checks_name_a_planted_upward_edge_and_a_lazy_circle(tmp_path):
    """The checks can fail: a copy of the tree with a task module importing the rollout
    pump inside a function (upward, and a circle: the pump imports the task floor)."""
    copy = _copy_tree(tmp_path)
    digits = copy / "controller" / "tasks" / "digits.py"
    digits.write_text(digits.read_text() + "\n\ndef _planted():\n    from rolloutdb.controller.rollout import pump\n")
    assert any(p.startswith("controller/tasks/digits.py:") and
               "`from rolloutdb.controller.rollout import pump` is controller.tasks -> controller.rollout" in p
               for p in floor_violations(copy)), floor_violations(copy)
    config = copy / "rolloutdb" / "config.py"
    config.write_text(config.read_text() + "\n\ndef _planted():\n    from rolloutdb.controller.tasks import plugins\n")
    assert any(p.startswith("rolloutdb/config.py:") and "is config -> controller.tasks" in p
               for p in floor_violations(copy))
    assert any({"rolloutdb.config", "rolloutdb.controller.tasks.plugins"} <= set(c) for c in module_cycles(copy))
