"""The wheel holds every package of the source tree: built from a copy of the sources,
installed into a fresh venv, every rolloutdb.* package imports from the venv (never from
the source tree) and the shipped Alembic migrations build a store and a trace file.
The packages are discovered (each folder with __init__.py under a package-dir folder), so a
new subpackage that pyproject.toml's `packages` forgets fails here. ~30 s on 2 cores."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

from package_layout import ROOT, package_dirs, source_packages

IMPORT_ALL = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = importlib.import_module(name).__file__
    except Exception as e:
        found[name] = f"ImportError: {e}"
print(json.dumps(found))
"""

MAKE_FILES = """
import sys
from rolloutdb.store import Store
from rolloutdb.store.trace.writer import open_tracer
Store.create(sys.argv[1]).close()
open_tracer(sys.argv[2]).close()
"""


def run(*cmd: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}:\n{done.stdout}\n{done.stderr}"
    return done


def install_wheel(tmp: Path, pyproject_text: str | None = None) -> Path:
    """Build a wheel from a copy of the sources (a build in the tree itself would reuse a
    stale build/lib) and install it into a new venv; returns the venv's python."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    if pyproject_text is not None:
        (src / "pyproject.toml").write_text(pyproject_text)
    for folder in {p.relative_to(ROOT).parts[0] for p in package_dirs().values()}:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    # With build isolation, as the README's install step builds: the build backend is the one
    # build-system.requires names (the environment's own setuptools may be older).
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), str(src), cwd=tmp)
    (wheel,) = (tmp / "dist").glob("rolloutdb-*.whl")
    run(sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv"), cwd=tmp)
    python = tmp / "venv" / "bin" / "python"
    # The dependencies come from the interpreter running the tests. `--system-site-packages`
    # would give the *base* interpreter's packages, not this venv's, when the tests run in a
    # venv (as a user runs them): then nothing imports. A path file lists this interpreter's
    # site directories instead, after the new venv's own, so rolloutdb comes from the wheel.
    # Lines of a .pth are added to sys.path without running that directory's own .pth files,
    # so an editable install of the source tree stays out of the new venv.
    (site,) = (tmp / "venv" / "lib").glob("python3*/site-packages")
    (site / "_test_deps.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel), cwd=tmp)
    return python


def imports(python: Path, names: list[str], cwd: Path) -> dict[str, str]:
    return json.loads(run(str(python), "-c", IMPORT_ALL, *names, cwd=cwd).stdout)


def test_every_source_package_imports_from_the_installed_wheel_and_its_migrations_build_files(tmp_path):
    packages = sorted(source_packages())
    assert {"rolloutdb", "rolloutdb.store", "rolloutdb.migrations.versions"} <= set(packages)
    python = install_wheel(tmp_path)
    venv = str(tmp_path / "venv")
    found = imports(python, packages, cwd=tmp_path)
    wrong = {name: where for name, where in found.items() if not where or not where.startswith(venv)}
    assert not wrong, f"not imported from the wheel (pyproject.toml `packages` may miss them): {wrong}"
    assert (Path(found["rolloutdb"]).parent / "py.typed").is_file()
    assert (Path(found["rolloutdb.migrations"]).parent / "script.py.mako").is_file()

    store, logs = tmp_path / "made" / "store.sqlite", tmp_path / "made" / "logs"
    run(str(python), "-c", MAKE_FILES, str(store), str(logs), cwd=tmp_path)
    # revision ids are the first three parts of the shipped file names (v1_1_a_...py)
    shipped = {"_".join(p.stem.split("_")[:3]) for p in Path(found["rolloutdb.migrations.versions"]).parent.glob("v*.py")}
    rows = sqlite3.connect(store).execute("SELECT version_num FROM alembic_version").fetchall()
    assert len(rows) == 1 and rows[0][0] in shipped, (rows, shipped)
    (trace,) = list(logs.glob("*.sqlite"))
    assert sqlite3.connect(trace).execute("SELECT count(*) FROM alembic_version").fetchone() == (1,)


def test_a_subpackage_left_out_of_pyproject_packages_fails_to_import_from_the_wheel(tmp_path):
    text = (ROOT / "pyproject.toml").read_text()
    forgotten = '"rolloutdb.migrations.versions", '
    assert forgotten in text
    python = install_wheel(tmp_path, text.replace(forgotten, "", 1))
    found = imports(python, ["rolloutdb.migrations.versions"], cwd=tmp_path)
    assert not found["rolloutdb.migrations.versions"].startswith(str(tmp_path / "venv"))
