"""The run audit behind `rolloutdb verify RUN_DIR` lives with the controller: it reads the
run's config through `rolloutdb.config` (the validation `train` applies) and hands the
store only `groups_per_step`; the store parses no YAML and names no run-directory file."""

from __future__ import annotations

import ast

from conftest import REPO
from test_verify_run_lost_work import build_run, verify_cli


def _snapshot_of(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def test_verify_refuses_a_run_config_that_train_would_refuse_naming_the_key_and_changes_nothing(tmp_path):
    run_dir = build_run(tmp_path, {})
    (run_dir / "config.yaml").write_text("algorithm:\n  groups_per_step: 2\n  total_steps: -3\n")
    before = _snapshot_of(tmp_path)
    proc = verify_cli(run_dir)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "config.yaml" in lines[0] and "total_steps" in lines[0], lines[0]
    assert _snapshot_of(tmp_path) == before


def test_verify_takes_groups_per_step_from_the_validated_config(tmp_path):
    """Two groups trained per step; a config saying three makes every step short."""
    run_dir = build_run(tmp_path, {})
    assert verify_cli(run_dir).returncode == 0
    (run_dir / "config.yaml").write_text("algorithm:\n  groups_per_step: 3\n")
    proc = verify_cli(run_dir)
    assert proc.returncode == 1
    assert "groups_per_step=3" in proc.stderr


def test_the_store_parses_no_yaml_and_imports_nothing_of_the_controller_or_the_config():
    offenders = []
    for path in sorted((REPO / "store").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                if name == "yaml" or name.startswith(("rolloutdb.controller", "rolloutdb.config", "yaml.")):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert not offenders, offenders
    choice = (REPO / "store" / "restore" / "choice.py").read_text()
    assert "config.yaml" not in choice and '"rollout_state.sqlite"' not in choice
