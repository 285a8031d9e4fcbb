"""`rolloutdb --help`, `rolloutdb COMMAND --help` and `--version` answer at once: building
the parser imports no heavy dependency (torch, DuckDB, SQLAlchemy, Alembic). Checked by
what a fresh interpreter has imported, not by a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version

import pytest

HEAVY = ("torch", "duckdb", "sqlalchemy", "alembic", "transformers", "matplotlib", "ray")

# In a fresh interpreter: parse `--help` of the top level and of every command, and after
# each, list the heavy modules imported so far.
PROBE = f"""
import contextlib, io, json, sys
from rolloutdb.cli import build_parser, main

commands = sorted(build_parser()._subparsers._group_actions[0].choices)
seen = {{}}
for argv in [["--help"]] + [[c, "--help"] for c in commands]:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main(argv)
    seen[" ".join(argv)] = {{"code": code, "printed": bool(out.getvalue().strip()),
                            "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}
print(json.dumps(seen))
"""


def _probe() -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_help_of_the_command_and_of_every_subcommand_imports_no_heavy_dependency():
    seen = _probe()
    assert {"--help", "inspect --help", "sql --help", "train --help", "trace --help"} <= set(seen)
    for argv, what in seen.items():
        assert what == {"code": 0, "printed": True, "heavy": []}, argv


def test_version_prints_the_installed_distributions_version():
    r = subprocess.run([sys.executable, "-m", "rolloutdb", "--version"], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (0, f"rolloutdb {version('rolloutdb')}\n", "")


def test_importing_rolloutdb_loads_the_store_only_when_a_store_name_is_used():
    code = ("import sys, rolloutdb; before = 'sqlalchemy' in sys.modules; store = rolloutdb.Store; "
            "print(before, 'sqlalchemy' in sys.modules, store.__name__, 'Store' in dir(rolloutdb))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["False", "True", "Store", "True"], r.stderr


def test_the_constants_the_help_texts_write_out_agree_with_the_store():
    from rolloutdb.commands import inspect
    from rolloutdb.migrations import head_of_revision_files
    from rolloutdb.store import DEFAULT_QUERY_TIMEOUT_S, head_revision

    assert head_of_revision_files() == head_revision()
    assert inspect.DEFAULT_TIMEOUT_S == DEFAULT_QUERY_TIMEOUT_S  # the one of every --timeout (sql's too)


def test_ctrl_c_while_the_commands_load_ends_with_one_line_not_a_traceback(monkeypatch, capsys):
    """The CLI's own handlers come later (per command); a Ctrl-C while the parser imports
    the command modules raised a KeyboardInterrupt traceback out of `main`."""
    from rolloutdb import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        got = cli.main(["sql", "x.sqlite"])
    except KeyboardInterrupt:  # escaping a test, it would end the whole run
        pytest.fail("KeyboardInterrupt escaped main (a traceback for the user)", pytrace=False)
    assert got == 130
    assert capsys.readouterr().err == "error: interrupted\n"


@pytest.mark.parametrize(("exception", "code", "line"), [("KeyboardInterrupt", 130, "error: interrupted"),
                                                         ("Terminated", 143, "error: terminated (SIGTERM)")])
def test_a_stop_signal_while_the_store_is_imported_ends_with_one_line_not_a_traceback(
        monkeypatch, capsys, exception, code, line):
    """The store's import (SQLAlchemy, ~0.5 s) runs after the CLI's handlers are in place
    but before the command's own error handling: a SIGTERM 0.8 s into `rolloutdb trace`
    printed a Terminated traceback, exit 1."""
    import types

    from rolloutdb import cli
    from rolloutdb.commands._stop_signals import Terminated

    raised = {"KeyboardInterrupt": KeyboardInterrupt, "Terminated": Terminated}[exception]

    class Importing(types.ModuleType):
        def __getattr__(self, name):
            if name == "StoreError":  # what the CLI imports first; nothing else (pytest looks too)
                raise raised
            raise AttributeError(name)

    monkeypatch.setitem(sys.modules, "rolloutdb.store", Importing("rolloutdb.store"))
    try:
        got = cli.main(["verify", "x.sqlite"])
    except BaseException as e:  # noqa: BLE001 - a KeyboardInterrupt escaping a test would end the whole run
        pytest.fail(f"{type(e).__name__} escaped main (a traceback for the user)", pytrace=False)
    assert got == code
    assert capsys.readouterr().err == line + "\n"
