"""Shared fixtures. Tests run against real SQLite files in tmp_path; persisted state is
checked through a second connection, never through the handle that wrote it."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


@pytest.fixture
def store(tmp_path):
    from rolloutdb.store import Store

    s = Store.create(tmp_path / "live.sqlite", replay_capacity=16)
    yield s
    s.close()


@pytest.fixture
def second_connection():
    """Open a fresh read connection on a store file: what another process would see."""
    opened = []

    def _open(path) -> sqlite3.Connection:
        conn = sqlite3.connect(path)
        opened.append(conn)
        return conn

    yield _open
    for conn in opened:
        conn.close()

# Test helpers that are modules (crash_harness, publish_child) import by name.
import sys as _sys

_sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def seeded_prefix_run(tmp_path_factory):
    """The seeded, packed prefix-level run killed twice and its never-stopped twin
    (tests/test_prefix_recovery_real_run.py `killed_twin_runs`): run once, read by that
    module's twin tests and by tests/test_shared_prefix_packing.py (~30 s on 2 cores)."""
    from test_prefix_recovery_real_run import killed_twin_runs

    return killed_twin_runs(tmp_path_factory.mktemp("prefix_run_seeded"), "seeded")


@pytest.fixture(scope="session")
def agent_servers_killed(tmp_path_factory):
    """examples/agent_server.yaml at prefix level, SIGKILLed with its servers while its
    snapshot holds agents prefixes, an exported agent past its first turn and restarts
    fallbacks, then resumed (tests/test_agent_server_prefix.py `killed_beside_agent_servers`):
    run once, read by that module and by tests/test_agent_server_faults.py."""
    from test_agent_server_prefix import killed_beside_agent_servers

    return killed_beside_agent_servers(tmp_path_factory.mktemp("agent_servers_killed"))


def copying_clone(src_fd: int, dst_fd: int) -> bool:
    """What FICLONE leaves in a new file (the base's bytes), written instead of shared: the
    clone `capture_snapshot` is given where the file system (ext4) cannot clone."""
    size = os.fstat(src_fd).st_size
    os.pwrite(dst_fd, os.pread(src_fd, size, 0), 0)
    return True
