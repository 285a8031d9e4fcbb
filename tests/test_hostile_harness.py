"""The hostile suite's deadline fails one test, never the run: a command that hangs deep
in a recursion (as a 5000-deep YAML parse does on a loaded machine) is reported as that
test's failure, with where it hung, and the tests after it still run. With the SIGALRM
deadline this harness used before, the alarm's exception was raised 1000 frames deep and
pytest ended the whole run with INTERNALERROR (exit 3)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

HUNG_SUITE = textwrap.dedent('''
    import pytest
    import yaml
    import hostile
    from rolloutdb.config import _Loader

    def parse_deep_yaml_for_a_while(argv):
        for _ in range(3):  # ~2 s each on an idle machine, then RecursionError
            try:
                yaml.load(b"a: " + b"[" * 5000 + b"]" * 5000 + b"\\n", Loader=_Loader)
            except RecursionError:
                pass
        return 0

    @pytest.mark.parametrize("deadline", [0.3, 1.0])
    def test_a_command_that_outlives_its_deadline_deep_in_a_parser(monkeypatch, deadline):
        monkeypatch.setattr(hostile.cli, "main", parse_deep_yaml_for_a_while)
        hostile.run_cli("verify", "x", deadline=deadline)

    def test_the_next_test_still_runs():
        assert True
''')


def test_a_hung_command_fails_its_own_test_and_the_run_goes_on(tmp_path):
    (tmp_path / "test_hung.py").write_text(HUNG_SUITE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "--rootdir", str(tmp_path), str(tmp_path / "test_hung.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    out = done.stdout + done.stderr
    assert "INTERNALERROR" not in out, out[-3000:]
    assert done.returncode == 1, out[-3000:]  # tests failed; 3 would be an internal error
    assert "2 failed, 1 passed" in out, out[-3000:]
    assert "did not finish within 0.3 s (a hang)" in out and "yaml" in out, out[-3000:]
