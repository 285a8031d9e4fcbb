"""Is a SQLite file open in another process? Asked of SQLite's own locks, changing nothing.

SQLite (unix VFS) takes POSIX advisory locks that say who has a file open:
- every connection to a WAL database holds a shared lock on the ``-shm`` file's DMS byte
  (offset 128) for its whole life, and its read and write locks on the bytes before it
  (120..127) while it reads or writes; in WAL mode it also keeps a SHARED lock on the
  database file's lock bytes all the time;
- in rollback-journal mode a connection holds SHARED/RESERVED/PENDING/EXCLUSIVE locks on
  the database file's lock bytes (from 0x40000000, 512 bytes) only while it reads or
  writes. An *idle* rollback-journal connection holds no lock and leaves no trace, so it
  cannot be seen; every live store is in WAL mode, where it can.

We *test* those locks (``F_OFD_GETLK``, or ``F_GETLK`` where there are no open-file-
description locks), which reports a conflicting lock and its owner's pid without taking
anything. Files are opened read-only; no byte or mtime changes. An OFD test also sees
connections of the calling process; ``F_GETLK`` only those of other processes.

A connection that holds no lock (idle in rollback-journal mode, or opened and never
read) still has the file open: replaced under it, its next commit goes to the unlinked
old file. Where ``/proc`` exists (Linux) we also look for other processes with a
descriptor on the same inode (measured: 3 ms with 85 processes; it grows with the
number of open descriptors); processes of other users whose descriptors we may not read stay unseen.
"""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

PENDING_BYTE = 0x40000000
LOCK_BYTES = 512  # PENDING, RESERVED and the 510 SHARED bytes
SHM_LOCKS = (120, 9)  # the 8 WAL read/write locks and the DMS byte
_FLOCK = "hhqqi4x"  # struct flock on Linux x86_64/aarch64: type, whence, start, len, pid
_GETLK = getattr(fcntl, "F_OFD_GETLK", fcntl.F_GETLK)


def _lock_holder(path: Path, start: int, length: int) -> int | None:
    """The pid holding a lock on [start, start+length) of `path` (-1 when unknown, as for
    OFD locks), or None when nobody does or the file is absent."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
        answer = fcntl.fcntl(fd, _GETLK, query)
    finally:
        os.close(fd)
    kind, _whence, _start, _len, pid = struct.unpack(_FLOCK, answer)
    return None if kind == fcntl.F_UNLCK else pid


def _descriptor_holder(path: Path) -> int | None:
    """Another process with a descriptor on `path`'s inode, from /proc (None if none
    can be seen, or there is no /proc)."""
    try:
        st = os.stat(path)
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    me = os.getpid()
    for pid in pids:
        if pid == me:
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                other = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if other.st_ino == st.st_ino and other.st_dev == st.st_dev:
                return pid
    return None


def open_elsewhere(path: str | Path) -> int | None:
    """The pid of a process that has SQLite file `path` open (-1 when its pid cannot be
    known), or None when none can be seen (see the module docstring for what cannot)."""
    path = Path(path)
    for file, (start, length) in ((Path(f"{path}-shm"), SHM_LOCKS), (path, (PENDING_BYTE, LOCK_BYTES))):
        pid = _lock_holder(file, start, length)
        if pid is not None:
            return pid
    return _descriptor_holder(path)


def describe_holder(pid: int) -> str:
    return f"pid {pid}" if pid > 0 else "pid unknown"


def open_elsewhere_while_locked(path: str | Path) -> int | None:
    """`open_elsewhere` for a caller that itself holds a SQLite connection with locks on
    `path`: the /proc descriptor scan only (None without /proc). Testing the locks opens
    and closes a descriptor on the file, and closing any descriptor of a file drops every
    POSIX lock this process holds on it, SQLite's own included."""
    return _descriptor_holder(Path(path))
