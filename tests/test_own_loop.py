"""The library mode: examples/own_loop.py drives the store, the publisher and restore from
its own loop, through nothing but what `rolloutdb` exports, and a SIGKILL mid-step
followed by a resume trains every prompt exactly once."""

from __future__ import annotations

import ast
import contextlib
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import rolloutdb
import settled
from conftest import REPO

EXAMPLE = REPO / "examples" / "own_loop.py"
ALLOWED_OUTSIDE = {"torch", "numpy"}


def outside_imports(path: Path) -> list[str]:
    """One line per import in `path` that is neither the standard library, torch, numpy,
    nor a name `rolloutdb` exports (`import rolloutdb`, then `rolloutdb.NAME`, counts too)."""
    tree = ast.parse(path.read_text(), str(path))
    public = set(rolloutdb.__all__)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if alias.name != "rolloutdb" and (top == "rolloutdb" or not _allowed(top)):
                    out.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module == "rolloutdb":
                out += [f"{node.lineno}: from rolloutdb import {a.name}" for a in node.names if a.name not in public]
            elif node.level or module.split(".")[0] == "rolloutdb" or not _allowed(module.split(".")[0]):
                out.append(f"{node.lineno}: from {'.' * node.level}{module} import ...")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "rolloutdb" and node.attr not in public):
            out.append(f"{node.lineno}: rolloutdb.{node.attr}")
    return out


def _allowed(top: str) -> bool:
    return top in sys.stdlib_module_names or top in ALLOWED_OUTSIDE or top == "__future__"


def test_the_example_uses_only_names_rolloutdb_exports_and_every_export_exists():
    assert outside_imports(EXAMPLE) == []
    assert [n for n in rolloutdb.__all__ if not hasattr(rolloutdb, n)] == []
    assert 80 <= len(EXAMPLE.read_text().splitlines()) <= 170, "small enough to read in one sitting"


def test_the_import_check_names_a_submodule_a_private_store_name_and_an_unexported_attribute(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import rolloutdb\nimport rolloutdb.store\nfrom rolloutdb.store import Store\n"
                   "from rolloutdb import Store, Database\nimport yaml\nrolloutdb.Store\nrolloutdb.open_readonly\n")
    assert outside_imports(bad) == [
        "2: import rolloutdb.store",
        "3: from rolloutdb.store import ...",
        "4: from rolloutdb import Database",
        "5: import yaml",
        "7: rolloutdb.open_readonly",
    ]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=240)


def test_a_run_killed_mid_step_and_resumed_trains_every_prompt_exactly_once(tmp_path):
    run = tmp_path / "run"
    killed = _run(str(run), "--steps", "6", "--kill-at-step", "3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.stdout.splitlines() == [l for l in killed.stdout.splitlines() if l.startswith(("step 1:", "step 2:"))]
    assert len(killed.stdout.splitlines()) == 2

    resumed = _run(str(run), "--steps", "6", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    first = resumed.stdout.splitlines()[0]
    assert first.startswith("resumed from snapshot_") and "at step 2" in first, resumed.stdout
    assert "exactly-once: ok (trained=24 discarded=0 duplicated=0 lost=0 pending=0)" in resumed.stdout

    # The store, read through a second connection: 24 prompts, each once, 4 per step,
    # and the groups that were in flight at the kill run again.
    with contextlib.closing(sqlite3.connect(run / "store.db")) as conn:
        ledger = settled.positions(conn)  # trained groups are settled ranges (v1_4_a)
        assert sorted(ledger) == list(range(24))
        assert all(len(records) == 1 for records in ledger.values())
        assert {ledger[seq][0][0] for seq in ledger} == {"trained"}
        assert [ledger[seq][0][1] for seq in range(24)] == [s for s in range(1, 7) for _ in range(4)]
        # Settled groups left the ledger with their attempts: nothing is in flight at the end.
        left = [conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("prompt_groups", "rollouts")]
    assert left == [0, 0]
    rerun = int(first.split(": ")[1].split()[0])  # "resumed from ... at step 2: N group(s) in flight run again"
    assert rerun > 0, "nothing was in flight at the kill: the test proves nothing"

    audit = rolloutdb.audit_ledger(run / "store.db", groups_per_step=4)
    assert audit.ok and audit.trained == 24 and audit.pending == 0, audit.problems
    for path in (run / "store.db", run / "checkpoints"):
        verify = subprocess.run([sys.executable, "-m", "rolloutdb", "verify", str(path)],
                                capture_output=True, text=True, timeout=120)
        assert verify.returncode == 0, verify.stdout + verify.stderr
