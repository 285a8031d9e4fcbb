"""SQLite files of a run attached read-only to one in-memory DuckDB: `rolloutdb sql`.

Each file is attached under a schema name the caller chose (``live``, ``trace``,
``snapshot_7``, ``segment_3``), so one query can join the live store, its snapshots, their
payload segments and the trace. DuckDB is the one of `analysis.connect_duckdb` (the
bundled sqlite_scanner loaded by path, no network, nothing written outside a temporary
directory); a file that SQLite would have to write side files for (a WAL beside it, or a
WAL-mode header, as the live store has) is read through `analysis.standalone`'s private
copy. Once the files are attached, DuckDB's file system is switched off and its
configuration locked: a query cannot read, write or attach any other file (COPY ... TO,
read_csv, ATTACH, INSTALL fail), and the attached files themselves are read-only.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

from ..fsio import make_work_dir, work_dir_name
from ..sqlite.readonly import QueryTimeout
from .analysis import Table, _sql_string, connect_duckdb, standalone
from .interrupts import interruptible
from .writer import TraceError

# Table functions that open a SQLite file by path (in place, where its -wal and -shm would
# appear); the attached files are read through their schema names instead.
_OPENS_A_PATH = re.compile(r"\bsqlite_(scan|attach)\b", re.I)
SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")


class AttachedFiles:
    """An in-memory DuckDB with `files` (schema name -> SQLite file) attached read-only.
    `default` (one of the names) is the schema unqualified table names resolve to."""

    def __init__(self, files: dict[str, Path], default: str | None = None):
        if not files:
            raise TraceError("no SQLite files to attach")
        self._work_dir = work_dir_name("rolloutdb-sql-")  # held before it is made: see there
        self.con = None
        try:
            with interruptible(lambda: self.con):  # a signal while DuckDB starts: see interrupts.py
                self.con = connect_duckdb(make_work_dir(self._work_dir))
            for name, path in files.items():
                if not SCHEMA_NAME.match(name):
                    raise TraceError(f"{name!r}: not a schema name (lowercase letters, digits and _)")
                # Not under `interruptible`: copying a large live store must stop at Ctrl-C.
                readable = standalone(path, self._work_dir / "copies", name)
                self._attach(name, path, readable)
            with interruptible(lambda: self.con):
                if default is not None:
                    self.con.execute(f"USE {default}")
                self.con.execute("SET enable_external_access = false")
                self.con.execute("SET lock_configuration = true")
        except BaseException:
            self.close()
            raise

    def _attach(self, name: str, path: Path, readable: Path) -> None:
        import duckdb

        with interruptible(lambda: self.con):
            try:
                self.con.execute(f"ATTACH '{_sql_string(Path(readable).resolve())}' AS {name} (TYPE sqlite, READ_ONLY)")
                self.con.execute(f"SELECT count(*) FROM duckdb_tables() WHERE database_name = '{name}'").fetchone()
            except duckdb.Error as e:
                raise TraceError(f"{path}: not a readable SQLite file ({str(e).splitlines()[0]})") from e

    def query(self, sql: str, timeout_s: float | None = None, *, stop: Callable[[], int | None] | None = None) -> Table:
        """Run the user's SQL; a DuckDB error is a `TraceError` with its first line. Past
        `timeout_s` seconds the query is interrupted (DuckDB's `interrupt`, from a watcher
        thread: the query's own thread is inside DuckDB) and `QueryTimeout` raised. SIGINT
        and SIGTERM stop it the same way and are then raised again under the caller's
        handlers (`interrupts.interruptible`); `stop()` names a stop signal the caller
        received before the query, whose exception may have been lost."""
        import duckdb

        if _OPENS_A_PATH.search(sql):
            raise TraceError("sqlite_scan and sqlite_attach open files by path; query the attached schemas "
                             "instead (`rolloutdb sql PATH` lists them)")
        with interruptible(lambda: self.con, timeout_s=timeout_s, stop=stop) as stopped:
            try:
                cur = self.con.execute(sql)
                if cur.description is None:
                    return Table([], [])
                return Table([d[0] for d in cur.description], cur.fetchall())
            except duckdb.Error as e:
                if stopped.signum is not None:
                    raise  # leaving the block raises the signal instead
                if stopped.timed_out:
                    raise QueryTimeout(f"query stopped after {timeout_s:g} s, its time limit") from None
                raise TraceError(f"query failed: {' '.join(str(e).split())}") from e

    def catalog(self) -> Table:
        """One row per attached table: schema, table, columns (name TYPE, ...)."""
        return self.query(
            "SELECT database_name AS schema, table_name AS \"table\", "
            "string_agg(column_name || ' ' || data_type, ', ' ORDER BY column_index) AS columns "
            "FROM duckdb_columns() WHERE database_name NOT IN ('memory', 'system', 'temp') "
            "GROUP BY ALL ORDER BY schema, \"table\""
        )

    def close(self) -> None:
        if self.con is not None:
            self.con.close()
            self.con = None
        shutil.rmtree(self._work_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
