"""Names that say one thing (read from the source tree with `ast`): entering the replay
buffer has its own verb, `enter_replay`, and "publish" is left to checkpoint publication;
one module is named resume (the controller's)."""

from __future__ import annotations

import ast

from package_layout import ROOT, source_packages

# Where groups move through the ledger and into the replay buffer: no "publish" here.
REPLAY_MODULES = ("store/live", "controller/run/dispatch.py", "controller/rollout/pump.py", "controller/run/tracing.py")


def _source_files():
    for folder in sorted(set(source_packages(ROOT).values())):
        yield from sorted(folder.glob("*.py"))


def test_entering_the_replay_buffer_is_named_enter_replay_never_publish():
    offenders = []
    for path in _source_files():
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(REPLAY_MODULES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "publish" in node.name:
                offenders.append(f"{rel}:{node.lineno}: def {node.name}")
    assert not offenders, "replay entry is `enter_replay`; these still call it publish:\n" + "\n".join(offenders)
    from rolloutdb.store import Store, ledger

    assert callable(ledger.enter_replay) and callable(Store.enter_replay)


def test_one_module_is_named_resume_the_controllers():
    resumes = [p.relative_to(ROOT).as_posix() for p in _source_files() if p.stem.startswith("resume")]
    assert resumes == ["controller/recovery/resume.py"]
