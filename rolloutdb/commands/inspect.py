"""`rolloutdb inspect PATH`: look inside a live store, a snapshot, a payload segment or a
trace file (or the run or snapshot directory holding one), read-only.

Without ``--sql`` it summarises the file: schema revision, rows per table, ledger groups
and rollouts per state, replay permits, sampler cursor, mutation counter, and the anchor
and cut time from a ``manifest.json`` beside the file. With ``--sql`` it runs one reading
query and prints the rows. ``--json`` makes either machine-readable.

The file is opened through `rolloutdb.store.sqlite.readonly`: never created, never changed, no
``-wal``/``-shm`` left behind, writes refused. Old schema revisions are read as they are
(every query here uses only columns every known revision has); a newer revision is
refused, since this code cannot know what its tables mean.
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import time
from pathlib import Path
from typing import Any

from rolloutdb.commands._arguments import DEFAULT_TIMEOUT_S, path_argument, positive_seconds
from rolloutdb.commands._tables import format_table, json_cell
from rolloutdb.timefmt import ago, iso_utc

MANIFEST_NAME = "manifest.json"
# The store's DEFAULT_QUERY_TIMEOUT_S, written out so that building the parser (--help)
# imports no store; tests/test_cli_startup.py checks that the two agree.

DESCRIPTION = """\
Look inside a rolloutdb store or snapshot file, a payload segment or a run's trace file,
without changing it. PATH may be the file, a run directory or a snapshot directory (its
rollout_state.sqlite), or a run's logs/ directory (its rollout_trace.sqlite; the trace is
summarised as its revision, the processes that wrote to it and its rows per table).

Without --sql, prints a summary: the schema revision (head, or old: then
`rolloutdb upgrade PATH` migrates it, or `--out COPY` for a published snapshot file), rows per table, ledger groups per state
(settled ones included; where the old steps are folded into counts, below which
position), rollouts per state with abandon reasons, replay permits used of capacity, the sampler cursor and the
mutation counter, where the samples' payload is (inline, or sealed into payload
segments: CHECKPOINT_DIR/payload_segments/segment_<n>.sqlite, one table `payload`
(sample_id, token_ids, logprobs) that `sqlite3` and DuckDB's sqlite scanner read);
and, when a manifest.json sits beside the file (a snapshot
directory), its anchor, kind, sequence and cut time. A payload segment file is
summarised too: its samples, their id range, tokens and bytes (--sql reads its table).

With --sql "SELECT ...", runs exactly one reading query and prints an aligned table
(NULL as NULL, BLOBs as <blob N bytes>; select hex(col) to see the bytes). Statements
that would write (INSERT, UPDATE, DELETE, CREATE, DROP, ATTACH, VACUUM, PRAGMA x = y,
...) are refused, and so is any function outside SQLite's core, math, date and JSON
functions (load_extension, fts3_tokenizer, ...). A query stops after --timeout seconds
(default 30) and on Ctrl-C, with one error line.

The file is opened read-only: no byte or mtime of it, its -wal or its -shm changes and no
side files are left, also while a live run has it open (then a private copy of the file
and its WAL is read, with its committed WAL content). A stray -wal beside a published
snapshot file is ignored, with a warning on stderr.
Before reading, PRAGMA quick_check refuses a damaged file (skip with --no-check).

Errors (missing path, a directory, not SQLite, truncated or damaged, a schema newer than
this rolloutdb, a refused query) print one line starting with "error:" and exit 2.

examples:
  rolloutdb inspect run/live.sqlite
  rolloutdb inspect ckpt/step_3/rollout_snapshots/snapshot_7/rollouts.sqlite --json
  rolloutdb inspect run/live.sqlite --sql "SELECT state, count(*) FROM prompt_groups GROUP BY state"
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="summarise a store or snapshot file, or run one read-only SQL query on it",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", metavar="PATH", type=path_argument, help="a .sqlite file (store, snapshot, segment or trace), a run or snapshot directory")
    parser.add_argument("--sql", metavar="QUERY", help="one read-only SQL statement (SELECT, WITH, PRAGMA name, ...)")
    parser.add_argument(
        "--timeout", metavar="SECONDS", type=positive_seconds, default=DEFAULT_TIMEOUT_S,
        help=f"stop a --sql query that runs longer than this (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
    parser.add_argument(
        "--no-check", action="store_true", help="skip PRAGMA quick_check (faster on very large files)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rolloutdb.commands._stop_signals import stop_signal_received
    from rolloutdb.store import (
        NotAStoreError,
        QueryTimeout,
        RecordDamaged,
        identify,
        open_readonly,
        quick_check,
        run_readonly_query,
        segment_summary,
        trace_summary,
    )

    path = inspected_file(Path(args.path))
    try:
        conn = open_readonly(path)
    except OSError as e:
        raise NotAStoreError(f"{path}: cannot read it ({e.strerror or e}); check the path and its permissions") from e
    try:
        if not args.no_check:
            quick_check(conn, path)
        segment = segment_summary(conn)
        trace_info = trace_summary(conn, path) if segment is None else None
        if trace_info is not None:
            revision = trace_info["revision"]
        elif segment is None:
            revision, status = identify(conn, path)  # one alembic_version row, known, its schema
        else:
            revision = None
        if args.sql is not None:
            try:
                columns, rows = run_readonly_query(conn, args.sql, timeout_s=args.timeout, stop=stop_signal_received)
            except QueryTimeout as e:
                raise QueryTimeout(f"{e}; pass a larger --timeout SECONDS if the query needs longer") from None
            _print_query(path, revision, columns, rows, as_json=args.json)
        elif segment is not None:
            segment = {"path": str(path), "size_bytes": path.stat().st_size, **segment}
            print(json.dumps(segment, indent=2) if args.json else render_segment(segment))
        elif trace_info is not None:
            trace_info = {"path": str(path), "size_bytes": path.stat().st_size, **trace_info}
            print(json.dumps(_trace_json(trace_info), indent=2) if args.json else render_trace(trace_info))
        else:
            assert revision is not None
            summary = summarize(conn, path, revision, status)
            print(json.dumps(_json_view(summary), indent=2, default=str) if args.json else render_summary(summary))
    except sqlite3.DatabaseError as e:
        raise NotAStoreError(f"{path}: unreadable SQLite file ({' '.join(str(e).split())}); "
                             "run `rolloutdb verify` or restore another snapshot") from e
    except RecordDamaged as e:  # the settled record's decoder names the table and row
        raise NotAStoreError(f"{path}: {e}") from None
    finally:
        conn.close()
    return 0


# ---------------------------------------------------------------- what PATH names

STORE_FILE = "rollout_state.sqlite"  # a run directory's live store, a snapshot directory's file
TRACE_FILE = "rollout_trace.sqlite"  # in a run's logs/ directory


def inspected_file(path: Path) -> Path:
    """The file a PATH names: itself, or for a run or snapshot directory its
    rollout_state.sqlite, for a run's logs/ directory its trace file."""
    from rolloutdb.store import NotAStoreError

    if not path.is_dir() or path.is_symlink() and not path.resolve().is_dir():
        return path
    for name in (STORE_FILE, TRACE_FILE):
        if (path / name).is_file():
            return path / name
    raise NotAStoreError(f"{path}: is a directory with no {STORE_FILE} or {TRACE_FILE} in it; pass a run "
                         "directory, a snapshot directory, a run's logs/ directory or a .sqlite file")


# ---------------------------------------------------------------- the summary


def upgrade_advice(path: Path) -> str:
    """How to bring an old file to head: in place, or, for a file of a published snapshot
    (never changed), into a copy."""
    from rolloutdb.store import listing_manifest

    if listing_manifest(path) is not None:
        return (f"it is a published snapshot file, never changed in place: `rolloutdb upgrade {path} --out COPY.sqlite` "
                "upgrades a copy (a resume from the snapshot upgrades a copy itself)")
    return f"run `rolloutdb upgrade {path}` to migrate it"


def _tables(conn: sqlite3.Connection) -> list[str]:
    from rolloutdb.store import STATE_TABLES

    present = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    known = [t for t in STATE_TABLES if t in present]
    others = sorted(t for t in present - set(known) if not t.startswith("sqlite_") and t != "alembic_version")
    return known + others


def _per_state(conn: sqlite3.Connection, sql: str, known: tuple[str, ...]) -> dict[str, int]:
    """Counts for every known state (0 when none) and any unknown state found."""
    found = dict(conn.execute(sql).fetchall())
    counts = {s: found.pop(s, 0) for s in known}
    counts.update(sorted((str(k), v) for k, v in found.items()))
    return counts


def summarize(conn: sqlite3.Connection, path: Path, revision: str, status: str) -> dict[str, Any]:
    from rolloutdb.store import ABANDON_REASONS, GROUP_STATES, ROLLOUT_STATES, head_revision, payload_counts, queries

    tables = _tables(conn)
    head = head_revision()
    summary: dict[str, Any] = {
        "path": str(path),
        "size_bytes": path.stat().st_size,
        "revision": revision,
        "revision_status": status,
        "head_revision": head,
        "notes": [],
    }
    if status == "old":
        summary["notes"].append(f"schema revision {revision} is older than head {head}; {upgrade_advice(path)}")
    meta = conn.execute(
        "SELECT run_id, mutation_counter, replay_capacity, ledger_dispatch, config_fingerprint FROM run_meta"
    ).fetchone()
    if meta is None:
        summary["notes"].append("run_meta is empty: the store was never initialised")
        meta = (None, None, None, None, None)
    summary.update(
        run_id=meta[0], mutation_counter=meta[1], ledger_dispatch=None if meta[3] is None else bool(meta[3]),
        config_fingerprint=meta[4],
    )
    cursor = conn.execute("SELECT next_seq, epoch, seed, stamping FROM sampler_state").fetchone()
    summary["sampler"] = dict(zip(("next_seq", "epoch", "seed", "stamping"), cursor)) if cursor else None
    summary["replay_permits"] = {
        "used": conn.execute("SELECT count(*) FROM replay_groups").fetchone()[0],
        "capacity": meta[2],
    }
    summary["row_counts"] = {t: conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
    summary["groups"] = _per_state(conn, "SELECT state, count(*) FROM prompt_groups GROUP BY state", GROUP_STATES)
    # v1_4_a on: settled groups are no ledger rows but a compacted record (v1_5_a:
    # `settled_steps`, one row per step), counted through the store's one reader of it.
    for outcome, n in queries.settled_counts(conn).items():
        if n:
            summary["groups"][outcome] = summary["groups"].get(outcome, 0) + n
    # v1_12_a: the steps older than the kept ones are counts, not settled_steps rows.
    prefix = queries.settled_prefix(conn)
    summary["settled_prefix"] = {"folded_below": prefix.seq_end, "through_step": prefix.through_step}
    summary["rollouts"] = _per_state(conn, "SELECT state, count(*) FROM rollouts GROUP BY state", ROLLOUT_STATES)
    summary["abandon_reasons"] = _per_state(
        conn,
        "SELECT abandon_reason, count(*) FROM rollouts WHERE state = 'abandoned' GROUP BY abandon_reason",
        ABANDON_REASONS,
    )
    summary["payload"] = payload_counts(conn)
    summary["manifest"] = read_manifest_beside(path, revision, summary["notes"])
    return summary


def read_manifest_beside(path: Path, revision: str | None, notes: list[str]) -> dict[str, Any] | None:
    """The manifest.json next to `path`, read tolerantly: whatever is missing or malformed
    becomes a note, never an error (inspect reads, verify judges)."""
    manifest_path = path.parent / MANIFEST_NAME
    if not manifest_path.is_file():
        return None
    try:
        data = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        why = " ".join(str(e).split())[:200]
        notes.append(f"{manifest_path}: unreadable manifest ({why}); `rolloutdb verify` checks it")
        return None
    if not isinstance(data, dict):
        notes.append(f"{manifest_path}: manifest is not a JSON object; `rolloutdb verify` checks it")
        return None
    found = {key: data.get(key) for key in ("kind", "anchor", "sequence", "cut_time", "schema_revision", "mutation_counter")}
    missing = [k for k in ("anchor", "cut_time", "kind", "sequence") if data.get(k) is None]
    if missing and not (missing == ["sequence"] and data.get("kind") == "trainer_checkpoint"):
        notes.append(f"{manifest_path}: manifest lacks {', '.join(missing)}")
    cut = found["cut_time"]
    if cut is not None and not (isinstance(cut, (int, float)) and not isinstance(cut, bool) and math.isfinite(cut)):
        notes.append(f"{manifest_path}: cut_time {cut!r} is not a number of seconds")
        found["cut_time"] = cut = None
    if found["schema_revision"] not in (None, revision):
        notes.append(f"manifest says schema revision {found['schema_revision']}, the file holds {revision}")
    files = data.get("files")
    if isinstance(files, list) and files and all(isinstance(f, dict) for f in files):
        if path.name not in {str(f.get("path")) for f in files}:
            notes.append(f"{manifest_path}: manifest does not list {path.name}; it may describe another file")
    return found


def _json_view(s: dict[str, Any]) -> dict[str, Any]:
    """The summary as --json prints it: times as ISO-8601 UTC strings, never epoch floats."""
    m = s["manifest"]
    if m is None or m.get("cut_time") is None:
        return s
    return {**s, "manifest": {**m, "cut_time": iso_utc(m["cut_time"])}}


def render_summary(s: dict[str, Any]) -> str:
    status = {"head": "head", "old": f"old; head is {s['head_revision']}"}[s["revision_status"]]
    lines = [
        f"file              {s['path']} ({_size(s['size_bytes'])})",
        f"schema revision   {s['revision']} ({status})",
    ]
    m = s["manifest"]
    if m is not None:
        seq = f" #{m['sequence']}" if m.get("sequence") is not None else ""
        lines.append(f"manifest          {m.get('kind') or '?'}{seq}, anchor {m.get('anchor') or '?'}")
        if m.get("cut_time") is not None:
            since = ago(time.time() - m["cut_time"])
            lines.append(f"cut time          {iso_utc(m['cut_time'])} ({since} ago)")
    lines.append(f"run id            {s['run_id']}")
    lines.append(f"mutation counter  {s['mutation_counter']}")
    c = s["sampler"]
    if c is not None:
        lines.append(f"sampler cursor    next_seq {c['next_seq']}, epoch {c['epoch']}, seed {c['seed']}, stamping {c['stamping']}")
    r = s["replay_permits"]
    lines.append(f"replay permits    {r['used']} used of {r['capacity']}")
    if s["ledger_dispatch"] is False:
        lines.append("ledger dispatch   off (the ledger stays empty by design)")
    lines.append("ledger groups     " + _states(s["groups"]))
    f = s["settled_prefix"]
    if f["folded_below"]:
        steps = f"steps 1-{f['through_step']}" if f["through_step"] is not None else "discards only"
        lines.append(f"settled record    positions below {f['folded_below']} folded into counts ({steps}; "
                     "settled_prefix), later steps one row each (settled_steps)")
    abandoned = ", ".join(f"{k} {v}" for k, v in s["abandon_reasons"].items() if v)
    lines.append("rollouts          " + _states(s["rollouts"]) + (f" ({abandoned})" if abandoned else ""))
    p = s["payload"]
    lines.append(f"sample payload    {p['inline']} inline, {p['in_segments']} in {p['segments']} payload segment(s)"
                 + (" (CHECKPOINT_DIR/payload_segments/)" if p["segments"] else ""))
    lines.append("rows per table")
    width = max((len(t) for t in s["row_counts"]), default=0)
    for table, n in s["row_counts"].items():
        lines.append(f"  {table:<{width}}  {n:>10}")
    lines += [f"note: {n}" for n in s["notes"]]
    return "\n".join(lines)


def render_segment(s: dict[str, Any]) -> str:
    ids = f", ids {s['first_sample_id']}..{s['last_sample_id']}" if s["samples"] else ""
    return "\n".join([
        f"file              {s['path']} ({_size(s['size_bytes'])})",
        f"kind              payload segment (format {s['format']}): finished samples' payload, written once",
        f"samples           {s['samples']} samples{ids}",
        f"payload           {s['tokens']} tokens, {_size(s['payload_bytes'])} (token ids int32, logprobs float32)",
        "note: the store that references it records its size and BLAKE3; `rolloutdb verify` of the snapshot or "
        "run directory checks it",
    ])


def _trace_json(s: dict[str, Any]) -> dict[str, Any]:
    """The trace summary as --json prints it: times as ISO-8601 UTC strings."""
    runs = [{**r, "first_t": iso_utc(r["first_t"]), "last_t": iso_utc(r["last_t"])} for r in s["runs"]]
    return {**s, "runs": runs}


def render_trace(s: dict[str, Any]) -> str:
    status = {"head": "head", "old": f"old; head is {s['head_revision']}, `rolloutdb trace` reads it through an "
              "upgraded copy", "newer": f"newer than this rolloutdb knows (head {s['head_revision']})"}
    lines = [
        f"file              {s['path']} ({_size(s['size_bytes'])})",
        "kind              a run's trace (events of every process that worked on the run)",
        f"trace revision    {s['revision']} ({status[s['revision_status']]})",
        f"runs              {len(s['runs'])} process(es) wrote to it",
    ]
    for r in s["runs"]:
        lines.append(f"  run {r['run']}  pid {r['pid']} on {r['host']}, {iso_utc(r['first_t'])} .. "
                     f"{iso_utc(r['last_t'])}, last seq {r['last_seq']}")
    lines.append("rows per table")
    width = max((len(t) for t in s["row_counts"]), default=0)
    for table, n in s["row_counts"].items():
        lines.append(f"  {table:<{width}}  {n:>10}")
    lines.append("note: `rolloutdb trace RUN_DIR` reports what each stop cost; `rolloutdb sql RUN_DIR` queries "
                 "it beside the store (docs/trace.md, docs/schema.md)")
    return "\n".join(lines)


def _states(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)



# ---------------------------------------------------------------- --sql


def _print_query(path: Path, revision: str | None, columns: list[str], rows: list[tuple], *, as_json: bool) -> None:
    if as_json:
        doc = {
            "path": str(path),
            "revision": revision,
            "columns": columns,
            "rows": [[json_cell(v) for v in row] for row in rows],
            "row_count": len(rows),
        }
        print(json.dumps(doc, indent=2, default=str))
    elif not columns:
        print("(statement returned no columns)")
    else:
        print(format_table(columns, rows))
