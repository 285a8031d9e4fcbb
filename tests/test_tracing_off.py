"""Tracing off is one object, `NullTracer`, never None: a run with tracing off trains and
writes no trace, and no code path asks whether there is a tracer."""

from __future__ import annotations

import ast

from package_layout import ROOT, source_packages

from rolloutdb.config import config_from_dict
from rolloutdb.controller.job.controller import Controller
from rolloutdb.controller.run.run_log import read_metrics


def _is_tracer_name(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return name is not None and (name.lstrip("_") in {"tracer", "trace"} or name.endswith("_tracer"))


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def tracer_none_checks() -> list[str]:
    """file:line of every comparison of a tracer with None, every truth test of a tracer,
    and every tracer that defaults to None, in the source packages."""
    found = []
    for folder in sorted(set(source_packages(ROOT).values())):
        for path in sorted(folder.glob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    if any(_is_tracer_name(s) for s in sides) and any(_is_none(s) for s in sides):
                        found.append(f"{rel}:{node.lineno}: compares a tracer with None")
                tests = []
                if isinstance(node, (ast.If, ast.IfExp, ast.While)):
                    tests = [node.test]
                elif isinstance(node, ast.BoolOp):
                    tests = node.values
                elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                    tests = [node.operand]
                found += [f"{rel}:{t.lineno}: tests a tracer's truth" for t in tests if _is_tracer_name(t)]
                if isinstance(node, ast.AnnAssign) and _is_tracer_name(node.target) and node.value is not None \
                        and _is_none(node.value):
                    found.append(f"{rel}:{node.lineno}: a tracer defaults to None")
                if isinstance(node, ast.arguments):
                    positional = node.posonlyargs + node.args
                    pairs = list(zip(positional[len(positional) - len(node.defaults):], node.defaults))
                    pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
                    found += [f"{rel}:{d.lineno}: argument {a.arg} defaults to None"
                              for a, d in pairs if a.arg.lstrip("_") in {"tracer", "trace"} and _is_none(d)]
    return found


def test_no_code_path_checks_whether_there_is_a_tracer():
    checks = tracer_none_checks()
    assert not checks, "tracing off is a NullTracer; these still check for None:\n" + "\n".join(checks)


def test_a_run_with_tracing_off_trains_snapshots_and_writes_no_trace(tmp_path):
    from rolloutdb.store import NullTracer

    run_dir = tmp_path / "run"
    config = config_from_dict({
        "run": {"name": "off", "seed": 5},
        "algorithm": {"total_steps": 2, "groups_per_step": 2, "group_size": 2, "max_staleness": 1},
        "generation": {"max_tokens": 3, "max_batch_size": 4},
        "environment": {"dataset_size": 16, "n_digits": 2},
        "checkpointing": {"interval_steps": 1},
        "rollout_checkpointing": {"enabled": True, "interval_s": 0.05},
        "trace": {"enabled": False},
        "logging": {"progress": False, "plot": False},
    })
    controller = Controller(config, run_dir)
    summary = controller.run()
    assert isinstance(controller.parts.tracer, NullTracer)
    assert summary.steps == 2
    assert [e["step"] for e in read_metrics(run_dir / "logs" / "metrics.jsonl", "train_step")] == [1, 2]
    published = [e for e in read_metrics(run_dir / "logs" / "metrics.jsonl", "snapshot") if e["outcome"] == "published"]
    assert published, "the snapshot pump published nothing (its trace call runs on every published snapshot)"
    assert not list((run_dir / "logs").glob("rollout_trace.sqlite*"))
