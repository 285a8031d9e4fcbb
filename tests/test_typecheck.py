"""mypy over every rolloutdb.* package, configured in pyproject.toml ([tool.mypy]).

mypy cannot follow setuptools' editable install (an import hook), so the package-dir mapping
is laid out as links under build/typecheck/view and put on MYPYPATH; errors name the real
files (store/..., controller/...). Cache: build/typecheck/cache (gitignored). About 60 s
cold on 2 busy cores, a few seconds warm. By hand:
    python -m pytest tests/test_typecheck.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from package_layout import ROOT, link_tree

WORK = ROOT / "build" / "typecheck"


def run_mypy(root: Path = ROOT, work: Path = WORK) -> subprocess.CompletedProcess[str]:
    view = work / "view"
    shutil.rmtree(view, ignore_errors=True)
    links = link_tree(view, root)
    env = dict(os.environ, MYPYPATH=str(view))
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml"),
         "--cache-dir", str(work / "cache"), "--no-error-summary", "--show-absolute-path", "-p", "rolloutdb"],
        cwd=root, env=env, capture_output=True, text=True, timeout=1500,
    )
    out = done.stdout + done.stderr
    for link, source in sorted(links.items(), key=lambda kv: -len(str(kv[0]))):
        out = out.replace(str(link), str(source.relative_to(root)))
    done.stdout, done.stderr = out, ""
    return done


# A cold run took over 5 min (pytest-timeout's default) at load ~20 on 2 cores: the limit
# detects a hang, not slowness.
@pytest.mark.timeout(1800)
def test_mypy_finds_no_type_errors_in_any_rolloutdb_package():
    done = run_mypy()
    assert done.returncode == 0, f"mypy (config: pyproject.toml [tool.mypy]) found:\n{done.stdout}"


def test_the_package_is_marked_typed_for_checkers_of_its_users():
    assert (ROOT / "rolloutdb" / "py.typed").is_file()
