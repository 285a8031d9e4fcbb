"""Threads and locks in one place: every thread the code can start is named, and the
docstring of controller/run/runtime.py lists it (and lists nothing the code no longer starts).

The code is read, not run: `ast` finds every `threading.Thread(...)`, every executor
(`ThreadPoolExecutor`, `ProcessPoolExecutor`), every `threading.Timer` and
`multiprocessing.Process`, and every `threading.Thread` subclass's `super().__init__`,
in every package of the source tree. A thread's name is its `name=` (or the executor's
`thread_name_prefix=`); for an f-string, the literal text before its first field.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from package_layout import ROOT, source_packages

STARTERS = {"Thread", "Timer", "ThreadPoolExecutor", "ProcessPoolExecutor", "Process"}
NAME_KWARGS = ("name", "thread_name_prefix")
RUNTIME = ROOT / "controller" / "run" / "runtime.py"


def _callee(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _literal_prefix(value: ast.expr) -> str | None:
    """A literal name as it is; an f-string's literal text before its first field,
    marked with a trailing `*` (the name starts with it)."""
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return value.value
    if isinstance(value, ast.JoinedStr):
        text = ""
        for part in value.values:
            if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                break
            text += part.value
        return text + "*" if text else None
    return None


def _names(entry: str, name: str) -> bool:
    """Whether the docstring's `entry` names the thread the code calls `name`: the same
    name, or for an f-string (`prefix*`) one that starts with its literal part. A
    literal name is matched whole: `rolloutdb-check` is not `rolloutdb-checkpointer:...`;
    an executor's prefix (`prefix_*`) is listed as itself or with its suffix."""
    if name.endswith("_*") and entry == name[:-2]:
        return True
    return entry.startswith(name[:-1]) if name.endswith("*") else entry == name


def _thread_name(call: ast.Call) -> str | None:
    for kw in call.keywords:
        if kw.arg in NAME_KWARGS:
            name = _literal_prefix(kw.value)
            # An executor's threads are `<prefix>_<n>`: the prefix is what names them.
            return name + "_*" if name and kw.arg == "thread_name_prefix" and not name.endswith("*") else name
    return None


def _is_super_init(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "__init__" and isinstance(f.value, ast.Call)
            and isinstance(f.value.func, ast.Name) and f.value.func.id == "super")


def thread_starts(root: Path = ROOT) -> list[tuple[str, int, str | None]]:
    """(file relative to the root, line, thread name or None when unnamed)."""
    found = []
    for folder in sorted(set(source_packages(root).values())):
        for path in sorted(folder.glob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and _callee(node) in STARTERS:
                    found.append((rel, node.lineno, _thread_name(node)))
                elif isinstance(node, ast.ClassDef) and any(
                    (isinstance(b, ast.Attribute) and b.attr == "Thread") or (isinstance(b, ast.Name) and b.id == "Thread")
                    for b in node.bases
                ):
                    calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and _is_super_init(c)]
                    for c in calls or [node]:
                        found.append((rel, c.lineno, _thread_name(c) if isinstance(c, ast.Call) else None))
    return found


def documented_threads() -> list[str]:
    """The thread names the runtime docstring lists: lines ``- `name`: ...``."""
    doc = ast.get_docstring(ast.parse(RUNTIME.read_text())) or ""
    return re.findall(r"^- `([^`]+)`", doc, flags=re.MULTILINE)


def test_the_scan_finds_the_threads_we_know_of():
    """Guards the scan itself: if it found nothing, the tests below could not fail."""
    names = {name for _, _, name in thread_starts()}
    assert {"rollout-pump", "snapshot-pump", "reference-engine"} <= names
    assert any(n and n.startswith("rolloutdb-checkpointer") and n.endswith("*") for n in names)


def test_every_thread_the_code_starts_is_named_and_listed_in_the_runtime_docstring():
    listed = documented_threads()
    problems = []
    for rel, line, name in thread_starts():
        if name is None:
            problems.append(f"{rel}:{line}: starts a thread without a literal name= / thread_name_prefix=")
        elif not any(_names(entry, name) for entry in listed):
            problems.append(f"{rel}:{line}: starts thread {name!r}, which controller/run/runtime.py's docstring does not list")
    assert not problems, "\n".join(problems)


def test_every_thread_the_runtime_docstring_lists_is_started_somewhere():
    started = [name for _, _, name in thread_starts() if name]
    stale = [entry for entry in documented_threads()
             if entry != "MainThread" and not any(_names(entry, name) for name in started)]
    assert not stale, f"controller/run/runtime.py lists threads no code starts: {stale}"
