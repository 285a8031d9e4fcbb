"""DuckDB over trace files: the figures of `rolloutdb trace`.

DuckDB reads the SQLite trace files in place (``ATTACH ... (TYPE sqlite, READ_ONLY)``)
through the sqlite_scanner extension that the ``duckdb-extension-sqlite-scanner`` wheel
ships as a file inside the package (``extensions/v<duckdb version>/``). We LOAD that file
by path, with auto-install and auto-load off and every directory DuckDB could write to
(extension directory, home directory, spill directory) inside a temporary directory that
is removed afterwards: no network, and nothing written to ``~/.duckdb``.

The SQL itself lives in `trace_queries`; this module only stacks the files into the base
tables those queries read (see its docstring) and runs them. Each base table is one
table of the trace file (one event type: `rolloutdb.store.trace.events`), of which DuckDB copies
only the columns the figures read, in one scan. The exceptions are the per-call and
per-turn tables (`attempt_dispatched`, the largest, `call_finished`, `turn_committed`), of
which the figures need only the rows of attempts abandoned with reason 'restart': DuckDB's
scanner pushes no filter or join down to SQLite, so we send that semi-join to SQLite
(`sqlite_query`, answered from each table's (group_id, generation_index, attempt) index)
and copy only its answer.

A trace file of an older revision is upgraded in a copy in the working directory, and
one with a ``-wal`` beside it (a live or killed run's) is read through a private copy
(`standalone`); the file, its -wal and its -shm are never changed. `open_sqlite_analysis` builds the same base tables as
views in plain SQLite, which runs the same statements (tests compare the two; the
benchmark times them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from ..fsio import make_work_dir, work_dir_name
from ..sqlite.readonly import PrivateCopyConnection, private_copy
from ..sqlite.revision import file_revision, run_trace_migrations, trace_head_revision, trace_known_revisions
from . import queries as trace_queries
from .interrupts import interruptible
from .writer import TraceError

# The base table of trace_queries -> its table in a trace file, where the names differ.
_FILE_TABLE = {"trace_runs": "runs"}
# Semi-joined in SQLite for DuckDB (see the module docstring).
_SEMI_JOINED = ("attempt_dispatched", "call_finished", "turn_committed", "call_cut")
_DUCKDB_TYPES = {"seq": "BIGINT", "t": "DOUBLE", "run": "BIGINT", "group_id": "BIGINT", "prompt_id": "BIGINT",
                 "generation_index": "BIGINT", "attempt": "BIGINT", "turn": "BIGINT", "tokens": "BIGINT",
                 "prefix_tokens": "BIGINT"}


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


def base_view_statements(aliases: dict[str, list[str]], *, kind: str = "VIEW",
                         skip: frozenset[str] = frozenset()) -> list[str]:
    """Statements stacking the attached files of each job ('run', 'baseline') into the
    base tables of `trace_queries.BASE_COLUMNS`: views, or (kind="TABLE") copies."""
    statements = []
    for table, columns in trace_queries.BASE_COLUMNS.items():
        if table in skip:
            continue
        parts = [
            f"SELECT '{job}' AS job, {src} AS src, {columns} FROM {alias}.{_FILE_TABLE.get(table, table)}"
            for job, job_aliases in aliases.items()
            for src, alias in enumerate(job_aliases)
        ]
        statements.append(f"CREATE TEMP {kind} {table} AS\n" + "\nUNION ALL\n".join(parts))
    return statements


def _as_text(column: str) -> str:
    # sqlite_query hands every value over as text; SQLite writes a REAL with 15
    # significant digits unless told otherwise, and 17 are needed to get the same double
    # back (the thrown-away time is a difference of two wall times: microseconds count).
    return f"printf('%!.17g', d.{column}) AS {column}" if _DUCKDB_TYPES[column] == "DOUBLE" else f"d.{column}"


def _semi_joined(con, aliases: dict[str, list[str]]) -> None:
    """The `_SEMI_JOINED` tables in DuckDB: only the rows of attempts abandoned with
    reason 'restart' (what THROWN_AWAY_ATTEMPTS and KEPT_ATTEMPTS read), looked up by
    SQLite itself."""
    keys: dict[str, list] = {}
    for job, group, p, i, a in con.execute(
            "SELECT DISTINCT job, group_id, prompt_id, generation_index, attempt FROM attempt_abandoned "
            "WHERE reason = 'restart' AND group_id IS NOT NULL AND prompt_id IS NOT NULL").fetchall():
        keys.setdefault(job, []).append([group, p, i, a])
    # The dispatch of the attempt that replaced each abandoned one carries its prefix.
    next_keys = {job: ks + [[group, p, i, a + 1] for group, p, i, a in ks] for job, ks in keys.items()}
    for table in _SEMI_JOINED:
        columns = trace_queries.BASE_COLUMNS[table].split(", ")
        con.execute(f"CREATE TEMP TABLE {table} (job VARCHAR, src INTEGER, "
                    + ", ".join(f"{c} {_DUCKDB_TYPES[c]}" for c in columns) + ")")
        for job, job_keys in (next_keys if table == "attempt_dispatched" else keys).items():
            # The abandonment may be in another file of the job than the rows: ask each.
            inner = attempt_rows_sql(table, columns, job_keys)
            for src, alias in enumerate(aliases[job]):
                # sqlite_query returns text: cast back to the columns' types.
                casts = ", ".join(f"CAST({c} AS {_DUCKDB_TYPES[c]})" for c in columns)
                con.execute(f"INSERT INTO {table} SELECT '{job}', {src}, {casts} "
                            f"FROM sqlite_query('{alias}', '{_sql_string(inner)}')")


def attempt_rows_sql(table: str, columns: Sequence[str], keys: Sequence[Sequence[int]]) -> str:
    """The SQLite statement that reads `table`'s rows of the attempts `keys` ([group_id,
    prompt_id, generation_index, attempt] each), `columns` as text: a search of the
    table's (group_id, generation_index, attempt) index per key (trace_v1_6_a), so its
    cost follows the attempts asked for, not the trace's size."""
    return (
        f"SELECT {', '.join(_as_text(c) for c in columns)} FROM json_each('{json.dumps([list(k) for k in keys])}') k "
        f"JOIN {table} d ON d.group_id = json_extract(k.value, '$[0]') "
        "AND d.generation_index = json_extract(k.value, '$[2]') AND d.attempt = json_extract(k.value, '$[3]') "
        "AND d.prompt_id = json_extract(k.value, '$[1]')"
    )


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

    def __init__(self, runs: Sequence[str | Path], baseline: Sequence[str | Path] = (), *,
                 stop: Callable[[], int | None] | None = None):
        """`stop`: a stop signal the caller recorded whose exception may have been lost
        (`interruptible`'s `stop`): the analysis stops at its next DuckDB statement."""
        self._stop = stop
        runs, baseline = _dedupe(runs), _dedupe(baseline)
        if not runs:
            raise TraceError("no trace files to analyse; pass at least one run directory")
        for path in (*runs, *baseline):
            if not Path(path).is_file():
                raise TraceError(f"{path}: no such trace file")
        self.has_baseline = bool(baseline)
        self._work_dir = work_dir_name("rolloutdb-duckdb-")
        self.con = None
        try:
            with self._interruptible():  # a signal inside DuckDB: see interrupts.py
                self.con = connect_duckdb(make_work_dir(self._work_dir))
            aliases: dict[str, list[str]] = {"run": [], "baseline": []}
            for job, paths, prefix in (("run", runs, "r"), ("baseline", baseline, "b")):
                for i, path in enumerate(paths):
                    alias = f"{prefix}{i}"
                    readable = standalone(path, self._work_dir / "live", alias)
                    self._attach(at_head(readable, self._work_dir / "upgraded" / f"{alias}.sqlite", shown=path),
                                 alias, path)
                    aliases[job].append(alias)
            # One scan of each table the figures read into DuckDB's columnar memory, only
            # its columns: the figures read some tables several times each, and every read
            # of an attached table is a scan through SQLite.
            with self._interruptible():
                for statement in base_view_statements(aliases, kind="TABLE", skip=frozenset(_SEMI_JOINED)):
                    self.con.execute(statement)
                _semi_joined(self.con, aliases)
                for statement in derived_view_statements():
                    self.con.execute(statement)
        except BaseException:
            self.close()
            raise

    def _interruptible(self):
        """Every DuckDB statement of the analysis runs inside this: a stop signal, or one
        recorded before (`stop`), interrupts it (interrupts.py)."""
        return interruptible(lambda: self.con, stop=self._stop)

    def _attach(self, path: Path, alias: str, named: Path) -> None:
        import duckdb

        try:
            with self._interruptible():
                self.con.execute(f"ATTACH '{_sql_string(Path(path).resolve())}' AS {alias} (TYPE sqlite, READ_ONLY)")
                self.con.execute(f"SELECT count(*) FROM {alias}.runs WHERE run < 0").fetchone()
        except duckdb.Error as e:
            raise TraceError(f"{named}: not a readable trace file ({str(e).splitlines()[0]})") from e

    def attach_snapshot(self, path: str | Path, alias: str) -> None:
        """Attach a rollout snapshot file read-only, to join its tables (``alias.prompt_groups``,
        ...) with the trace in your own queries."""
        import duckdb

        try:
            with self._interruptible():
                self.con.execute(f"ATTACH '{_sql_string(Path(path).resolve())}' AS {alias} (TYPE sqlite, READ_ONLY)")
        except duckdb.Error as e:
            raise TraceError(f"{path}: not a readable snapshot file ({str(e).splitlines()[0]})") from e

    def query(self, name_or_sql: str) -> Table:
        """Run a named query of `trace_queries.QUERIES` (or any SQL over the views)."""
        sql = trace_queries.QUERIES.get(name_or_sql, name_or_sql)
        with self._interruptible():
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
    conn = sqlite3.connect("file::memory:", uri=True, isolation_level=None, factory=PrivateCopyConnection)
    conn.tmpdir = work_dir_name("rolloutdb-analysis-")  # removed when conn closes
    try:
        make_work_dir(conn.tmpdir)
        aliases: dict[str, list[str]] = {"run": [], "baseline": []}
        for job, paths, prefix in (("run", runs, "r"), ("baseline", baseline, "b")):
            for i, path in enumerate(paths):
                readable = at_head(standalone(path, Path(conn.tmpdir), f"{prefix}{i}"), None, shown=path)
                conn.execute(f"ATTACH '{_sql_string(_readonly_uri(readable))}' AS {prefix}{i}")
                aliases[job].append(f"{prefix}{i}")
        for statement in base_view_statements(aliases) + derived_view_statements():
            conn.execute(statement)
    except BaseException:
        conn.close()
        raise
    return conn


def standalone(path: str | Path, work_dir: Path, name: str) -> Path:
    """`path` itself when no WAL is beside it and its header is not in WAL mode; else a
    private copy of the file and its WAL (`readonly.private_copy`), folded into one file
    in `work_dir`. A trace that a run still writes, or that a killed run left, is never
    opened in place: a read-only SQLite connection (ours or DuckDB's scanner) writes into
    its -shm. A WAL-mode file with no WAL beside it (a live store after a clean stop)
    would get a -wal and a -shm created by DuckDB's scanner. The copy costs one read of
    the file, as for `rolloutdb inspect` of a live store."""
    path = Path(path)
    if not Path(f"{path}-wal").exists() and not _wal_mode_header(path):
        return path
    work_dir.mkdir(parents=True, exist_ok=True)
    copy = private_copy(path, work_dir, f"{name}.sqlite")
    with contextlib.closing(sqlite3.connect(copy, isolation_level=None)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode = DELETE")
    return copy


def _wal_mode_header(path: Path) -> bool:
    """Whether the SQLite header says WAL mode (file format versions at bytes 18-19 are 2)."""
    try:
        with open(path, "rb") as f:
            header = f.read(20)
    except OSError:
        return False  # the attach names the problem
    return len(header) == 20 and header.startswith(b"SQLite format 3\x00") and header[18] == 2


def _readonly_uri(path: Path) -> str:
    path = Path(path).resolve()
    uri = f"file:{quote(str(path))}?mode=ro"
    if not Path(f"{path}-wal").exists():
        uri += "&immutable=1"  # no writer: read without locks or side files
    return uri


def at_head(path: str | Path, upgraded: Path | None, *, shown: str | Path | None = None) -> Path:
    """`path` if its trace revision is head; else a copy at `upgraded`, brought to head by
    the trace migrations (the file itself is left as it is). A file that is no trace,
    or from a newer rolloutdb, is refused, naming `shown` (the user's path, when `path`
    is a private copy of it)."""
    path = Path(path)
    if shown is not None and Path(shown) != path:
        try:
            return at_head(path, upgraded)
        except TraceError as e:
            raise TraceError(str(e).replace(str(path), str(shown))) from e
    try:
        with contextlib.closing(sqlite3.connect(_readonly_uri(path), uri=True)) as conn:
            revision = file_revision(conn)
    except sqlite3.DatabaseError as e:
        raise TraceError(f"{path}: not a readable trace file ({e})") from e
    head = trace_head_revision()
    if revision == head:
        return path
    known = trace_known_revisions()
    if revision is None or not revision.startswith("trace_"):
        raise TraceError(f"{path}: not a readable trace file (no trace revision in it)")
    if revision not in known:
        raise TraceError(f"{path}: trace revision {revision} is newer than this rolloutdb knows (head {head}); "
                         "upgrade rolloutdb")
    if upgraded is None:
        raise TraceError(f"{path}: trace revision {revision} is older than {head}; analyse it with TraceAnalysis, "
                         "which upgrades a copy")
    upgraded.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.closing(sqlite3.connect(_readonly_uri(path), uri=True)) as src, \
            contextlib.closing(sqlite3.connect(upgraded)) as dst:
        src.backup(dst)  # includes what a killed run left in its -wal file
    run_trace_migrations(upgraded)
    return upgraded


def sqlite_query(conn: sqlite3.Connection, name_or_sql: str) -> Table:
    cur = conn.execute(trace_queries.QUERIES.get(name_or_sql, name_or_sql))
    return Table([d[0] for d in cur.description], cur.fetchall())
