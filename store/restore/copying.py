"""The two full reads of a snapshot's store file that a restore makes, overlapped.

Measured with bench/bench_restore.py (100k groups, 1 GiB): copying while hashing in
Python (4 MiB `read` + `sha256.update` + `write`; the hash is now the one the manifest's
format names, BLAKE3 for format 2, see checkpoints/hashing.py) and then `PRAGMA integrity_check` of
the copy took most of the restore, one after the other on one core. Here:

* `copy_hashing`: the kernel copies (`os.copy_file_range`, no trip through Python's
  buffers) in large steps while a helper thread hashes each finished step *of the
  copy*, so the checksum covers exactly the bytes every later check reads and the hash
  of step k overlaps the copy of step k+1. Where the kernel refuses the call (another
  file system, an old kernel), it falls back to reading and writing through one reused
  buffer.
* `SourceIntegrityCheck`: `PRAGMA integrity_check` of the snapshot file itself, opened
  read-only and immutable (no lock, no side file: the snapshot directory is only ever
  read), on its own thread while the copy runs. Why checking the source and not the copy
  is the same check: the copy is proven byte-for-byte equal to the published file by
  its checksum (computed over the copy), and a published snapshot is never written again.
  For the check to pass on the source while the copy differed, the published file would
  have to change during the restore into a *consistent* file that is not the one
  published, and the copy would still carry the published bytes, which the manifest
  vouches for. A copy that is migrated to head is new bytes and is checked again, on the
  copy (`plan.py`).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .. import faults
from ..checkpoints.hashing import Hashing
from ..sqlite.integrity import integrity_problems

COPY_STEP = 64 * 1024 * 1024  # bytes the kernel copies between two hash hand-offs
HASH_CHUNK = 4 * 1024 * 1024
# copy_file_range refused: not supported here, or across these file systems.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM}


def _hash_range(digest, fd: int, offset: int, length: int) -> None:
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    end = offset + length
    while offset < end:
        n = os.preadv(fd, [view[: min(HASH_CHUNK, end - offset)]], offset)
        if n <= 0:
            raise OSError(errno.EIO, f"short read of the restore copy at byte {offset}")
        digest.update(view[:n])
        offset += n


class _Copier:
    """Copies `fin` to `fout` in steps: kernel copy while it works, else read/write."""

    def __init__(self, fin, fout):
        self.fin, self.fout = fin, fout
        self.kernel = hasattr(os, "copy_file_range")
        self.buf = None

    def step(self, limit: int) -> int:
        """Copy up to `limit` more bytes; 0 at the end of the source."""
        done = 0
        while done < limit:
            n = self._kernel(limit - done) if self.kernel else None
            if n is None:
                n = self._userspace(limit - done)
            if n == 0:
                break
            done += n
        return done

    def _kernel(self, count: int) -> int | None:
        try:
            return os.copy_file_range(self.fin.fileno(), self.fout.fileno(), count)
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY:
                raise
            self.kernel = False  # both file offsets are where the last success left them
            return None

    def _userspace(self, count: int) -> int:
        if self.buf is None:
            self.buf = bytearray(HASH_CHUNK)
        view = memoryview(self.buf)[: min(HASH_CHUNK, count)]
        n = self.fin.readinto(view)
        if n:
            self.fout.write(view[:n])
        return n or 0


def copy_hashing(src: Path, dst: Path, hashing: Hashing) -> tuple[int, str]:
    """Copy `src` to the new file `dst`; returns (size, `hashing` digest of the copy's bytes)."""
    digest = hashing.new(os.stat(src).st_size)
    size = 0
    faults.io("write", dst)
    with open(src, "rb", buffering=0) as fin, open(dst, "xb+", buffering=0) as fout:
        copier = _Copier(fin, fout)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rolloutdb-restore-hash") as pool:
            hashed_step: Future | None = None
            while True:
                n = copier.step(COPY_STEP)
                if hashed_step is not None:
                    hashed_step.result()  # in order: the digest is sequential
                    hashed_step = None
                if n == 0:
                    break
                hashed_step = pool.submit(_hash_range, digest, fout.fileno(), size, n)
                size += n
    return size, digest.hexdigest()


class SourceIntegrityCheck:
    """`integrity_problems(conn, 3)` of a published store file on a background thread.
    `result()` waits and returns the problems (empty when sound); `cancel()`
    interrupts a check nobody will wait for (an earlier refusal)."""

    def __init__(self, path: Path):
        self.path = path
        self._rows: list[str] | None = None
        self._conn: sqlite3.Connection | None = None
        self._cancelled = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rolloutdb-restore-integrity", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            uri = f"{self.path.resolve().as_uri()}?mode=ro&immutable=1"
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
            with self._lock:
                if self._cancelled:
                    conn.close()
                    return
                self._conn = conn
            try:
                self._rows = integrity_problems(conn, 3, errors_as_problems=True)
            finally:
                with self._lock:
                    self._conn = None
                conn.close()
        except sqlite3.DatabaseError as e:
            self._rows = [str(e)]

    def result(self) -> list[str]:
        self._thread.join()
        return self._rows if self._rows is not None else ["integrity check did not run"]

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._conn is not None:
                self._conn.interrupt()
        self._thread.join()
