"""docs/architecture.md says what the code is: its state model names every table of the
live store's schema (`store/live/schema.py`) and of the trace's (`store/trace/events.py`),
and no other; every module path and folder it cites exists; every subsystem folder and
flat module of the store and the controller is described in "Subsystems and floors".

The checks return one line per problem, so a failure names the table, path or folder;
the last test plants a wrong table name, a missing table, a dead path and an undescribed
floor in a copy of the text and watches each check name it.
"""

from __future__ import annotations

import re
from pathlib import Path

from package_layout import ROOT, package_dirs

from rolloutdb.store.live.schema import metadata
from rolloutdb.store.trace.events import trace_metadata

DOC = ROOT / "docs" / "architecture.md"
SUBSYSTEMS = "Subsystems and floors"
STATE_MODEL = "State model"
LIVE_STORE = "The live store"
TRACE_STORE = "The trace store"

# `store/live/ledger.py`, tests/test_restore.py: a path ending in .py, anywhere in the text.
MODULE_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w-]+\.py)\b")
# `controller/run/`, `migrations/versions/`: a backticked path ending in a slash.
FOLDER = re.compile(r"`((?:[\w-]+/)+)`")
BACKTICKED = re.compile(r"`([^`\n]+)`")
FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def section(text: str, title: str, level: int = 2) -> str:
    """The body of the heading `title` at `level` ('## ' or '### '), up to the next
    heading of that level or above; empty when there is no such heading."""
    lines = text.splitlines()
    marker = "#" * level + " " + title
    out: list[str] = []
    inside = False
    for line in lines:
        if line.startswith("#"):
            depth = len(line) - len(line.lstrip("#"))
            if inside and depth <= level:
                break
            if line.strip() == marker:
                inside = True
                continue
        if inside:
            out.append(line)
    return "\n".join(out)


def tables_named(text: str) -> list[str]:
    """The table names of a section's markdown tables: every backticked name in the first
    cell of each row (header and separator rows have none)."""
    names = []
    for line in text.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            first = line.split("|")[1]
            names += BACKTICKED.findall(first)
    return names


def table_problems(text: str) -> list[str]:
    """The state model against the schema metadata, both ways, for each store."""
    state = section(text, STATE_MODEL)
    problems = [] if state else [f'no "## {STATE_MODEL}" section']
    for title, tables in ((LIVE_STORE, set(metadata.tables)), (TRACE_STORE, set(trace_metadata.tables))):
        named = tables_named(section(state, title, level=3))
        if not named:
            problems.append(f'"### {title}" names no table')
        problems += [f"{title}: `{t}` is named twice" for t in sorted({t for t in named if named.count(t) > 1})]
        problems += [f"{title}: `{t}` is named but is no table of the schema" for t in sorted(set(named) - tables)]
        problems += [f"{title}: table `{t}` of the schema is not described" for t in sorted(tables - set(named))]
    return problems


def path_problems(text: str, root: Path = ROOT) -> list[str]:
    """Every module path (a.py) and folder (`a/b/`) the text cites, that does not exist.
    Folders written in capitals (`CHECKPOINT_DIR/payload_segments/`) are placeholders."""
    problems = [f"{p}: no such module" for p in sorted(set(MODULE_PATH.findall(text))) if not (root / p).is_file()]
    for folder in sorted(set(FOLDER.findall(text))):
        if folder.split("/")[0].isupper():
            continue
        if not (root / folder).is_dir():
            problems.append(f"{folder}: no such folder")
    return problems


def floors(root: Path = ROOT) -> list[str]:
    """What "Subsystems and floors" must describe: every top-level folder mapped into the
    package, and in the store and the controller every subpackage folder and flat module."""
    wanted = sorted({f"{folder.relative_to(root).parts[0]}/" for folder in package_dirs(root).values()})
    for top in ("store", "controller"):
        for child in sorted((root / top).iterdir()):
            if child.is_dir() and (child / "__init__.py").is_file():
                wanted.append(f"{top}/{child.name}/")
            elif child.suffix == ".py":
                wanted.append(f"{top}/{child.name}")
    return wanted


def floor_problems(text: str, root: Path = ROOT) -> list[str]:
    cited = set(BACKTICKED.findall(FENCED.sub("", section(text, SUBSYSTEMS))))
    if not cited:
        return [f'no "## {SUBSYSTEMS}" section']
    return [f"{f}: not described in {SUBSYSTEMS}" for f in floors(root) if f not in cited]


def test_the_state_model_names_exactly_the_tables_of_the_schema():
    problems = table_problems(DOC.read_text())
    assert not problems, "docs/architecture.md and the schema disagree:\n" + "\n".join(problems)


def test_every_module_path_and_folder_the_doc_cites_exists():
    problems = path_problems(DOC.read_text())
    assert not problems, "docs/architecture.md cites what does not exist:\n" + "\n".join(problems)


def test_every_floor_of_the_store_and_the_controller_is_described():
    assert "store/live/" in floors() and "controller/rollout/" in floors() and "controller/protocols.py" in floors()
    problems = floor_problems(DOC.read_text())
    assert not problems, "docs/architecture.md leaves out:\n" + "\n".join(problems)


def test_the_checks_name_a_planted_wrong_table_a_left_out_table_a_dead_path_and_a_left_out_floor():
    text = DOC.read_text()
    assert "| `replay_groups` |" in text and "`store/live/ledger.py`" in text and "`controller/rollout/`" in text
    wrong = text.replace("| `replay_groups` |", "| `replay_group` |", 1)
    assert f"{LIVE_STORE}: `replay_group` is named but is no table of the schema" in table_problems(wrong)
    assert f"{LIVE_STORE}: table `replay_groups` of the schema is not described" in table_problems(wrong)
    trace = text.replace("`train_step`, `snapshot_cut`", "`snapshot_cut`", 1)
    assert table_problems(trace) == [f"{TRACE_STORE}: table `train_step` of the schema is not described"]
    dead = text.replace("`store/live/ledger.py`", "`store/live/ledgers.py`", 1)
    assert path_problems(dead) == ["store/live/ledgers.py: no such module"]
    assert path_problems(text.replace("`controller/run/`", "`controller/runs/`", 1)) == ["controller/runs/: no such folder"]
    left_out = text.replace("`controller/rollout/`", "the rollout folder")
    assert floor_problems(left_out) == [f"controller/rollout/: not described in {SUBSYSTEMS}"]
