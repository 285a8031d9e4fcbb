"""Hot-path statements: built with SQLAlchemy Core, compiled once into SQLite SQL text, run
on the DBAPI cursor of the transaction they are given.

Why: profiled under bench/bench_transitions.py, SQLAlchemy's execution of an already
cached statement (execution context, parameter processing per row, expanding IN lists
rendered per call, result wrapping) cost 30-40 µs per statement against 5-7 µs for
sqlite3 running the same text, and in a 2,000-row executemany its per-row parameter
handling took more time than SQLite's own work. A one-transition transaction runs five to
seven statements, so that overhead was most of its latency.

What stays: the statements are Core constructs (so the schema's `Table` objects, not
strings, name every column), compiled by SQLAlchemy's own SQLite compiler with named
parameters (``:name``), which sqlite3 binds from a dict, or from a list of dicts in an
executemany. What goes: SQLAlchemy's per-call type processing. It is checked away at
compile time: a statement whose bound or returned columns would need processing for
sqlite3 (anything but the store's integers, floats, strings and bytes; see `_HARMLESS`)
is refused when the module that builds it is imported.

IN lists are one parameter, a JSON array (`in_json`): ``x IN (SELECT value FROM
json_each(:ids))``. SQLite walks the array and probes the index on `x` (EXPLAIN QUERY
PLAN: SEARCH ... USING INTEGER PRIMARY KEY, LIST SUBQUERY); one statement for any number
of ids (no limit on bound variables, no chunking) and no per-call rendering of ``?, ?, ...``.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from sqlalchemy import Connection, Float, LargeBinary, bindparam, func, literal_column, select
from sqlalchemy.sql import type_api
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.sql import visitors
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.elements import BindParameter, ColumnElement
from sqlalchemy.sql.sqltypes import NullType

_DIALECT = SQLiteDialect_pysqlite(paramstyle="named")
# Types whose bind processing sqlite3 does not need: LargeBinary's wraps bytes in a
# memoryview (sqlite3 binds bytes as they are); Float's calls float() (the callers bind
# Python floats, and a REAL column's affinity stores an int as a real anyway).
_HARMLESS = (LargeBinary, Float)


def in_json(column: ColumnElement, name: str = "ids") -> ColumnElement[bool]:
    """``column IN (SELECT value FROM json_each(:name))``; bind `json_ids(...)` to `name`."""
    return column.in_(select(func.json_each(bindparam(name)).table_valued("value").c.value))


def json_ids(ids: Iterable[Any]) -> str:
    """The value of an `in_json` parameter (ints), or of an INSERT's JSON rows (tuples of
    ints). json.dumps of a list of ints runs in C."""
    return json.dumps(ids if isinstance(ids, list) else list(ids))


class Prepared:
    """A Core statement compiled once. `run` executes it once (returns the sqlite3 cursor:
    `.fetchall()`, `.fetchone()`, `.rowcount`); `many` is an executemany."""

    __slots__ = ("sql",)

    def __init__(self, stmt: Executable):
        inlined: Any = visitors.replacement_traverse(cast(Any, stmt), {}, _inline_literal)
        compiled = inlined.compile(dialect=_DIALECT)
        valued = [name for name, bind in compiled.binds.items() if bind.value is not None or bind.callable is not None]
        if valued:  # a value the compiler itself added (e.g. OFFSET 0 beside a bound LIMIT)
            raise TypeError(f"parameters {valued} would need their values at run time: {compiled}")
        for name, bind in compiled.binds.items():
            if bind.type._cached_bind_processor(_DIALECT) is not None and not isinstance(bind.type, _HARMLESS):
                raise TypeError(f"parameter {name!r} ({bind.type!r}) needs SQLAlchemy's processing; run it with conn.execute")
        for col in compiled._result_columns:
            if col.type._cached_result_processor(_DIALECT, None) is not None:
                raise TypeError(f"result column {col.name!r} ({col.type!r}) needs SQLAlchemy's processing")
        self.sql = str(compiled)

    def run(self, conn: Connection | sqlite3.Connection, params: Mapping[str, Any] | None = None) -> sqlite3.Cursor:
        return _driver(conn).execute(self.sql, params or {})

    def many(self, conn: Connection | sqlite3.Connection, rows: Sequence[Mapping[str, Any]]) -> sqlite3.Cursor:
        return _driver(conn).executemany(self.sql, rows)


def _inline_literal(element: Any, **_kw: Any) -> Any:
    """Values written into the statement (``state == 'running'``, ``.values(state=...)``)
    become SQL literals: only the parameters named with `bindparam` and no value are left
    for the caller to bind."""
    if not isinstance(element, BindParameter) or (element.value is None and element.callable is None):
        return None
    value = element.effective_value
    kind = element.type if not isinstance(element.type, NullType) else type_api._resolve_value_to_type(value)
    render = None if element.expanding else kind.literal_processor(_DIALECT)
    if render is None:
        raise TypeError(f"cannot write {value!r} into a prepared statement; use literal_column or a bindparam")
    return literal_column(render(value), type_=element.type)


def _driver(conn: Connection | sqlite3.Connection) -> sqlite3.Connection:
    """The sqlite3 connection under `conn`, inside `conn`'s transaction. A connection
    not yet in one begins it first, as SQLAlchemy's own execute would (autobegin):
    otherwise the statement would run outside any transaction (isolation_level=None)."""
    if isinstance(conn, sqlite3.Connection):  # a snapshot cut's own connection
        return conn
    if not conn.in_transaction():
        conn.begin()
    return conn.connection.driver_connection
