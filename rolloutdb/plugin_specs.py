"""Plugin specs as the config holds them: ``"module:callable"`` or ``"./file.py:callable"``.

The config resolves a spec's relative file against the config file's directory when it is
loaded; importing and checking what a spec names is the controller's work
(`controller/tasks/plugins.py`). This module is the part both need, so the config never
imports the controller."""

from __future__ import annotations

from pathlib import Path


def is_file_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target or target.startswith(".")


def absolute_spec(spec: str, base_dir: str | Path) -> str:
    """The spec with a relative file made absolute against `base_dir` (the config file's
    directory), so the run directory's resolved config.yaml works from anywhere."""
    if not isinstance(spec, str) or ":" not in spec:
        return spec  # load_callable says what is wrong with it
    target, _, attr = spec.rpartition(":")
    if not is_file_target(target) or Path(target).is_absolute():
        return spec
    return f"{(Path(base_dir) / target).resolve()}:{attr}"


def resolve_relative_paths(data: dict, base_dir: str | Path) -> None:
    """In a parsed config (before validation): make dataset.path, reward.function,
    environment.factory and trainer.factory absolute against the config's directory."""
    for section, name in (("reward", "function"), ("environment", "factory"), ("trainer", "factory")):
        part = data.get(section)
        if isinstance(part, dict) and isinstance(part.get(name), str):
            part[name] = absolute_spec(part[name], base_dir)
    part = data.get("dataset")
    if isinstance(part, dict) and isinstance(part.get("path"), str) and not Path(part["path"]).is_absolute():
        part["path"] = str((Path(base_dir) / part["path"]).resolve())
