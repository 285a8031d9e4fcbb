"""The CLI's own errors: argparse's usage errors are one `error:` line like every other
error, and the top level turns whatever escapes a command into one line (a backstop:
the causes are fixed where they arise)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from rolloutdb import cli


def run_main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv,fragment", [
    ([], "required: COMMAND"),
    (["nope"], "invalid choice: 'nope'"),
    (["inspect"], "required: PATH"),
    (["inspect", "x.sqlite", "--bogus"], "unrecognized arguments: --bogus"),
    (["verify"], "required: PATH"),
    (["snapshots", "a", "b"], "unrecognized arguments: b"),
    (["train"], "--config"),
    (["inspect", "x.sqlite", "--timeout"], "expected one argument"),
])
def test_a_usage_error_is_one_error_line_with_exit_2(argv, fragment):
    code, out, err = run_main(*argv)
    assert code == 2
    assert err.splitlines() == [err.rstrip("\n")] and err.startswith("error: rolloutdb"), err
    assert fragment in err and "--help" in err and "usage:" not in err
    assert out == ""


def test_a_usage_error_from_a_real_process_is_one_line_too():
    r = subprocess.run([sys.executable, "-m", "rolloutdb", "inspect"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: ")


def test_help_still_prints_and_exits_0():
    code, out, err = run_main("--help")
    assert code == 0 and "COMMAND" in out and err == ""


def _raising(exc: BaseException):
    def func(_args):
        raise exc
    return func


def test_the_backstop_prints_exactly_one_line_naming_the_cause(monkeypatch, capsys):
    import argparse

    monkeypatch.delenv("ROLLOUTDB_TRACEBACK", raising=False)
    for exc, fragment in [
        (OSError(5, "Input/output error", "/x/y.sqlite"), "/x/y.sqlite: Input/output error"),
        (RecursionError("maximum recursion depth exceeded"), "nested too deeply"),
        (__import__("sqlite3").OperationalError("disk I/O error"), "SQLite: disk I/O error"),
        (TypeError("bad\nsecond line"), "unexpected TypeError: bad\\nsecond line"),
    ]:
        assert cli._run(argparse.Namespace(func=_raising(exc))) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [err.rstrip("\n")] and err.startswith("error: ") and fragment in err, err


def test_rolloutdb_traceback_re_raises_for_debugging(monkeypatch):
    import argparse

    monkeypatch.setenv("ROLLOUTDB_TRACEBACK", "1")
    with pytest.raises(TypeError):
        cli._run(argparse.Namespace(func=_raising(TypeError("x"))))
