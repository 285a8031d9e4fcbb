"""DuckDB over trace files: the three figures of `rolloutdb trace`.

DuckDB reads the SQLite trace files in place (``ATTACH ... (TYPE sqlite, READ_ONLY)``)
through the sqlite_scanner extension that the ``duckdb-extension-sqlite-scanner`` wheel
ships as a file inside the package (``extensions/v<duckdb version>/``). We LOAD that file
by path, with auto-install and auto-load off and every directory DuckDB could write to
(extension directory, home directory, spill directory) inside a temporary directory that
is removed afterwards: no network, and nothing written to ``~/.duckdb``.

The SQL itself lives in `trace_queries`; this module only stacks the files into the base
views those queries read (see its docstring) and runs them. `open_sqlite_analysis` builds
the same views in plain SQLite, which runs the same statements (tests compare the two;
the benchmark times them).
"""

from __future__ import annotations

import importlib.util
import shutil
import sqlite3
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from . import trace_queries
from .trace import TraceError

EVENT_COLUMNS = (
    "seq, t, run_id, event, prompt_id, generation_index, group_id, attempt, step, "
    "policy_version, reason, fields"
)
_BASE_TABLES = {
    "events": EVENT_COLUMNS,
    "version_tokens": "seq, policy_version, tokens",
    "event_groups": "seq, group_id",
}


@dataclass(frozen=True)
class Table:
    """A query result: column names and rows."""

    columns: list[str]
    rows: list[tuple]

    def as_dicts(self) -> list[dict]:
        return [dict(zip(self.columns, row)) for row in self.rows]


def sqlite_scanner_file(duckdb_version: str) -> Path:
    """The sqlite_scanner extension file shipped by the duckdb-extension-sqlite-scanner
    wheel for this DuckDB version (``v1.5.5``)."""
    spec = importlib.util.find_spec("duckdb_extension_sqlite_scanner")
    if spec is None or not spec.submodule_search_locations:
        raise TraceError(
            "DuckDB's sqlite extension is not installed; "
            f"pip install duckdb-extension-sqlite-scanner=={duckdb_version.lstrip('v')}"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / "extensions" / duckdb_version / "sqlite_scanner.duckdb_extension"
    if not path.is_file():
        found = sorted(p.parent.name for p in root.glob("extensions/*/sqlite_scanner.duckdb_extension"))
        raise TraceError(
            f"no sqlite extension for DuckDB {duckdb_version} (the installed wheel has {found or 'none'}); "
            f"install duckdb-extension-sqlite-scanner matching duckdb {duckdb_version.lstrip('v')}"
        )
    return path


def connect_duckdb(work_dir: Path):
    """An in-memory DuckDB that can read SQLite files and writes only under `work_dir`."""
    import duckdb

    work_dir.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect(
        ":memory:",
        config={
            "extension_directory": str(work_dir / "extensions"),
            "home_directory": str(work_dir),
            "temp_directory": str(work_dir / "spill"),
            "autoinstall_known_extensions": False,
            "autoload_known_extensions": False,
            "allow_community_extensions": False,
            "preserve_insertion_order": False,  # every figure sorts its own output
        },
    )
    try:
        version = con.execute("PRAGMA version").fetchone()[0]
        con.execute(f"LOAD '{_sql_string(sqlite_scanner_file(version))}'")
    except BaseException:
        con.close()
        raise
    return con


def _sql_string(value: str | Path) -> str:
    return str(value).replace("'", "''")


def _dedupe(paths: Sequence[str | Path]) -> list[Path]:
    seen, out = set(), []
    for p in paths:
        key = Path(p).resolve()
        if key not in seen:
            seen.add(key)
            out.append(Path(p))
    return out


def base_view_statements(aliases: dict[str, list[str]], *, kind: str = "VIEW") -> list[str]:
    """Statements stacking the attached files of each job ('run', 'baseline') into
    `events`, `version_tokens` and `event_groups`: views, or (kind="TABLE") copies."""
    statements = []
    for table, columns in _BASE_TABLES.items():
        parts = [
            f"SELECT '{job}' AS job, {src} AS src, {columns} FROM {alias}.{table}"
            for job, job_aliases in aliases.items()
            for src, alias in enumerate(job_aliases)
        ]
        statements.append(f"CREATE TEMP {kind} {table} AS\n" + "\nUNION ALL\n".join(parts))
    return statements


def derived_view_statements() -> list[str]:
    """The views of `trace_queries.VIEWS`; the small ones that every figure reads many
    times (one row per run, per stop) are computed once, as tables."""
    return [
        f"CREATE TEMP {'TABLE' if name in trace_queries.MATERIALIZED else 'VIEW'} {name} AS\n{sql}"
        for name, sql in trace_queries.VIEWS.items()
    ]


class TraceAnalysis:
    """The traces of one job (`runs`: every file it wrote, across stops) and optionally
    of a baseline run that never stopped, attached read-only in an in-memory DuckDB."""

    def __init__(self, runs: Sequence[str | Path], baseline: Sequence[str | Path] = ()):
        runs, baseline = _dedupe(runs), _dedupe(baseline)
        if not runs:
            raise TraceError("no trace files to analyse; pass at least one run directory")
        for path in (*runs, *baseline):
            if not Path(path).is_file():
                raise TraceError(f"{path}: no such trace file")
        self.has_baseline = bool(baseline)
        self._work_dir = Path(tempfile.mkdtemp(prefix="rolloutdb-duckdb-"))
        self.con = None
        try:
            self.con = connect_duckdb(self._work_dir)
            aliases: dict[str, list[str]] = {"run": [], "baseline": []}
            for job, paths, prefix in (("run", runs, "r"), ("baseline", baseline, "b")):
                for i, path in enumerate(paths):
                    alias = f"{prefix}{i}"
                    self._attach(path, alias)
                    aliases[job].append(alias)
            # One scan of each SQLite table into DuckDB's columnar memory: the figures
            # read `events` several times each, and every read of an attached table is
            # a scan through SQLite (measured at 2M events: 2-3x slower over the figures).
            for statement in base_view_statements(aliases, kind="TABLE") + derived_view_statements():
                self.con.execute(statement)
        except BaseException:
            self.close()
            raise

    def _attach(self, path: Path, alias: str) -> None:
        import duckdb

        try:
            self.con.execute(f"ATTACH '{_sql_string(Path(path).resolve())}' AS {alias} (TYPE sqlite, READ_ONLY)")
            self.con.execute(f"SELECT count(*) FROM {alias}.events WHERE seq < 0").fetchone()
        except duckdb.Error as e:
            raise TraceError(f"{path}: not a readable trace file ({str(e).splitlines()[0]})") from e

    def attach_snapshot(self, path: str | Path, alias: str) -> None:
        """Attach a rollout snapshot file read-only, to join its tables (``alias.prompt_groups``,
        ...) with the trace in your own queries."""
        import duckdb

        try:
            self.con.execute(f"ATTACH '{_sql_string(Path(path).resolve())}' AS {alias} (TYPE sqlite, READ_ONLY)")
        except duckdb.Error as e:
            raise TraceError(f"{path}: not a readable snapshot file ({str(e).splitlines()[0]})") from e

    def query(self, name_or_sql: str) -> Table:
        """Run a named query of `trace_queries.QUERIES` (or any SQL over the views)."""
        sql = trace_queries.QUERIES.get(name_or_sql, name_or_sql)
        cur = self.con.execute(sql)
        return Table([d[0] for d in cur.description], cur.fetchall())

    def report(self) -> dict[str, Table]:
        """Every figure of `trace_queries.QUERIES`, by name."""
        return {name: self.query(name) for name in trace_queries.QUERIES}

    def close(self) -> None:
        if self.con is not None:
            self.con.close()
            self.con = None
        shutil.rmtree(self._work_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_sqlite_analysis(runs: Sequence[str | Path], baseline: Sequence[str | Path] = ()) -> sqlite3.Connection:
    """The same views in plain SQLite (files attached read-only): runs every statement of
    `trace_queries` unchanged. For comparisons and benchmarks; `rolloutdb trace` uses DuckDB."""
    runs, baseline = _dedupe(runs), _dedupe(baseline)
    conn = sqlite3.connect("file::memory:", uri=True, isolation_level=None)
    aliases: dict[str, list[str]] = {"run": [], "baseline": []}
    for job, paths, prefix in (("run", runs, "r"), ("baseline", baseline, "b")):
        for i, path in enumerate(paths):
            path = Path(path).resolve()
            uri = f"file:{quote(str(path))}?mode=ro"
            if not Path(f"{path}-wal").exists():
                uri += "&immutable=1"  # no writer: read without locks or side files
            conn.execute(f"ATTACH '{_sql_string(uri)}' AS {prefix}{i}")
            aliases[job].append(f"{prefix}{i}")
    for statement in base_view_statements(aliases) + derived_view_statements():
        conn.execute(statement)
    return conn


def sqlite_query(conn: sqlite3.Connection, name_or_sql: str) -> Table:
    cur = conn.execute(trace_queries.QUERIES.get(name_or_sql, name_or_sql))
    return Table([d[0] for d in cur.description], cur.fetchall())
