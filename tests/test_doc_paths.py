"""Every source path the documentation cites exists: README.md, RELIABILITY.md,
BENCHMARKS.md and docs/*.md name `.py` files (and the docs they point to) that a reader
will open, and a file move must not leave them pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

from package_layout import ROOT

DOCS = [ROOT / "README.md", ROOT / "RELIABILITY.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
# A path-like word ending in .py or .md: `store/live/schema.py`, tests/test_restore.py, docs/trace.md.
CITED = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|md))\b")


def cited_paths(doc: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        found += [(number, m.group(1)) for m in CITED.finditer(line)]
    return found


def exists(cited: str) -> bool:
    if "/" in cited:
        return (ROOT / cited).exists()
    # A bare file name (`test_restore.py` in a list under tests/): somewhere in the tree.
    return any(p for p in ROOT.rglob(cited) if ".venv" not in p.parts and "node_modules" not in p.parts)


def test_the_path_pattern_finds_the_paths_docs_cite():
    assert [c for _, c in cited_paths(ROOT / "README.md")], "README.md cites no .py/.md path: the pattern is broken"
    assert CITED.findall("see `store/live/schema.py` and docs/trace.md.") == ["store/live/schema.py", "docs/trace.md"]


def test_every_source_path_the_documentation_cites_exists():
    stale = [f"{doc.relative_to(ROOT)}:{n}: {cited}" for doc in DOCS for n, cited in cited_paths(doc) if not exists(cited)]
    assert not stale, "the docs cite paths that do not exist:\n" + "\n".join(stale)


DOTTED = re.compile(r"\b(rolloutdb(?:\.\w+)+)")


def resolves(dotted: str) -> bool:
    """`rolloutdb.a.b.NAME`: the longest importable module, then attributes."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_module_and_name_the_documentation_cites_resolves():
    stale = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            stale += [f"{doc.relative_to(ROOT)}:{number}: {d}" for d in DOTTED.findall(line) if not resolves(d)]
    assert not stale, "the docs cite modules or names that do not exist:\n" + "\n".join(stale)
