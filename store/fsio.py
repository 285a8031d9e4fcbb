"""Durable file operations. The one commit protocol of rolloutdb is built from these:
write beside the target, fsync, rename into place, fsync the parent directory."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(tmp: str | Path, target: str | Path) -> None:
    """Atomically put the finished file `tmp` at `target` (same directory)."""
    tmp, target = Path(tmp), Path(target)
    fsync_file(tmp)
    os.replace(tmp, target)
    fsync_dir(target.parent)


def temp_path_beside(target: str | Path, tag: str) -> Path:
    """A name in the target's directory that listing and retention recognise as
    temporary (a leading dot and a `.tmp` suffix)."""
    target = Path(target)
    return target.with_name(f".{target.name}.{tag}.{os.getpid()}.tmp")
