"""One way per job (issue W2-A, item 4): one atomic file write, one integrity check.

The behaviour of the one atomic write is checked on real files with the disk made to
fail (`faults.inject_io`); that nobody writes a second one by hand, or runs the integrity
pragmas by hand, is checked over the source with `ast` (docstrings may name them).
"""

from __future__ import annotations

import ast
import errno
from pathlib import Path

import pytest

from rolloutdb.store import faults
from rolloutdb.store.fsio import write_file_atomic

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("store", "controller", "rolloutdb", "gpu_capture")


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), filename=str(path))


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            yield node, (f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None)


def test_an_atomic_write_that_fails_at_the_rename_keeps_the_old_file_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "config.yaml"
    target.write_bytes(b"old: 1\n")
    with faults.inject_io("rename", errno.ENOSPC) as fault, pytest.raises(OSError) as info:
        write_file_atomic(target, "new: 2\n")
    assert fault.fired == 1 and info.value.errno == errno.ENOSPC
    assert target.read_bytes() == b"old: 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_an_atomic_write_built_by_a_function_that_fails_leaves_no_file_at_all(tmp_path):
    target = tmp_path / "store.sqlite"

    def build(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise RuntimeError("migration failed")

    with pytest.raises(RuntimeError):
        write_file_atomic(target, build, tag="create")
    assert list(tmp_path.iterdir()) == []


def test_an_atomic_write_replaces_the_file_whole_and_writes_text_as_utf8(tmp_path):
    target = tmp_path / "high_water"
    write_file_atomic(target, b"1\n")
    write_file_atomic(target, "7 \u2713\n")
    assert target.read_bytes() == "7 \u2713\n".encode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["high_water"]


# Files that build a SQLite file beside its target through other steps than one write
# (a backup-API copy, a hashed copy) and so call `replace_file` themselves.
REPLACES_BY_ITSELF = {"store/fsio.py", "store/sqlite/upgrade.py", "store/restore/apply.py"}
# `temp_path_beside` also names the temporary *directory* a publication is built in.
NAMES_TEMP_PATHS = REPLACES_BY_ITSELF | {"store/checkpoints/publish.py"}


def test_no_module_renames_a_hand_written_temporary_file_into_place():
    found = []
    for rel, tree in _sources():
        for node, name in _calls(tree):
            if name in ("replace", "rename") and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "os" and rel != "store/fsio.py":
                found.append(f"{rel}:{node.lineno}: os.{name}; use fsio.write_file_atomic")
            if name == "replace_file" and rel not in REPLACES_BY_ITSELF:
                found.append(f"{rel}:{node.lineno}: replace_file; use fsio.write_file_atomic")
            if name == "temp_path_beside" and rel not in NAMES_TEMP_PATHS:
                found.append(f"{rel}:{node.lineno}: temp_path_beside; use fsio.write_file_atomic")
    assert not found, "\n".join(found)


def test_only_the_integrity_module_runs_the_integrity_pragmas():
    found = []
    for rel, tree in _sources():
        if rel == "store/sqlite/integrity.py":
            continue
        for node, name in _calls(tree):
            if name not in ("execute", "executescript", "exec_driver_sql") or not node.args:
                continue
            text = " ".join(n.value for n in ast.walk(node.args[0]) if isinstance(n, ast.Constant) and isinstance(n.value, str))
            if "integrity_check" in text or "quick_check" in text:
                found.append(f"{rel}:{node.lineno}: runs {text!r}; use sqlite.integrity.integrity_problems")
    assert not found, "\n".join(found)
