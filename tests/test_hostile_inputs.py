"""The hostile-input suite: inputs GENERATED per class and fed to every command.
Helpers and what each case asserts: tests/hostile.py. Other classes:
test_hostile_manifests.py (forged manifests), test_hostile_configs.py (configs at their
limits). Concurrent processes are covered with the run lock.

Here: special files (FIFO, socket, directory, symlink loop, /dev/null, empty file) and
odd names (newline, non-UTF-8, over NAME_MAX, a path through a file) as every PATH
argument of every command; damaged and forged store files (truncated, bit-flipped over
the file's structure, zero-filled, a SQLite file that is not a store, forged
alembic_version rows, emptied singletons); unreadable files and directories.

The CLI runs in-process for speed; the signal and hang cases that need a real process
live in test_cli_inspect.py and test_cli_snapshots_verify.py. Cases that fail on a
defect another branch fixes are xfail(strict=True) with the item of issue W2-R named.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sqlite3
import tempfile
from pathlib import Path

import pytest

from hostile import (  # noqa: F401 - world is a fixture
    Result, assert_refused, run_cli, unchanged, world,
)

# ----------------------------------------------------------------------------- class 1: special files

def _make_socket(path: Path) -> None:
    # AF_UNIX paths are limited to ~108 bytes: bind in a short directory, then move it.
    short = Path(tempfile.mkdtemp(prefix="s", dir="/tmp"))
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(short / "s"))
        os.rename(short / "s", path)
    finally:
        shutil.rmtree(short, ignore_errors=True)


SPECIALS = {
    "fifo": lambda p: os.mkfifo(p),
    "socket": _make_socket,
    "dir": lambda p: p.mkdir(),
    "symlink_loop": lambda p: os.symlink(p.name, p),
    "dev_null": None,  # /dev/null itself
    "empty": lambda p: p.write_bytes(b""),
}

# Every PATH argument of every command: (argv with P for the path, whether P names a
# directory (then a directory is valid input and is not tried), acceptable exit codes).
PATH_ARGS = {
    "inspect": (["inspect", "P"], False, {2}),
    "inspect --sql": (["inspect", "P", "--sql", "SELECT 1"], False, {2}),
    "verify": (["verify", "P"], False, {1, 2}),  # 1: PATH is a file with a problem
    "upgrade": (["upgrade", "P"], False, {2}),
    "snapshots": (["snapshots", "P"], True, {2}),
    "trace RUN_DIR": (["trace", "P"], True, {2}),
    "trace --baseline": (["trace", "{traced}", "--baseline", "P"], True, {2}),
    "trace --out": (["trace", "{traced}", "--out", "P"], True, {2}),
    "train --config": (["train", "--config", "P", "--run-dir", "{fresh}"], False, {2}),
    "train --run-dir": (["train", "--config", "{config}", "--run-dir", "P"], True, {2}),
    "train --resume": (["train", "--config", "{config}", "--run-dir", "{fresh}", "--resume", "P"], True, {2}),
}


def _special_cases():
    for command in PATH_ARGS:
        for kind in SPECIALS:
            yield pytest.param(command, kind, id=f"{command}-{kind}")


@pytest.mark.parametrize("command,kind", list(_special_cases()))
def test_a_special_file_as_a_path_argument_is_refused_in_one_line(world, tmp_path, command, kind):
    template, is_dir_arg, codes = PATH_ARGS[command]
    if kind == "dir" and is_dir_arg:
        pytest.skip("a directory is what this argument takes")
    if kind == "empty" and command == "train --config":
        pytest.skip("an empty config file is the all-defaults config")
    if kind == "dev_null":
        target = Path("/dev/null")
    else:
        target = tmp_path / "target.sqlite"
        SPECIALS[kind](target)
    subst = {"P": str(target), "{traced}": str(world["traced"]), "{config}": str(world["config"]),
             "{fresh}": str(tmp_path / "fresh_run")}
    argv = [subst.get(a, a) for a in template]
    with unchanged(tmp_path), unchanged(world["base"]):
        r = run_cli(*argv)
    assert_refused(r, codes)
    assert not (tmp_path / "fresh_run").exists()


# ----------------------------------------------------------------------------- odd names, wrong types, run directories

ODD_NAMES = {
    "a newline in the name": "a\nb.sqlite",
    "a carriage return and a tab": "a\r\tb.sqlite",
    "bytes that are not UTF-8": os.fsdecode(b"\xff\xfe.sqlite"),
    "a name longer than NAME_MAX": "n" * 300 + ".sqlite",
    "a path through a file": "a_file/inside.sqlite",
}


def _odd_name_cases():
    for command in PATH_ARGS:
        for name in ODD_NAMES:
            yield pytest.param(command, name, id=f"{command}-{name}")


@pytest.mark.parametrize("command,name", list(_odd_name_cases()))
def test_a_missing_path_with_an_odd_name_is_refused_in_one_line(world, tmp_path, command, name):
    template, _is_dir_arg, codes = PATH_ARGS[command]
    (tmp_path / "a_file").write_bytes(b"x")
    target = str(tmp_path / ODD_NAMES[name])
    subst = {"P": target, "{traced}": str(world["traced"]), "{config}": str(world["config"]),
             "{fresh}": str(tmp_path / "fresh_run")}
    if command == "train --run-dir" and name != "a path through a file":
        pytest.skip("a missing run directory is created: that is how a run starts")
    if command == "trace --out" and name != "a path through a file":
        pytest.skip("a missing --out directory is created")
    with unchanged(tmp_path), unchanged(world["base"]):
        r = run_cli(*[subst.get(a, a) for a in template])
    assert_refused(r, codes)


# ----------------------------------------------------------------------------- class 2: damaged and forged files


def _page_size(data: bytes) -> int:
    return int.from_bytes(data[16:18], "big") or 65536


def _flip(offset_of):
    def damage(data: bytearray) -> bytearray:
        at = offset_of(data)
        data[at] ^= 0x01
        return data
    return damage


def _truncate(fraction: float):
    return lambda data: data[: int(len(data) * fraction)]


def _zero(start_of, length_of):
    def damage(data: bytearray) -> bytearray:
        s, n = start_of(data), length_of(data)
        data[s:s + n] = bytes(n)
        return data
    return damage


# Byte damage, generated over the file's structure: the header, and the b-tree page-type
# byte of the first, second and last page (a flip inside a stored value is a valid file).
DAMAGE = {
    "truncated to 0.5": _truncate(0.5),
    "truncated to 1 page - 1": lambda d: d[: _page_size(d) - 1],
    "truncated to 99 bytes": lambda d: d[:99],
    "bit 0 of the magic": _flip(lambda d: 0),
    "bit in the page size": _flip(lambda d: 16),
    "bit in page 1's page type": _flip(lambda d: 100),
    "bit in page 2's page type": _flip(lambda d: _page_size(d)),
    "bit in the last page's page type": _flip(lambda d: len(d) - _page_size(d)),
    "zero-filled": lambda d: bytearray(len(d)),
    "first page zeroed": _zero(lambda d: 0, _page_size),
    "schema page body zeroed": _zero(lambda d: 100, lambda d: _page_size(d) - 100),
}


def _not_a_store(path: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as c:
        c.execute("CREATE TABLE t (x)")
        c.commit()


def _forge_version(sql: str):
    def forge(path: Path) -> None:
        with contextlib.closing(sqlite3.connect(path)) as c:
            c.executescript(sql)
            c.execute("PRAGMA journal_mode = DELETE")
    return forge


FORGED = {
    "a SQLite file that is not a store": _not_a_store,
    "alembic_version with no row": _forge_version("DELETE FROM alembic_version;"),
    "alembic_version empty id": _forge_version("UPDATE alembic_version SET version_num = '';"),
    "alembic_version unknown id": _forge_version("UPDATE alembic_version SET version_num = 'zz_unknown';"),
    "alembic_version with two rows": _forge_version(
        "INSERT INTO alembic_version SELECT version_num || '_again' FROM alembic_version;"),
    "alembic_version table dropped": _forge_version("DROP TABLE alembic_version;"),
    "run_meta emptied": _forge_version("DELETE FROM run_meta;"),
    "sampler_state emptied": _forge_version("DELETE FROM sampler_state;"),
}
# `inspect` reads an uninitialised store without complaint (a note): by design it
# describes what is there; `verify` judges it.
# `upgrade` migrates the schema, whatever the rows: a head file is "up to date".
FORGED_SKIP = {(t, c) for t in ("run_meta emptied", "sampler_state emptied")
               for c in ("inspect", "inspect --sql", "upgrade")}

FILE_COMMANDS = {
    "inspect": (["inspect", "P"], {2}),
    "inspect --sql": (["inspect", "P", "--sql", "SELECT count(*) FROM prompt_groups"], {2}),
    "verify": (["verify", "P"], {1, 2}),
    "upgrade": (["upgrade", "P"], {2}),
}


def _file_cases():
    for command in FILE_COMMANDS:
        for name in DAMAGE:
            yield pytest.param(command, "damage", name, id=f"{command}-{name}")
        for name in FORGED:
            if (name, command) in FORGED_SKIP:
                continue
            yield pytest.param(command, "forge", name, id=f"{command}-{name}")


@pytest.mark.parametrize("command,how,name", list(_file_cases()))
def test_a_damaged_or_forged_store_file_is_refused_in_one_line_and_left_as_it_was(world, tmp_path, command, how, name):
    target = tmp_path / "store.sqlite"
    if how == "damage":
        target.write_bytes(bytes(DAMAGE[name](bytearray(world["store"].read_bytes()))))
    elif name == "a SQLite file that is not a store":
        FORGED[name](target)
    else:
        shutil.copyfile(world["store"], target)
        FORGED[name](target)
    template, codes = FILE_COMMANDS[command]
    with unchanged(tmp_path):
        r = run_cli(*[str(target) if a == "P" else a for a in template])
    assert_refused(r, codes)


# ----------------------------------------------------------------------------- unreadable files and directories


def _without_dac_override() -> None:
    """Tests run as root, for whom chmod 000 hides nothing: drop CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH from the bounding set before exec (PR_CAPBSET_DROP = 24), so
    the child is refused by permissions as any other user is."""
    import ctypes

    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


UNREADABLE = {
    # what is made unreadable (relative to the checkpoint copy), the command, exit codes
    "store file / inspect": ("bootstrap/rollout_snapshots/snapshot_1/rollout_state.sqlite", ["inspect", "F"], {2}),
    "store file / verify": ("bootstrap/rollout_snapshots/snapshot_1/rollout_state.sqlite", ["verify", "F"], {1, 2}),
    "manifest / verify": ("bootstrap/rollout_snapshots/snapshot_1/manifest.json",
                          ["verify", "bootstrap/rollout_snapshots/snapshot_1"], {1}),
    "snapshots dir / snapshots": ("bootstrap/rollout_snapshots", ["snapshots", "."], {2}),
    "snapshots dir / verify trainer": ("bootstrap/rollout_snapshots", ["verify", "bootstrap"], {1, 2}),
    "snapshot dir / verify checkpoint": ("bootstrap/rollout_snapshots/snapshot_1", ["verify", "."], {1, 2}),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_an_unreadable_file_or_directory_is_refused_in_one_line(world, tmp_path, case):
    import subprocess
    import sys

    rel, template, codes = UNREADABLE[case]
    ckpt = Path(shutil.copytree(world["ckpt"], tmp_path / "ckpt"))
    (ckpt / rel).chmod(0)
    try:
        with unchanged(tmp_path):
            argv = [str(ckpt / rel) if a == "F" else (str(ckpt / a) if "/" in a or a == "." or a == "bootstrap" else a)
                    for a in template]
            p = subprocess.run([sys.executable, "-m", "rolloutdb", *argv], capture_output=True, text=True,
                               timeout=60, preexec_fn=_without_dac_override, cwd=tmp_path,
                               env=dict(os.environ, ROLLOUTDB_TRACEBACK="1"))
    finally:
        (ckpt / rel).chmod(0o755)
    r = Result(argv, p.returncode, p.stdout, p.stderr, 0.0)
    line = assert_refused(r, codes)
    assert "ermission denied" in line, line
