"""`manifest.json`: what a published checkpoint or rollout snapshot holds.

The manifest is written last, inside the temporary directory, just before the directory
is renamed into place; a directory without a valid manifest is therefore never a
checkpoint. It records the format version, the kind (``trainer_checkpoint`` or
``rollout_snapshot``), the anchor, the sequence number, the schema revision read from the
snapshot file's ``alembic_version``, created and cut times, the store's mutation counter
at the cut, row counts, the config fingerprint, and the size and sha256 of every file.

Paths in a manifest are relative, POSIX-style, and must stay inside the directory: an
absolute path, a ``..`` component, or anything that resolves outside (through a symlink)
is refused before a byte of it is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import StoreError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
KIND_TRAINER = "trainer_checkpoint"
KIND_SNAPSHOT = "rollout_snapshot"
KINDS = (KIND_TRAINER, KIND_SNAPSHOT)


class ManifestError(StoreError):
    """A manifest is missing, unreadable, malformed, or names a path it must not."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, POSIX separators
    size: int
    sha256: str


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
    mutation_counter: int | None = None
    row_counts: dict[str, int] = field(default_factory=dict)
    group_states: dict[str, int] = field(default_factory=dict)
    config_fingerprint: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        d = asdict(self)
        d["files"] = [asdict(f) for f in self.files]
        return (json.dumps(d, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_dict(cls, d: Any, where: str = "manifest") -> Manifest:
        """Validate structure and types; raises ManifestError naming the first fault."""
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: not a JSON object")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise ManifestError(
                f"{where}: format_version {version!r} is not {FORMAT_VERSION}; "
                "written by a different rolloutdb (upgrade rolloutdb if newer)"
            )
        if d.get("kind") not in KINDS:
            raise ManifestError(f"{where}: kind {d.get('kind')!r} is not one of {', '.join(KINDS)}")
        if not isinstance(d.get("anchor"), str) or not d["anchor"]:
            raise ManifestError(f"{where}: anchor missing")
        if d["kind"] == KIND_SNAPSHOT and not _is_int(d.get("sequence")):
            raise ManifestError(f"{where}: a rollout snapshot needs an integer sequence")
        raw_files = d.get("files")
        if not isinstance(raw_files, list):
            raise ManifestError(f"{where}: files must be a list")
        files = []
        for f in raw_files:
            if not (isinstance(f, dict) and isinstance(f.get("path"), str) and _is_int(f.get("size"))
                    and isinstance(f.get("sha256"), str) and len(f["sha256"]) == 64):
                raise ManifestError(f"{where}: malformed file entry {f!r}")
            check_member_name(f["path"], where)
            files.append(FileEntry(f["path"], f["size"], f["sha256"]))
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "files"}
        try:
            return cls(files=files, **known)
        except TypeError as e:
            raise ManifestError(f"{where}: {e}") from e


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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


def hash_file(path: str | Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        size = os.fstat(f.fileno()).st_size
    return size, digest


def describe_files(root: Path, *, skip_dirs: tuple[str, ...] = ()) -> list[FileEntry]:
    """Size and sha256 of every regular file under `root` (relative POSIX paths,
    sorted), except the manifest itself and the top-level folders in `skip_dirs`."""
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        for name in filenames:
            rel = (rel_dir / name).as_posix()
            if rel == MANIFEST_NAME or os.path.islink(os.path.join(dirpath, name)):
                continue
            size, digest = hash_file(os.path.join(dirpath, name))
            entries.append(FileEntry(rel, size, digest))
    return sorted(entries, key=lambda e: e.path)


def read_manifest(directory: str | Path) -> Manifest:
    """Load and validate `directory/manifest.json` (structure only; see `verify_files`)."""
    path = Path(directory) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest; the directory is not a finished checkpoint") from None
    except OSError as e:
        raise ManifestError(f"{path}: unreadable ({e.strerror})") from e
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"{path}: not valid JSON ({e})") from e
    return Manifest.from_dict(data, str(path))


def verify_files(directory: str | Path, manifest: Manifest, *, skip_dirs: tuple[str, ...] = ()) -> list[str]:
    """Check every file the manifest names against its size and sha256, and report
    files present but not named. Returns one line per problem (empty when sound)."""
    root = Path(directory)
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
        size, digest = hash_file(path)
        if size != entry.size:
            problems.append(f"{path}: size {size} bytes, manifest says {entry.size}")
        elif digest != entry.sha256:
            problems.append(f"{path}: sha256 differs from the manifest (the file was changed or damaged)")
    for entry in describe_files_names(root, skip_dirs):
        if entry not in named:
            problems.append(f"{root / entry}: not listed in the manifest")
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
