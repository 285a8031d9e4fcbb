"""Subcommands of `rolloutdb`. Each module here that defines ``register(subparsers)`` is
a subcommand; `register` adds its parser and sets ``func`` to a callable taking the
parsed args and returning the exit code. Discovery keeps modules independent: adding a
command never edits a shared list."""

from __future__ import annotations

import importlib
import pkgutil


def _discover():
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "register"):
            found.append(module.register)
    return found


REGISTRY = _discover()
