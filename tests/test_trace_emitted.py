"""docs/trace.md against the events real runs write, not against the code's list of them.

The page promises, per event, a list of fields; tests/test_trace.py checks that list
against `EVENTS`, which only says what `emit` accepts. Here real runs write the trace and
each field the page lists is looked for in the file (plain sqlite3, a connection of our
own):

- every field a run wrote (a column set in some row, a list table with rows) is on the
  event's page section;
- every field the page lists without "(optional)" is set in every event of that kind the
  runs wrote (a list field: in some event, an empty list has no rows);
- over the runs together, every event the page lists was written, and every optional
  field was set at least once (the page says when).

The runs: the agent-server ones other tests make anyway, examples/agent_server.yaml at
prefix level SIGKILLed with its servers and resumed (conftest.py `agent_servers_killed`:
snapshots, a restore, attempts abandoned by it, prefixes cut, calls a cut could not save,
episodes continued) and the same job whose `agents` server is SIGKILLed alone
(tests/test_agent_server_faults.py `server_killed`: attempts the run abandons itself,
with reason `error`); and a short run of the crash harness's in-process multi-turn job at
turn level (`crash_harness.TURN_LEVEL`, 3 steps: turns committed by the pump itself).
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from crash_harness import TURN_LEVEL, train_env
from rolloutdb.store.trace.events import LIST_TABLES
from rolloutdb.store.trace.writer import TRACE_FILENAME
from test_agent_server_faults import server_killed  # noqa: F401 - a fixture, shared with that module's run

REPO = Path(__file__).resolve().parents[1]
# The three runs start with the first test that reads them: ~4.5 min on the loaded 2-core
# machine (the agent-server ones ~4 of it, and shared with their own modules' tests).
RUNS_TIMEOUT_S = 1200
TABLE_COLUMNS = {"seq", "t", "run"}  # every event table's own columns, not fields


def documented(doc: str) -> dict[str, dict[str, bool]]:
    """Event -> {field: optional?} from the page's "## Events" part: the backquoted names
    before the first colon (or in the whole line, without one) of each top-level bullet
    of the event's section."""
    part = doc.split("\n## Events\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, dict[str, bool]] = {}
    for event, body in re.findall(r"^### `(\w+)`\n(.*?)(?=^### |\Z)", part, re.S | re.M):
        fields: dict[str, bool] = {}
        for line in re.findall(r"^- (.*)$", body, re.M):
            head = line.split(":", 1)[0]  # "- `a`, `b` (col): what they are" or "- `a`, `b` (col)."
            for name in re.findall(r"`(\w+)`", head):
                if name not in TABLE_COLUMNS:
                    fields[name] = "(optional)" in head
        out[event] = fields
    return out


def emitted(trace: Path) -> dict[str, tuple[int, dict[str, int]]]:
    """Event -> (events written, {field: events that set it}) of one trace file."""
    lists: dict[str, list[tuple[str, str]]] = {}
    for (event, field), (table, _cols) in LIST_TABLES.items():
        lists.setdefault(event, []).append((field, table))
    out: dict[str, tuple[int, dict[str, int]]] = {}
    with contextlib.closing(sqlite3.connect(f"file:{trace}?mode=ro", uri=True)) as conn:
        tables = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            columns = [c[1] for c in conn.execute(f'PRAGMA table_info("{table}")')]
            if not TABLE_COLUMNS <= set(columns):
                continue  # runs, list tables, alembic_version
            fields = [c for c in columns if c not in TABLE_COLUMNS]
            set_counts = ", ".join(f'count("{c}")' for c in fields)
            total, *counts = conn.execute(f'SELECT count(*){", " + set_counts if fields else ""} FROM "{table}"').fetchone()
            by_field = dict(zip(fields, counts))
            for field, list_table in lists.get(table, []):
                by_field[field] = conn.execute(f'SELECT count(DISTINCT seq) FROM "{list_table}"').fetchone()[0]
            out[table] = (total, by_field)
    return out


def problems(doc: dict[str, dict[str, bool]], written: dict[str, tuple[int, dict[str, int]]]) -> list[str]:
    """What one run wrote that the page does not say, or the page says and the run did not write."""
    out = []
    for event, (total, by_field) in sorted(written.items()):
        if not total:
            continue
        if event not in doc:
            out.append(f"{event}: written, not on the page")
            continue
        for field, n in sorted(by_field.items()):
            if n and field not in doc[event]:
                out.append(f"{event}.{field}: written, not on the page")
        for field, optional in sorted(doc[event].items()):
            n = by_field.get(field)
            if n is None:
                out.append(f"{event}.{field}: on the page, no such column in the file")
            elif not optional and n < total and not (n and (event, field) in LIST_TABLES):  # an empty list: no rows
                out.append(f"{event}.{field}: on the page as always given, unset in {total - n} of {total} events")
    return out


@pytest.fixture(scope="module")
def page() -> dict[str, dict[str, bool]]:
    return documented((REPO / "docs" / "trace.md").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def turn_level_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("turn_level") / "run"
    overrides = [o for o in TURN_LEVEL.overrides if not o.startswith("algorithm.total_steps=")]
    done = subprocess.run([sys.executable, "-m", "rolloutdb", "train", "--config", str(TURN_LEVEL.example),
                           "--run-dir", str(run_dir), *overrides, "algorithm.total_steps=3"],
                          env=train_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return run_dir


@pytest.fixture(scope="module")
def runs(agent_servers_killed, server_killed, turn_level_run) -> dict[str, dict]:  # noqa: F811 - the imported fixture
    return {"killed with its servers and resumed": emitted(agent_servers_killed["run_dir"] / "logs" / TRACE_FILENAME),
            "agents server killed alone": emitted(server_killed["run_dir"] / "logs" / TRACE_FILENAME),
            "in-process turn level": emitted(turn_level_run / "logs" / TRACE_FILENAME)}


def test_the_page_parser_reads_fields_optional_ones_and_nothing_else():
    doc = documented("# x\n## Events\n\n### `e`\nWhat.\n- `a`, `b` (col): about `c`.\n- `d` (optional): when `x`.\n"
                     "  - `sub`: a value, not a field.\n- `t`: a time.\n- `h` (col).\n\n## The figures\n### `f`\n- `g`: no.\n")
    assert doc == {"e": {"a": False, "b": False, "d": True, "h": False}}


@pytest.mark.timeout(RUNS_TIMEOUT_S)
def test_every_field_the_runs_wrote_is_on_the_page_and_every_field_on_it_is_written(page, runs):
    found = [f"{name}: {p}" for name, written in runs.items() for p in problems(page, written)]
    assert not found, found


@pytest.mark.timeout(RUNS_TIMEOUT_S)
def test_every_event_on_the_page_and_every_optional_field_was_written_by_some_run(page, runs):
    seen: dict[str, set[str]] = {}
    for written in runs.values():
        for event, (total, by_field) in written.items():
            if total:
                seen.setdefault(event, set()).update(f for f, n in by_field.items() if n)
    assert sorted(set(page) - set(seen)) == [], "events on the page no run wrote"
    never = sorted(f"{e}.{f}" for e, fields in page.items() for f, optional in fields.items()
                   if optional and f not in seen.get(e, set()))
    assert never == [], "optional fields no run set"


@pytest.mark.timeout(RUNS_TIMEOUT_S)
def test_a_field_the_page_promises_and_a_run_leaves_unset_is_named(page, runs):
    """The check itself: a field dropped from what a run wrote, and one the page adds."""
    name, written = next(iter(runs.items()))
    total, by_field = written["snapshot_cut"]
    assert total and not problems(page, {"snapshot_cut": written["snapshot_cut"]})
    dropped = {"snapshot_cut": (total, {**by_field, "groups_in_flight": 0})}
    assert problems(page, dropped) == [
        f"snapshot_cut.groups_in_flight: on the page as always given, unset in {total} of {total} events"]
    extra = {**page, "snapshot_cut": {**page["snapshot_cut"], "shard": False}}
    assert problems(extra, {"snapshot_cut": written["snapshot_cut"]}) == [
        "snapshot_cut.shard: on the page, no such column in the file"]
    undocumented = {**page, "snapshot_cut": {f: o for f, o in page["snapshot_cut"].items() if f != "anchor"}}
    assert problems(undocumented, {"snapshot_cut": written["snapshot_cut"]}) == [
        "snapshot_cut.anchor: written, not on the page"]


@pytest.mark.timeout(RUNS_TIMEOUT_S)
def test_a_restore_names_the_snapshot_directory_its_cut_was_recorded_with(agent_servers_killed):
    trace = agent_servers_killed["run_dir"] / "logs" / TRACE_FILENAME
    with contextlib.closing(sqlite3.connect(f"file:{trace}?mode=ro", uri=True)) as conn:
        restored = conn.execute("SELECT snapshot_seq, snapshot, cut_time, policy_version, step FROM restore_done").fetchall()
        cuts = {seq: (snap, cut, v, s) for seq, snap, cut, v, s in conn.execute(
            "SELECT snapshot_seq, snapshot, cut_time, policy_version, step FROM snapshot_cut")}
    assert restored, "the resumed run recorded no restore"
    for seq, snapshot, cut_time, version, step in restored:
        assert cuts[seq] == (snapshot, cut_time, version, step)
        assert Path(snapshot).name == f"snapshot_{seq}" and Path(snapshot).is_relative_to(agent_servers_killed["run_dir"])
