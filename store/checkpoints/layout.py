"""The checkpoint directory on disk, and listing what is in it.

    CHECKPOINT_DIR/
      bootstrap/                        anchor before the first train step
        manifest.json                   kind trainer_checkpoint
        rollout_snapshots/
          snapshot_<seq>/
            rollout_state.sqlite        the store as of the snapshot's cut
            env_export.json             an environment's export, written by versions before
                                        agent servers (exports now go into env_episodes)
            config.yaml                 the resolved config
            manifest.json               written last
      step_<N>/                         a trainer checkpoint (the trainer's files)
        manifest.json                   kind trainer_checkpoint (rollout_snapshots/ excluded)
        rollout_snapshots/snapshot_<seq>/...
      payload_segments/                 immutable sample payload the snapshots reference
        segment_<n>.sqlite              (checkpoints/segments.py; not a checkpoint: never listed here)

Sequence numbers count over the whole checkpoint directory, not per anchor, so the
newest snapshot is the one with the highest sequence. They are never handed out twice:
``CHECKPOINT_DIR/sequence_high_water`` holds the highest number ever published or
half-used (written by `rolloutdb.store.checkpoints.publish` before a number can disappear from the
listing), so deleting directories, by retention, a resume or a person, frees no number. Entries whose names start with a
dot and end in ``.tmp`` (being published) or ``.trash`` (being deleted) are leftovers,
never checkpoints. Listing only reads; it never creates or removes anything.
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import NotAStoreError
from ..fsio import leftover_kind, leftover_target_name
from .manifest import KIND_SNAPSHOT, KIND_TRAINER, MANIFEST_NAME, Manifest, ManifestError, read_manifest

BOOTSTRAP = "bootstrap"
SNAPSHOTS_DIR = "rollout_snapshots"
SNAPSHOT_DB = "rollout_state.sqlite"
ENV_EXPORT = "env_export.json"
CONFIG_FILE = "config.yaml"
HIGH_WATER = "sequence_high_water"
SEGMENTS_DIR = "payload_segments"  # the sealed payload the snapshots reference (checkpoints/segments.py)

_STEP = re.compile(r"^step_(\d+)$")
_SNAPSHOT = re.compile(r"^snapshot_(\d+)$")

# Statuses of a listed entry. Only COMPLETE entries are checkpoints.
COMPLETE = "complete"
TEMPORARY = "incomplete: being published (temporary)"
TRASH = "incomplete: being deleted"
NO_MANIFEST = "incomplete: no manifest"
BAD_MANIFEST = "incomplete: invalid manifest"


def anchor_name(step: int | None) -> str:
    """`bootstrap` for None (before the first train step), else `step_<N>`."""
    if step is None:
        return BOOTSTRAP
    if step < 0:
        raise ValueError(f"step {step}: train steps are >= 0")
    return f"step_{int(step)}"


def anchor_step(anchor: str) -> int | None:
    """Inverse of `anchor_name`; raises ValueError for anything else."""
    if anchor == BOOTSTRAP:
        return None
    m = _STEP.match(anchor)
    if not m:
        raise ValueError(f"{anchor!r} is not an anchor; anchors are 'bootstrap' or 'step_<N>'")
    return int(m.group(1))


def anchor_order(anchor: str) -> int:
    """Sort key: bootstrap before every step."""
    step = anchor_step(anchor)
    return -1 if step is None else step


def snapshot_name(sequence: int) -> str:
    return f"snapshot_{int(sequence)}"


def anchor_dir(checkpoint_dir: str | Path, anchor: str) -> Path:
    anchor_step(anchor)  # validates
    return Path(checkpoint_dir) / anchor


def snapshot_dir(checkpoint_dir: str | Path, anchor: str, sequence: int) -> Path:
    return anchor_dir(checkpoint_dir, anchor) / SNAPSHOTS_DIR / snapshot_name(sequence)


def segments_dir_of(checkpoint_dir: str | Path) -> Path:
    """CHECKPOINT_DIR/payload_segments/: where a run's payload segments live (the live
    store is given this directory to read them: `Store.segments_dir`)."""
    return Path(checkpoint_dir) / SEGMENTS_DIR


def segment_file_name(segment_id: int) -> str:
    return f"segment_{int(segment_id)}.sqlite"


@dataclass
class Entry:
    """One anchor (trainer checkpoint) or rollout snapshot found on disk."""

    kind: str  # KIND_TRAINER or KIND_SNAPSHOT
    anchor: str
    path: Path
    status: str
    sequence: int | None = None
    manifest: Manifest | None = None
    problem: str | None = None

    @property
    def complete(self) -> bool:
        return self.status == COMPLETE

    @property
    def leftover(self) -> bool:
        return self.status in (TEMPORARY, TRASH)

    @property
    def step(self) -> int | None:
        return anchor_step(self.anchor)

    def age_s(self, now: float | None = None) -> float | None:
        try:
            t = self.manifest.created_at if self.manifest else self.path.stat().st_mtime
        except OSError:
            return None
        return (now or time.time()) - t

    def size_bytes(self) -> int:
        if self.manifest is not None:
            return self.manifest.total_bytes
        total = 0
        for dirpath, dirnames, filenames in os.walk(self.path):
            if Path(dirpath) == self.path and self.kind == KIND_TRAINER:
                dirnames[:] = [d for d in dirnames if d != SNAPSHOTS_DIR]
            for n in filenames:
                try:
                    total += os.lstat(os.path.join(dirpath, n)).st_size
                except OSError:
                    pass
        return total


@dataclass
class Inventory:
    """Everything `scan` found, anchors sorted by step and snapshots by sequence."""

    root: Path
    anchors: list[Entry]
    snapshots: list[Entry]
    high_water: int = 0  # the recorded highest sequence (`HIGH_WATER`)

    @property
    def entries(self) -> list[Entry]:
        return self.anchors + self.snapshots

    def complete_anchors(self) -> list[Entry]:
        return [a for a in self.anchors if a.complete]

    def complete_snapshots(self) -> list[Entry]:
        return [s for s in self.snapshots if s.complete]

    def leftovers(self) -> list[Entry]:
        return [e for e in self.entries if e.leftover]

    def durable_anchor_names(self) -> set[str]:
        return {a.anchor for a in self.anchors if a.complete}

    def max_sequence(self) -> int:
        """Highest sequence ever used: seen anywhere, leftovers included (so a crashed
        attempt's number is not handed out again), or recorded in the high-water mark (so
        a deleted snapshot's is not either)."""
        return max([s.sequence for s in self.snapshots if s.sequence is not None] + [self.high_water])


def _load(path: Path, kind: str, anchor: str, sequence: int | None) -> tuple[str, Manifest | None, str | None]:
    try:
        os.stat(path / MANIFEST_NAME)
    except (FileNotFoundError, NotADirectoryError):
        return NO_MANIFEST, None, f"{path}: no {MANIFEST_NAME}"
    except OSError as e:  # an unreadable directory: not a checkpoint we can vouch for
        return BAD_MANIFEST, None, f"{path}: cannot read it ({e.strerror}); fix its permissions"
    try:
        m = read_manifest(path)
    except ManifestError as e:
        return BAD_MANIFEST, None, str(e)
    if m.kind != kind or m.anchor != anchor or (kind == KIND_SNAPSHOT and m.sequence != sequence):
        return BAD_MANIFEST, m, (
            f"{path}: manifest says {m.kind} {m.anchor} seq {m.sequence}, "
            f"the directory is {kind} {anchor} seq {sequence}"
        )
    return COMPLETE, m, None


def _list_dir(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return [e for e in it if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    except PermissionError as e:
        # An unreadable directory must not look empty: that would hide its checkpoints.
        raise NotAStoreError(f"{path}: cannot list it ({e.strerror}); fix its permissions") from None


def _scan_snapshots(anchor: str, anchor_path: Path, leftover: str | None) -> list[Entry]:
    found = []
    for d in _list_dir(anchor_path / SNAPSHOTS_DIR):
        kind = leftover_kind(d.name)
        name = leftover_target_name(d.name) if kind else d.name
        m = _SNAPSHOT.match(name)
        if not m:
            continue
        seq = int(m.group(1))
        path = Path(d.path)
        if leftover or kind:
            status = TRASH if "trash" in (leftover, kind) else TEMPORARY
            found.append(Entry(KIND_SNAPSHOT, anchor, path, status, seq))
        else:
            status, manifest, problem = _load(path, KIND_SNAPSHOT, anchor, seq)
            found.append(Entry(KIND_SNAPSHOT, anchor, path, status, seq, manifest, problem))
    return found


def scan(checkpoint_dir: str | Path) -> Inventory:
    """List anchors and snapshots, complete or not (see `Entry.status`)."""
    root = Path(checkpoint_dir)
    anchors, snapshots = [], []
    for d in _list_dir(root):
        kind = leftover_kind(d.name)
        name = leftover_target_name(d.name) if kind else d.name
        if name != BOOTSTRAP and not _STEP.match(name):
            continue
        path = Path(d.path)
        if kind:
            entry = Entry(KIND_TRAINER, name, path, TRASH if kind == "trash" else TEMPORARY)
        else:
            status, manifest, problem = _load(path, KIND_TRAINER, name, None)
            entry = Entry(KIND_TRAINER, name, path, status, None, manifest, problem)
        anchors.append(entry)
        snapshots += _scan_snapshots(name, path, kind)
    anchors.sort(key=lambda e: (anchor_order(e.anchor), not e.complete, e.path.name))
    snapshots.sort(key=lambda e: (e.sequence, not e.complete, e.path.name))
    return Inventory(root, anchors, snapshots, read_high_water(root))


def read_high_water(checkpoint_dir: str | Path) -> int:
    """The recorded highest sequence, 0 when there is no mark. A mark that is not a
    number (damaged by hand) counts as 0: the listing still bounds the next number, and
    the next publication writes a good mark."""
    try:  # O_NONBLOCK: a FIFO planted under the name must not hang the listing
        fd = os.open(Path(checkpoint_dir) / HIGH_WATER, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return 0
    try:
        text = os.read(fd, 32).strip() if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        text = b""
    finally:
        os.close(fd)
    return int(text) if text.isdigit() and len(text) < 20 else 0
