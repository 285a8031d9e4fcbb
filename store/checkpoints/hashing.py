"""The one place that decides which hash checks a published file.

A manifest names its hash: format 1 (written by older rolloutdb) lists each file's
``sha256``; format 2 names ``"hash": "blake3"`` and lists each file's ``blake3``. New
publications write format 2; format 1 stays readable and verifiable everywhere.
`hashing_for(format_version, hash_name)` is the only mapping from a manifest to a hash,
so the publisher, `verify`, the restore copy and retention's scan cannot disagree.

Why BLAKE3: sha256 ran at 0.8-1.3 GiB/s here and was the floor of publication and of
restore; BLAKE3 (the `blake3` package, a cryptographic hash, 256-bit output) runs at
2.8-2.9 GiB/s on one thread of the same machine, 2.2x, and format 2 publishes and
verifies a 256 MiB file 1.9x / 2.1x faster than format 1 (bench/bench_hash.py,
BENCHMARKS.md, "Checksums: sha256 vs BLAKE3"; 2026-12-01, 2 shared cores, load 2.3).

Threads: over the same 512 MiB file in three runs, `blake3(max_threads=AUTO)` ran at
3.32 / 2.83 / 2.86 GiB/s against 2.85 / 2.83 / 2.87 GiB/s for one thread: no reliable
gain on these 2 shared cores, and the second core is already busy with the fsync
(publish) or the kernel copy (restore) that the hash overlaps. So one thread is used
here; AUTO only where there are at least `THREAD_MIN_CPUS` CPUs and the file is large
enough to split (`THREAD_MIN_BYTES`: the pool hand-off is paid per 4 MiB update). That
threshold is not measured on a machine with more cores (none was available):
re-measure with bench/bench_hash.py before relying on it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import blake3

from ..errors import StoreError

CHUNK = 4 * 1024 * 1024  # bytes per update, as sha256's streaming read used before
THREAD_MIN_CPUS = 4
THREAD_MIN_BYTES = 64 * 1024 * 1024

FORMAT_SHA256 = 1
FORMAT_BLAKE3 = 2
WRITE_FORMAT = FORMAT_BLAKE3
# format_version -> the hashes a manifest of that format may name
FORMAT_HASHES = {FORMAT_SHA256: ("sha256",), FORMAT_BLAKE3: ("blake3",)}
DEFAULT_HASH = {FORMAT_SHA256: "sha256", FORMAT_BLAKE3: "blake3"}


class HashingError(StoreError):
    """A manifest names a format or a hash this rolloutdb does not know."""


def uses_threads(size: int) -> bool:
    return (os.cpu_count() or 1) >= THREAD_MIN_CPUS and size >= THREAD_MIN_BYTES


def _new_blake3(size_hint: int = 0) -> Any:
    if uses_threads(size_hint):
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    return blake3.blake3()


@dataclass(frozen=True)
class Hashing:
    """A hash by name: `new(size_hint)` a streaming digest object (update/hexdigest),
    `file(path)` the (size, hex digest) of a file read in `CHUNK` steps."""

    name: str
    _factory: Callable[[int], Any]

    def new(self, size_hint: int = 0) -> Any:
        return self._factory(size_hint)

    def file(self, path: str | Path) -> tuple[int, str]:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            digest = self.new(size)
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            while n := f.readinto(view):
                digest.update(view[:n])
        return size, digest.hexdigest()


SHA256 = Hashing("sha256", lambda _size: hashlib.sha256())
BLAKE3 = Hashing("blake3", _new_blake3)
_BY_NAME = {h.name: h for h in (SHA256, BLAKE3)}


def hashing_for(format_version: Any, hash_name: Any = None, where: str = "manifest") -> Hashing:
    """The hash a manifest of `format_version` naming `hash_name` uses (None: no
    `hash` field, which only format 1 may omit); HashingError naming what is supported
    otherwise."""
    if type(format_version) is not int or format_version not in FORMAT_HASHES:  # not bool, not 1.0
        supported = ", ".join(str(v) for v in FORMAT_HASHES)
        raise HashingError(
            f"{where}: format_version {_show(format_version)} is not one of {supported}; "
            "written by a different rolloutdb (upgrade rolloutdb if newer)"
        )
    if hash_name is None and format_version != FORMAT_SHA256:  # format 1 predates the field
        raise HashingError(f"{where}: format_version {format_version} names no hash "
                           f"(supported: {', '.join(FORMAT_HASHES[format_version])})")
    name = DEFAULT_HASH[format_version] if hash_name is None else hash_name
    if name not in FORMAT_HASHES[format_version]:
        allowed = ", ".join(FORMAT_HASHES[format_version])
        raise HashingError(f"{where}: hash {_show(name)} is not supported in format_version {format_version} "
                           f"(supported: {allowed})")
    return _BY_NAME[name]


def _show(v: Any) -> str:
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
