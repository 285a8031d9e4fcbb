"""The one place that decides which hash checks a published file.

A manifest names its hash: format 1 (rolloutdb before W2-G) lists each file's
``sha256``; format 2 names ``"hash": "blake3"`` and lists each file's ``blake3``. New
publications write format 2; format 1 stays readable and verifiable everywhere.
`hashing_for(format_version, hash_name)` is the only mapping from a manifest to a hash,
so the publisher, `verify`, the restore copy and the crash harness cannot disagree.

Why BLAKE3: sha256 ran at 0.8-1.2 GiB/s here and was the floor of publication and of
restore; BLAKE3 (the `blake3` package, a cryptographic hash, 256-bit output) runs at
1.9-2.4 GiB/s on one core of the same machine (bench/bench_hash.py, BENCHMARKS.md W2-G).

Threads: `blake3(max_threads=AUTO)` measured 2.3 GiB/s against 1.9-2.4 GiB/s for one
thread over the same 512 MiB file on this 2-core machine under load 1.5-2 (no gain
within the noise), and the hash already overlaps the fsync (publish) or the kernel copy
(restore) on the second core. So it is used only where there are cores to spare
(`THREAD_MIN_CPUS`) and for files large enough to split (`THREAD_MIN_BYTES`; BLAKE3's
own threading only splits inputs of several chunks of 1 KiB, and pays a pool hand-off
per update).
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
