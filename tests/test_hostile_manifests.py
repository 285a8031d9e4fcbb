"""Hostile input, forged manifests: every field given every wrong JSON type, each
required field missing, path escapes, huge, deeply nested, unknown kind. `verify`
refuses each; `snapshots` lists it as incomplete; `inspect` of the file beside it
still works. Helpers: tests/hostile.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from hostile import assert_refused, run_cli, unchanged, world  # noqa: F401 - world is a fixture

# ----------------------------------------------------------------------------- class 3: forged manifests

# The JSON type each manifest field has, as the format documents it (store/checkpoints/manifest.py's
# docstring): written here independently of the code that checks it.
MANIFEST_TYPES = {
    "format_version": {int}, "kind": {str}, "anchor": {str}, "files": {list}, "sequence": {int},
    "step": {int, type(None)}, "schema_revision": {str, type(None)}, "created_at": {int, float},
    "cut_time": {int, float, type(None)}, "mutation_counter": {int, type(None)}, "row_counts": {dict},
    "group_states": {dict}, "config_fingerprint": {str, type(None)}, "timings": {dict}, "hash": {str},
}
WRONG_VALUES = ["text", 1.5, True, None, [], {"a": "b"}, -7, 10**30]


def _forged_field_cases():
    for key, types in MANIFEST_TYPES.items():
        for value in WRONG_VALUES:
            ok = type(value) in types or (float in types and type(value) is int and not isinstance(value, bool))
            if key in ("sequence",) and value == -7:
                ok = False
            if key in ("created_at", "cut_time") and value == 10**30:
                ok = True  # a number of seconds, far ahead: not a type error
            if not ok:
                yield pytest.param(key, value, id=f"{key}={json.dumps(value)}")


def _write_manifest(snapshot: Path, doc_or_text) -> Path:
    m = snapshot / "manifest.json"
    m.write_text(doc_or_text if isinstance(doc_or_text, str) else json.dumps(doc_or_text))
    return m


@pytest.fixture
def snapshot(world, tmp_path) -> Path:
    ckpt = Path(shutil.copytree(world["ckpt"], tmp_path / "ckpt", symlinks=True))
    return ckpt / "bootstrap" / "rollout_snapshots" / "snapshot_1"


def _check_manifest_refused(snapshot: Path, fragment: str | None = None, *, structural: bool = True) -> None:
    """verify refuses it; `snapshots` lists it as incomplete when the manifest itself is
    malformed (`structural`; a manifest naming a file it cannot have is found by verify,
    as a checksum mismatch is); inspect of the file beside it still works."""
    ckpt = snapshot.parents[2]
    with unchanged(ckpt.parent):
        line = assert_refused(run_cli("verify", snapshot), {1})
        if fragment:
            assert fragment in line, line
        assert_refused(run_cli("verify", ckpt), {1})
        listed = run_cli("snapshots", ckpt, "--json")  # lists, never judges: exit 0
        assert listed.code == 0 and listed.err == "", listed.err
        row = next(r for r in json.loads(listed.out) if r["path"] == str(snapshot))
        assert row["complete"] is not structural
        shown = run_cli("inspect", snapshot / "rollout_state.sqlite")  # inspect notes, never fails on it
        assert shown.code == 0 and shown.err == "", shown.err


@pytest.mark.parametrize("key,value", list(_forged_field_cases()))
def test_a_manifest_field_of_a_wrong_type_is_refused_naming_the_field(snapshot, key, value):
    doc = json.loads((snapshot / "manifest.json").read_text())
    doc[key] = value
    _write_manifest(snapshot, doc)
    _check_manifest_refused(snapshot, key if key not in ("format_version", "kind", "anchor", "files") else None)


@pytest.mark.parametrize("key", ["format_version", "kind", "anchor", "files", "sequence"])
def test_a_manifest_missing_a_required_field_is_refused(snapshot, key):
    doc = json.loads((snapshot / "manifest.json").read_text())
    del doc[key]
    _write_manifest(snapshot, doc)
    _check_manifest_refused(snapshot)


def _escape_dotdot(snapshot: Path, doc: dict) -> None:
    (snapshot.parent / "outside").write_bytes(b"x")
    doc["files"][0]["path"] = "../outside"


def _escape_absolute(snapshot: Path, doc: dict) -> None:
    doc["files"][0]["path"] = "/etc/hostname"


def _escape_nested_dotdot(snapshot: Path, doc: dict) -> None:
    doc["files"][0]["path"] = "a/../../outside"


def _escape_symlink(snapshot: Path, doc: dict) -> None:
    os.symlink("/etc/hostname", snapshot / "link")
    doc["files"][0]["path"] = "link"


FORGED_MANIFESTS = {
    "unknown kind": lambda s, d: d.update(kind="model_checkpoint"),
    "path ../": _escape_dotdot,
    "absolute path": _escape_absolute,
    "a/../../ path": _escape_nested_dotdot,
    "symlink out": _escape_symlink,
    "files not a list": lambda s, d: d.update(files={"a": 1}),
    "file entry not an object": lambda s, d: d.update(files=["x"]),
    "file size negative": lambda s, d: d["files"][0].update(size=-1),
    "file blake3 short": lambda s, d: d["files"][0].update(blake3="ab"),
    "file blake3 not hex": lambda s, d: d["files"][0].update(blake3="g" * 64),
    "file blake3 upper-case hex": lambda s, d: d["files"][0].update(blake3=d["files"][0]["blake3"].upper()),
    "file entry without its blake3": lambda s, d: d["files"][0].pop("blake3"),
    "a string of 4 MB": lambda s, d: d.update(kind="a" * (4 << 20)),
    "anchor not the directory's": lambda s, d: d.update(anchor="step_9"),
    "sequence not the directory's": lambda s, d: d.update(sequence=9),
    "an integer of 5000 digits": None,
    "nested 100000 deep": None,
    "nested 50 deep": None,
    "over 64 MiB (sparse)": None,
    "not an object": None,
    "not UTF-8": None,
    "empty": None,
}


@pytest.mark.parametrize("name", list(FORGED_MANIFESTS))
def test_a_forged_manifest_is_refused_in_one_line(snapshot, name):
    m = snapshot / "manifest.json"
    doc = json.loads(m.read_text())
    text = None
    if FORGED_MANIFESTS[name] is not None:
        FORGED_MANIFESTS[name](snapshot, doc)
    elif name == "an integer of 5000 digits":
        text = json.dumps(doc).replace('"format_version": 2', '"format_version": ' + "9" * 5000)
    elif name.startswith("nested"):
        depth = int(name.split()[1])
        doc["timings"] = "DEEP"
        text = json.dumps(doc).replace('"DEEP"', "[" * depth + "]" * depth)
    elif name.startswith("over 64 MiB"):
        with open(m, "r+b") as f:
            f.truncate(65 << 20)
    elif name == "not an object":
        text = "[1, 2, 3]"
    elif name == "not UTF-8":
        m.write_bytes(b"\xff\xfe{")
    elif name == "empty":
        text = ""
    if text is not None:
        m.write_text(text)
    elif name not in ("over 64 MiB (sparse)", "not UTF-8"):
        _write_manifest(snapshot, doc)
    _check_manifest_refused(snapshot, structural=name != "symlink out")


# ----------------------------------------------------------------------------- format 2 vs format 1 fields

def _as_sha256_entries(doc: dict) -> None:
    for f in doc["files"]:
        f["sha256"] = "0" * 64
        del f["blake3"]


def _as_format_1_with_blake3(doc: dict) -> None:
    doc["format_version"] = 1
    del doc["hash"]


# name -> (forgery, a fragment the one line names)
HASH_FORGERIES = {
    "format 2 with sha256 entries": (_as_sha256_entries, "needs blake3"),
    "format 2 with both digests": (lambda d: d["files"][0].update(sha256="0" * 64), "not sha256"),
    "format 2 claiming sha256": (lambda d: d.update(hash="sha256"), "supported: blake3"),
    "format 2 naming no hash": (lambda d: d.pop("hash"), "names no hash"),
    "an unknown hash": (lambda d: d.update(hash="md5"), "hash \"md5\" is not supported"),
    "format 1 with blake3 entries": (_as_format_1_with_blake3, "needs sha256"),
    "format 1 claiming blake3": (lambda d: d.update(format_version=1), "supported: sha256"),
    "format 3": (lambda d: d.update(format_version=3), "format_version 3 is not one of 1, 2"),
}


@pytest.mark.parametrize("name", list(HASH_FORGERIES))
def test_a_manifest_whose_hash_does_not_match_its_format_is_refused_in_one_line(snapshot, name):
    doc = json.loads((snapshot / "manifest.json").read_text())
    assert doc["format_version"] == 2 and doc["hash"] == "blake3"  # what publication writes today
    forge, fragment = HASH_FORGERIES[name]
    forge(doc)
    _write_manifest(snapshot, doc)
    _check_manifest_refused(snapshot, fragment)
