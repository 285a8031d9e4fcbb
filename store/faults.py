"""Named fault points, so tests can kill or fail publication at every step.

Publication and retention call `point(name)` between their steps and `io(op, path)`
right before each mkdir, write, fsync and rename. Both do nothing unless a fault is armed:
the check is one module-global boolean, so production pays nothing.

Two kinds of fault:

* **Kill**: ``ROLLOUTDB_FAULT=<point>`` (or ``<point>@<n>`` for the n-th time the point
  is reached, counting from 1) makes the process SIGKILL itself there, as a power cut or
  an OOM kill would. Several, comma separated, are allowed. Read once at import;
  `arm_from_env()` re-reads it.
* **I/O error**: `inject_io(op, errno)` (a context manager) makes the next matching
  write / fsync / rename raise ``OSError(errno)``, in-process, as a full or failing
  disk would.

Every kill point is registered by the module that owns it (`register(...)` at import):
the store's own are `POINTS` (publication and retention) and `UPGRADE_POINTS` below;
the controller registers its own (rolloutdb.controller.fault_points). Tests iterate over
the registered tuples, so a point added to the code must be registered too (a test
checks both ways). Arming at import accepts a name no module has registered yet (its
owner may be imported later); `check_armed()` refuses one once every owner is loaded,
and `arm_from_env()` called later refuses it at once.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

ENV = "ROLLOUTDB_FAULT"

_registered: dict[str, None] = {}  # every kill point, in registration order


def register(*names: str) -> tuple[str, ...]:
    """Make `names` known kill points (their owner calls `point(name)` there); returns
    them, so the owner can keep the tuple: ``POINTS = faults.register("a.b", ...)``."""
    for name in names:
        stage, dot, step = name.partition(".")
        if not (stage and dot and step):
            raise ValueError(f"fault point {name!r}: name it <stage>.<step>")
        _registered.setdefault(name, None)
    return names


# Every kill point of publication and retention, in the order one save reaches them.
POINTS: tuple[str, ...] = register(
    # leftovers of an earlier crash are removed at the start of every save
    "cleanup.after_trash_rename",
    "cleanup.after_rmtree",
    # the commit protocol (trainer checkpoints, bootstrap and rollout snapshots)
    "publish.tmpdir_created",
    "publish.payload_written",  # capture / trainer files / config / env export
    "publish.files_fsynced",
    "publish.manifest_written",
    "publish.tmpdir_fsynced",
    "publish.renamed",
    "publish.parent_fsynced",
    # retention: rename to a trash name, then rmtree
    "retention.planned",
    "retention.after_trash_rename",
    "retention.mid_rmtree",
    "retention.after_rmtree",
)

# Kill points of sealing payload into a segment and of removing one
# (store/checkpoints/segments.py), in the order a save reaches them.
SEGMENT_POINTS: tuple[str, ...] = register(
    "segment.built",  # the segment written at its temporary name, not yet durable
    "segment.durable",  # renamed into place, directory fsynced; no sample references it yet
    "segment.referenced",  # the transaction pointing the samples at it committed
    "segment.trashed",  # retention: renamed to a trash name, not yet unlinked
    "segment.removed",
)

# Kill point of a settle's fold (store/live/compaction.py `fold_settled`): the folded rows
# deleted, the prefix's counts not yet written, all in the settle's open transaction.
FOLD_POINTS: tuple[str, ...] = register("settle.rows_folded")

# Kill points of `rolloutdb upgrade` (store.revision.upgrade_file), between its steps.
UPGRADE_POINTS: tuple[str, ...] = register("upgrade.copied", "upgrade.migrated")

IO_OPS = ("mkdir", "write", "fsync", "rename")

_armed = False
_kill_at: dict[str, int] = {}
_hits: dict[str, int] = {}
_io: list[_IoFault] = []
_lock = threading.Lock()


@dataclass
class _IoFault:
    op: str
    errno: int
    times: int
    skip: int
    match: str | None
    fired: int = 0


def registered() -> tuple[str, ...]:
    """Every kill point registered so far, in registration order."""
    return tuple(_registered)


def arm_from_env(*, strict: bool = True) -> None:
    """(Re)read ``ROLLOUTDB_FAULT``; refuse a point nobody registered unless `strict`
    is off (at import, when the point's owner may not be loaded yet)."""
    global _armed
    _kill_at.clear()
    _hits.clear()
    spec = os.environ.get(ENV, "").strip()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, nth = item.partition("@")
        _kill_at[name] = int(nth) if nth else 1
    _armed = bool(_kill_at or _io)
    if strict:
        check_armed()


def check_armed() -> None:
    """Refuse an armed point that no module registered (a typo would never fire)."""
    unknown = [name for name in _kill_at if name not in _registered]
    if unknown:
        spec = os.environ.get(ENV, "")
        raise ValueError(f"{ENV}={spec!r}: unknown fault point {unknown[0]!r}; known: {', '.join(_registered)}")


def point(name: str) -> None:
    """A named step boundary. SIGKILLs the process when armed for this point."""
    if not _armed:
        return
    _point_armed(name)


def _point_armed(name: str) -> None:
    assert name in _registered, name
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        due = _kill_at.get(name) == _hits[name]
    if due:
        os.kill(os.getpid(), signal.SIGKILL)


def io(op: str, path: object = None) -> None:
    """Called right before a mkdir, write, fsync or rename; raises an injected OSError."""
    if not _armed:
        return
    _io_armed(op, path)


def _io_armed(op: str, path: object) -> None:
    with _lock:
        for f in _io:
            if f.op != op or (f.match is not None and f.match not in str(path)):
                continue
            if f.skip:
                f.skip -= 1
                continue
            if f.fired < f.times:
                f.fired += 1
                raise OSError(f.errno, f"{os.strerror(f.errno)} (injected at {op})", str(path) if path else None)


@contextlib.contextmanager
def inject_io(op: str, err: int = errno_mod.EIO, *, times: int = 1, skip: int = 0, match: str | None = None) -> Iterator[_IoFault]:
    """Make the next `times` matching `op` calls (after `skip` of them) raise
    ``OSError(err)``. `match` restricts it to paths containing that text."""
    global _armed
    if op not in IO_OPS:
        raise ValueError(f"unknown I/O op {op!r}; known: {', '.join(IO_OPS)}")
    fault = _IoFault(op, err, times, skip, match)
    with _lock:
        _io.append(fault)
        _armed = True
    try:
        yield fault
    finally:
        with _lock:
            _io.remove(fault)
            _armed = bool(_kill_at or _io)


arm_from_env(strict=False)
