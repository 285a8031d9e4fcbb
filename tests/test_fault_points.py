"""Every kill point is registered by its owner: the store lists its own (publication,
retention, upgrade), the controller registers its own; every `faults.point(...)` call
names a registered point and every registered point is called by its owner."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

from conftest import REPO
from rolloutdb.controller import fault_points as controller_points
from rolloutdb.store import faults

STORE_POINTS = faults.POINTS + faults.SEGMENT_POINTS + faults.FOLD_POINTS + faults.UPGRADE_POINTS


def _point_calls(folder: str) -> list[tuple[str, int, str]]:
    """(file, line, pattern) of every `faults.point(...)` call under `folder`: a literal
    name, or a regex for an f-string name (each `{...}` a stage or step word)."""
    calls = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "point"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "faults"):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant):
                pattern = re.escape(arg.value)
            else:
                assert isinstance(arg, ast.JoinedStr), f"{path}:{node.lineno}: a fault point is named by a string"
                pattern = "".join(re.escape(v.value) if isinstance(v, ast.Constant) else "[a-z_]+" for v in arg.values)
            calls.append((str(path.relative_to(REPO)), node.lineno, pattern))
    return calls


def test_every_point_call_names_a_registered_point_and_every_point_is_called_by_its_owner():
    registered = set(faults.registered())
    owners = {"store": STORE_POINTS, "controller": controller_points.POINTS}
    assert registered == set(STORE_POINTS) | set(controller_points.POINTS)
    for folder, points in owners.items():
        calls = _point_calls(folder)
        for file, line, pattern in calls:
            assert any(re.fullmatch(pattern, p) for p in points), f"{file}:{line}: faults.point names no point of {folder}/"
        for point in points:
            assert any(re.fullmatch(pattern, point) for _, _, pattern in calls), f"{point} is registered but never called"
    for folder in ("rolloutdb", "gpu_capture"):
        assert not _point_calls(folder), f"{folder}/ calls kill points it never registered"


def test_the_store_names_none_of_the_controllers_points():
    source = (REPO / "store" / "faults.py").read_text()
    for point in controller_points.POINTS:
        assert point not in source, point


def _env(fault: str) -> dict:
    return {**os.environ, faults.ENV: fault, "RAY_AUTH_MODE": "disabled"}


def test_a_controller_point_armed_before_the_controller_is_imported_is_accepted_then_known():
    code = ("from rolloutdb.store import faults\n"
            "from rolloutdb.controller import fault_points\n"
            "faults.check_armed()\n"
            "print(sorted(faults._kill_at))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=_env("pump.after_finish@2"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['pump.after_finish']"


def test_training_with_a_fault_point_nobody_registered_is_refused_in_one_line_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rolloutdb", "train", "--config", str(REPO / "examples" / "quickstart.yaml"),
         "--run-dir", str(run_dir), "algorithm.total_steps=1"],
        env=_env("pump.after_dispatchh"), capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "'pump.after_dispatchh'" in lines[0], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
