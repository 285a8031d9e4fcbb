"""`rolloutdb sql PATH... [-q QUERY | QUERY] [--format table|csv|json]`: one SQL query over
every SQLite file of a run, in DuckDB, read-only.

Each PATH contributes files under schema names a user can guess (the DESCRIPTION below
is the reference, repeated in README.md's Commands); `rolloutdb.store.AttachedFiles`
attaches them (the bundled sqlite extension, no network, nothing written) and runs the
query. Without a query it lists what was attached: schema, table, columns.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from rolloutdb.commands._arguments import DEFAULT_TIMEOUT_S, path_argument, positive_seconds
from rolloutdb.commands._tables import FORMATS, format_result

DESCRIPTION = """\
Run one SQL query (DuckDB's dialect) over the SQLite files of a run, read-only, and print
the result. Without a query, list the attached schemas, their tables and columns.

Each PATH is attached under these schema names:
  a run directory         live          RUN_DIR/rollout_state.sqlite, the live store
                          trace         RUN_DIR/logs/rollout_trace.sqlite (trace.enabled: true)
                          snapshot_<N>  every published rollout snapshot, named as its
                                        directory (CHECKPOINT_DIR/<anchor>/rollout_snapshots/
                                        snapshot_<N>/rollout_state.sqlite; the highest N is the newest)
                          segment_<N>   every payload segment (CHECKPOINT_DIR/payload_segments/
                                        segment_<N>.sqlite, one table `payload`)
  a checkpoint directory  snapshot_<N>, segment_<N>, as above
  a snapshot directory    snapshot_<N> (its directory's name), and the segment_<N> of
                          its checkpoint directory
  a .sqlite file          live (a store), snapshot_<N> (a published snapshot's file),
                          trace (rollout_trace.sqlite) or segment_<N>
A name that a later PATH gives again gets _2, _3, ... appended. Unqualified table names
read the first PATH's live store, snapshot or file: `FROM rollouts` is `FROM live.rollouts`
for a run directory. The tables and their columns: docs/schema.md.

BLOBs print as <blob N bytes> (select hex(col), or decode them as docs/schema.md says).
Nothing is written anywhere: the files are attached read-only (a live store, or a file
with a -wal beside it, through a private copy in a temporary directory, removed after);
DuckDB can open no other file (COPY ... TO, read_csv, ATTACH, INSTALL are refused).
A query stops after --timeout seconds (default 30), with one line naming the option.

examples:
  rolloutdb sql runs/quickstart                       # what is attached
  rolloutdb sql runs/quickstart "SELECT state, count(*) FROM rollouts GROUP BY state"
  rolloutdb sql runs/quickstart --format csv -q "SELECT step, count(*) AS groups
      FROM trace.group_sealed GROUP BY step ORDER BY step"
  rolloutdb sql runs/quickstart "SELECT s.sample_id, length(p.token_ids) / 4 AS tokens
      FROM snapshot_7.samples s JOIN segment_3.payload p ON p.sample_id = s.sample_id"
"""

LIVE, TRACE = "live", "trace"
STORE_FILE = "rollout_state.sqlite"  # a run's live store and a snapshot's file alike
TRACE_FILE = "rollout_trace.sqlite"
_NUMBERED = re.compile(r"^(snapshot|segment)_(\d+)$")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sql",
        help="one SQL query (DuckDB) over a run's store, snapshots, segments and trace, read-only",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("items", nargs="+", metavar="PATH [QUERY]",
                        help="run, checkpoint or snapshot directories or .sqlite files; then the query "
                             "(or pass it with -q)")
    parser.add_argument("-q", "--query", metavar="QUERY", help="the query (then every positional is a PATH)")
    parser.add_argument("--format", choices=FORMATS, default="table", help="how to print the result (default table)")
    parser.add_argument(
        "--timeout", metavar="SECONDS", type=positive_seconds, default=DEFAULT_TIMEOUT_S,
        help=f"stop a query that runs longer than this (default {DEFAULT_TIMEOUT_S:g}), as inspect --sql does",
    )
    parser.set_defaults(func=run)


def split_paths_and_query(items: list[str], query: str | None) -> tuple[list[Path], str | None]:
    """`PATH... QUERY`: the last item is the query unless -q gave it or it is a path that
    exists (then there is no query: list what is attached)."""
    if query is None and len(items) > 1 and not Path(items[-1]).exists():
        items, query = items[:-1], items[-1]
    try:
        return [path_argument(item) for item in items], query
    except argparse.ArgumentTypeError as e:  # argparse's type, raised here outside argparse
        raise ValueError(f"{e}; pass a run, checkpoint or snapshot directory or a .sqlite file") from None


def run(args: argparse.Namespace) -> int:
    from rolloutdb.commands._stop_signals import stop_signal_received
    from rolloutdb.store import AttachedFiles, QueryTimeout

    paths, query = split_paths_and_query(args.items, args.query)
    if query is not None and not query.strip():
        raise ValueError("the query is empty; pass one SQL statement, or none to list the attached tables")
    files: dict[str, Path] = {}
    default = None
    for path in paths:
        found, main = files_of(path)
        renamed = {name: _free_name(name, files) for name in found}
        for name, file in found.items():
            files[renamed[name]] = file
        if default is None and main is not None:
            default = renamed[main]
    with AttachedFiles(files, default=default) as attached:
        try:
            table = attached.query(query, timeout_s=args.timeout, stop=stop_signal_received) if query is not None else attached.catalog()
        except QueryTimeout as e:
            raise QueryTimeout(f"{e}; pass a larger --timeout SECONDS if the query needs longer") from None
    if query is None:
        rows = [(schema, name, columns) for schema, name, columns in table.rows]
        print(format_result(["schema", "table", "columns"], rows, args.format))
    elif not table.columns:
        print("(statement returned no columns)")
    else:
        print(format_result(table.columns, table.rows, args.format))
    return 0


def _free_name(name: str, taken: dict[str, Path]) -> str:
    if name not in taken:
        return name
    n = 2
    while f"{name}_{n}" in taken:
        n += 1
    return f"{name}_{n}"


def files_of(path: Path) -> tuple[dict[str, Path], str | None]:
    """The files `path` contributes, by schema name, and the one unqualified names read."""
    from rolloutdb.controller.run.run_dir import RunDir
    from rolloutdb.store import NotAStoreError

    if not path.exists():
        raise NotAStoreError(f"{path}: no such file or directory; pass a run, checkpoint or snapshot directory "
                             "or a .sqlite file")
    if path.is_file():
        name = file_schema(path)
        return {name: path}, name
    if not path.is_dir():
        raise NotAStoreError(f"{path}: not a regular file or directory; pass a run directory or a .sqlite file")
    run_dir = RunDir(path)
    if run_dir.is_run_dir():
        files = {LIVE: run_dir.store}
        if run_dir.trace.is_file():
            files[TRACE] = run_dir.trace
        return {**files, **checkpoint_files(run_dir.checkpoints)}, LIVE
    if (path / "manifest.json").is_file() and (path / STORE_FILE).is_file():
        name = path.name if _NUMBERED.match(path.name) else "snapshot"
        segments = {}
        if path.parent.name == "rollout_snapshots":  # CHECKPOINT_DIR/<anchor>/rollout_snapshots/<it>
            segments = segment_files(path.parents[2])
        return {name: path / STORE_FILE, **segments}, name
    files = checkpoint_files(path)
    if files:
        return files, None
    if (path / TRACE_FILE).is_file():  # a run's logs/ directory
        return {TRACE: path / TRACE_FILE}, TRACE
    raise NotAStoreError(f"{path}: no rolloutdb files in it; pass a run directory (holding {STORE_FILE} and "
                         "config.yaml), a checkpoint or snapshot directory, or a .sqlite file")


def file_schema(path: Path) -> str:
    """The schema name of a single file, from where it lies and what it is named."""
    from rolloutdb.store import listing_manifest

    if path.name == TRACE_FILE:
        return TRACE
    if _NUMBERED.match(path.stem):
        return path.stem  # segment_<N>.sqlite
    if path.name == STORE_FILE and listing_manifest(path) is not None:
        return path.parent.name if _NUMBERED.match(path.parent.name) else "snapshot"
    if path.name == STORE_FILE:
        return LIVE
    stem = re.sub(r"[^a-z0-9_]", "_", path.stem.lower())
    return stem if stem and not stem[0].isdigit() else f"file_{stem}"


def checkpoint_files(checkpoint_dir: Path) -> dict[str, Path]:
    """Every published snapshot (by its directory's name) and payload segment of a
    checkpoint directory."""
    from rolloutdb.store import scan

    if not checkpoint_dir.is_dir():
        return {}
    snapshots = {e.path.name: e.path / STORE_FILE for e in scan(checkpoint_dir).complete_snapshots()}
    return {**snapshots, **segment_files(checkpoint_dir)}


def segment_files(checkpoint_dir: Path) -> dict[str, Path]:
    from rolloutdb.store import segments_dir_of

    found = {p.stem: p for p in segments_dir_of(checkpoint_dir).glob("segment_*.sqlite") if _NUMBERED.match(p.stem)}
    return {name: found[name] for name in sorted(found, key=lambda n: int(n.rpartition("_")[2]))}
