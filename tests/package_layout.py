"""The package-dir mapping of pyproject.toml, read the way setuptools reads it, for the tests
that check tools see the layout (type checker, wheel install)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """`rolloutdb.*` name -> source folder, as `[tool.setuptools] package-dir` maps them."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: root / folder for name, folder in tool["package-dir"].items()}


def source_packages(root: Path = ROOT) -> dict[str, Path]:
    """Every package of the source tree: each folder with an `__init__.py` under a mapped
    folder, named by the nearest mapping above it (so a new store/sqlite/ is found as
    rolloutdb.store.sqlite without anyone listing it)."""
    mapping = package_dirs(root)
    found: dict[str, Path] = {}
    for name, folder in mapping.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            if "__pycache__" in rel.parts:
                continue
            dotted = ".".join((name, *rel.parts))
            # a deeper mapping of the same folder wins (migrations/versions is mapped too)
            found.setdefault(dotted, init.parent)
    return found


def link_tree(view: Path, root: Path = ROOT) -> dict[Path, Path]:
    """Lay the mapping out under `view` as the import system sees it (view/rolloutdb/store ->
    store/), with links to folders so new files need no rebuild. Returns view path -> source
    path for each link, to name the real files in a tool's output."""
    mapping = package_dirs(root)
    links: dict[Path, Path] = {}
    for name in sorted(mapping, key=lambda n: n.count(".")):
        source, dest = mapping[name], view.joinpath(*name.split("."))
        if dest.resolve() == source.resolve():
            continue  # the parent's link already shows it (migrations/versions)
        if "." not in name:  # the top package: a real folder, each entry linked
            dest.mkdir(parents=True)
            for entry in source.iterdir():
                if entry.name != "__pycache__":
                    (dest / entry.name).symlink_to(entry)
                    links[dest / entry.name] = entry
        else:
            if dest.is_symlink() or dest.exists():
                dest.unlink()  # a top-level entry of the same name: the mapping wins
            dest.symlink_to(source, target_is_directory=True)
            links[dest] = source
    return links
