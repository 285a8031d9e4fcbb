"""`manifest.json`: what a published checkpoint or rollout snapshot holds.

The manifest is written last, inside the temporary directory, just before the directory
is renamed into place; a directory without a valid manifest is therefore never a
checkpoint. It records the format version, the kind (``trainer_checkpoint`` or
``rollout_snapshot``), the anchor, the sequence number, the schema revision read from the
snapshot file's ``alembic_version``, created and cut times, the store's mutation counter
at the cut, row counts, the config fingerprint, and the size and checksum of every file.

Format 2 (what publication writes) names its hash, ``"hash": "blake3"``, and each file entry is
``{"path", "size", "blake3"}`` (64 hex digits). Format 1 (older rolloutdb) has no
``hash`` field and each entry carries ``sha256``; it stays readable and verifiable.
Which hash checks a manifest is decided in one place, `hashing.hashing_for`.

A rollout snapshot's manifest (since v1_6_a) also lists under ``segments`` the payload
segments its store file references, entries of the same shape named by file name in
``CHECKPOINT_DIR/payload_segments/`` (checkpoints/segments.py), with the checksum taken
when each was sealed; verify and restore hash each one. No ``segments``: nothing
referenced (a snapshot from before v1_6_a, payload inline).

Paths in a manifest are relative, POSIX-style, and must stay inside the directory: an
absolute path, a ``..`` component, or anything that resolves outside (through a symlink)
is refused before a byte of it is read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import StoreError
from ..fsio import refuse_special_file
from ..sqlite.readonly import MANIFEST_NAME  # defined with the readers that must recognise it
from .hashing import BLAKE3, DEFAULT_HASH, WRITE_FORMAT, Hashing, HashingError, hashing_for

FORMAT_VERSION = WRITE_FORMAT
KIND_TRAINER = "trainer_checkpoint"
KIND_SNAPSHOT = "rollout_snapshot"
KINDS = (KIND_TRAINER, KIND_SNAPSHOT)
# A manifest is a few levels deep (object -> files -> entry) and small (a trainer
# checkpoint of 100k files is ~15 MB); anything beyond is forged or damaged, and is
# refused before it can exhaust the stack or the memory.
MAX_DEPTH = 8
MAX_BYTES = 64 << 20


class ManifestError(StoreError):
    """A manifest is missing, unreadable, malformed, or names a path it must not."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, POSIX separators
    size: int
    digest: str  # hex, of the manifest's hash (`Manifest.hashing`)


@dataclass
class Manifest:
    kind: str
    anchor: str
    files: list[FileEntry]
    sequence: int | None = None  # rollout snapshots
    step: int | None = None  # trainer checkpoints; None for bootstrap
    schema_revision: str | None = None
    created_at: float = field(default_factory=time.time)
    cut_time: float | None = None
    # Prefix level: when the running calls it saved were read (the cut's decode point; a
    # call decoded past it is not the snapshot's to keep). Absent in older manifests.
    decoded_at: float | None = None
    mutation_counter: int | None = None
    row_counts: dict[str, int] = field(default_factory=dict)
    group_states: dict[str, int] = field(default_factory=dict)
    config_fingerprint: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    hash: str | None = None  # None: the format's own (format 1 has only sha256)
    # Rollout snapshots since v1_6_a: the payload segments its store file references
    # (file names under CHECKPOINT_DIR/payload_segments/), same entry shape as `files`.
    # Absent (empty) in older manifests: their payload is inline in the store file.
    segments: list[FileEntry] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.hash is None and self.format_version in DEFAULT_HASH:
            self.hash = DEFAULT_HASH[self.format_version]

    @property
    def hashing(self) -> Hashing:
        """The hash every file entry's digest is of (raises ManifestError if unknown)."""
        try:
            return hashing_for(self.format_version, self.hash)
        except HashingError as e:
            raise ManifestError(str(e)) from None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        name = self.hashing.name
        d = asdict(self)
        d["files"] = [{"path": f.path, "size": f.size, name: f.digest} for f in self.files]
        d["segments"] = [{"path": f.path, "size": f.size, name: f.digest} for f in self.segments]
        if not self.segments:
            del d["segments"]  # as before v1_6_a: nothing referenced, nothing listed
        if self.format_version == 1:
            del d["hash"]  # as rolloutdb wrote format 1: the hash is implied
        return (json.dumps(d, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_dict(cls, d: Any, where: str = "manifest") -> Manifest:
        """Validate structure and types; raises ManifestError naming the first fault."""
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: not a JSON object")
        try:
            hashing = hashing_for(d.get("format_version"), d.get("hash"), where)
        except HashingError as e:
            raise ManifestError(str(e)) from None
        name = hashing.name
        if d.get("kind") not in KINDS:
            raise ManifestError(f"{where}: kind {_show(d.get('kind'))} is not one of {', '.join(KINDS)}")
        if not isinstance(d.get("anchor"), str) or not d["anchor"]:
            raise ManifestError(f"{where}: anchor missing")
        if d["kind"] == KIND_SNAPSHOT and not _is_int(d.get("sequence")):
            raise ManifestError(f"{where}: a rollout snapshot needs an integer sequence")
        raw_files = d.get("files")
        if not isinstance(raw_files, list):
            raise ManifestError(f"{where}: files must be a list")
        files = []
        for f in raw_files:
            files.append(_entry(f, name, d["format_version"], where))
        raw_segments = d.get("segments", [])
        if not isinstance(raw_segments, list):
            raise ManifestError(f"{where}: segments must be a list")
        segments = []
        for f in raw_segments:
            entry = _entry(f, name, d["format_version"], where)
            if "/" in entry.path:
                raise ManifestError(f"{where}: segment {_show(entry.path)} must be a file name in payload_segments/")
            segments.append(entry)
        for key, (check, what) in _FIELD_TYPES.items():
            if key in d and not check(d[key]):
                raise ManifestError(f"{where}: field {key} is {_show(d[key])}, expected {what}")
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k not in ("files", "segments")}
        try:
            return cls(files=files, segments=segments, **known)
        except TypeError as e:
            raise ManifestError(f"{where}: {e}") from e


def _entry(f: Any, name: str, format_version: int, where: str) -> FileEntry:
    if not (isinstance(f, dict) and isinstance(f.get("path"), str) and _is_int(f.get("size")) and f["size"] >= 0):
        raise ManifestError(f"{where}: malformed file entry {_show(f)}")
    others = sorted(k for k in f if k not in ("path", "size", name))
    if others or not _is_hex64(f.get(name)):
        raise ManifestError(f"{where}: file entry {_show(f['path'])} needs {name} (64 hex digits) and nothing else: "
                            f"format_version {format_version} lists each file's {name}"
                            + (f", not {', '.join(others)}" if others else ""))
    check_member_name(f["path"], where)
    return FileEntry(f["path"], f["size"], f[name])


def _is_hex64(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _optional(check):
    return lambda v: v is None or check(v)


def _mapping_of(check):
    return lambda v: isinstance(v, dict) and all(isinstance(k, str) and check(x) for k, x in v.items())


# The type of every optional field (kind, anchor, sequence and files are checked above),
# so a forged value is refused here, naming its field, and not where it is first used.
_FIELD_TYPES = {
    "sequence": (_optional(lambda v: _is_int(v) and v >= 0), "a non-negative integer or null"),
    "step": (_optional(lambda v: _is_int(v) and v >= 0), "a non-negative integer or null"),
    "schema_revision": (_optional(lambda v: isinstance(v, str)), "a string or null"),
    "created_at": (_is_number, "a finite number of seconds"),
    "cut_time": (_optional(_is_number), "a finite number of seconds or null"),
    "decoded_at": (_optional(_is_number), "a finite number of seconds or null"),
    "mutation_counter": (_optional(_is_int), "an integer or null"),
    "row_counts": (_mapping_of(_is_int), "an object of integers"),
    "group_states": (_mapping_of(_is_int), "an object of integers"),
    "config_fingerprint": (_optional(lambda v: isinstance(v, str)), "a string or null"),
    "timings": (_mapping_of(_is_number), "an object of numbers"),
}


def _show(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, float) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


_TOO_DEEP = object()


def _depth_exceeds(data: Any, limit: int) -> bool:
    """Whether a JSON value nests deeper than `limit` (iterative: never recurses)."""
    stack = [(data, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                return True
            stack += [(x, depth + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return False


def check_member_name(name: str, where: str = "manifest") -> PurePosixPath:
    """Refuse a manifest path that is absolute, has a `..` component or is empty."""
    p = PurePosixPath(name)
    if not name or name.startswith("/") or "\\" in name or p.is_absolute() or (len(name) > 1 and name[1] == ":"):
        raise ManifestError(f"{where}: refuses absolute path {name!r}; manifests name files relative to their directory")
    if any(part in ("..", ".", "") for part in name.split("/")):
        raise ManifestError(f"{where}: refuses path {name!r} with a '..' or empty component")
    return p


def member_path(root: Path, name: str, where: str = "manifest") -> Path:
    """The file `name` inside `root`, refusing anything that resolves outside it."""
    check_member_name(name, where)
    path = root / name
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise ManifestError(f"{where}: refuses {name!r}: it resolves outside {root}")
    return path


def member_paths(root: Path, entries: Iterable[FileEntry], where: str = "manifest") -> list[tuple[FileEntry, Path | ManifestError]]:
    """`member_path` of every entry, in order: the path, or the ManifestError refusing it
    (returned, so the caller refuses in the order it checks its files)."""
    out: list[tuple[FileEntry, Path | ManifestError]] = []
    for entry in entries:
        try:
            out.append((entry, member_path(root, entry.path, where)))
        except ManifestError as e:
            out.append((entry, e))
    return out


def describe_files(root: Path, *, skip_dirs: tuple[str, ...] = (), hashing: Hashing = BLAKE3) -> list[FileEntry]:
    """Size and digest (`hashing`: the format written today) of every regular file
    under `root` (relative POSIX paths, sorted), except the manifest itself and the
    top-level folders in `skip_dirs`."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            if rel == MANIFEST_NAME or os.path.islink(os.path.join(dirpath, name)):
                continue
            size, digest = hashing.file(os.path.join(dirpath, name))
            entries.append(FileEntry(rel, size, digest))
    return sorted(entries, key=lambda e: e.path)


def read_manifest(directory: str | Path) -> Manifest:
    """Load and validate `directory/manifest.json` (structure only; see `verify_files`)."""
    path = Path(directory) / MANIFEST_NAME
    refuse_special_file(path, ManifestError)  # a FIFO named manifest.json would block the read
    try:
        if path.stat().st_size > MAX_BYTES:
            raise ManifestError(f"{path}: {path.stat().st_size} bytes, more than a manifest can be ({MAX_BYTES})")
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest; the directory is not a finished checkpoint") from None
    except OSError as e:
        raise ManifestError(f"{path}: unreadable ({e.strerror})") from e
    try:
        data = json.loads(raw)
    except RecursionError:
        data = _TOO_DEEP
    except ValueError as e:  # also UnicodeDecodeError, and an integer of > 4300 digits
        raise ManifestError(f"{path}: not valid JSON ({' '.join(str(e).split())[:200]})") from e
    if data is _TOO_DEEP or _depth_exceeds(data, MAX_DEPTH):
        raise ManifestError(f"{path}: nested deeper than {MAX_DEPTH} levels; not a manifest rolloutdb wrote")
    return Manifest.from_dict(data, str(path))


def verify_files(directory: str | Path, manifest: Manifest, *, skip_dirs: tuple[str, ...] = ()) -> list[str]:
    """Check every file the manifest names against its size and checksum (the hash
    its format names), and report files present but not named. Returns one line per
    problem (empty when sound)."""
    root = Path(directory)
    hashing = manifest.hashing
    problems = []
    named = set()
    for entry in manifest.files:
        try:
            path = member_path(root, entry.path, f"{root / MANIFEST_NAME}")
        except ManifestError as e:
            problems.append(str(e))
            continue
        named.add(entry.path)
        if not path.is_file():
            problems.append(f"{path}: missing (the manifest lists it)")
            continue
        size, digest = hashing.file(path)
        if size != entry.size:
            problems.append(f"{path}: size {size} bytes, manifest says {entry.size}")
        elif digest != entry.digest:
            problems.append(f"{path}: {hashing.name} differs from the manifest (the file was changed or damaged)")
    for name in describe_files_names(root, skip_dirs):
        if name not in named:
            problems.append(f"{root / name}: not listed in the manifest")
    return problems


def describe_files_names(root: Path, skip_dirs: tuple[str, ...] = ()) -> list[str]:
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        names += [(rel_dir / n).as_posix() for n in filenames if (rel_dir / n).as_posix() != MANIFEST_NAME]
    return sorted(names)


def config_fingerprint(config: bytes | str | None) -> str | None:
    if config is None:
        return None
    data = config.encode() if isinstance(config, str) else config
    return hashlib.sha256(data).hexdigest()
