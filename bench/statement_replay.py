"""The store's own SQL, replayed on raw sqlite3: a floor that does the same work.

A floor of one-row UPDATEs touching no index says little about a transition that inserts
rows, updates indexed columns and bumps the mutation counter. This floor is the exact
statements (text and parameters) the store API issued for a transaction, captured from a
*shadow* store that runs the same calls on a copy of the file, and replayed on a plain
sqlite3 connection to a third copy, in one ``BEGIN IMMEDIATE ... COMMIT``. The three
files start identical and see the same statements in the same order, so they stay
identical: the replay inserts the same ids and updates the same rows. The measured store
is never instrumented; what store / replay says is what our Python costs on top of
SQLite's own work for this schema.

Captured: everything the store runs on its writer connection, through SQLAlchemy
(`before_cursor_execute` on the shadow store's engine) or the hot-path statements that
bypass it (`Prepared.run` / `Prepared.many`, store/sqlite/prepared.py). The BEGIN, issued
on the sqlite3 connection by the engine's `begin` event, and the COMMIT are the replay's
own. Result rows are fetched in the replay too (SQLite steps a SELECT or RETURNING only
as its rows are read).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import event

from rolloutdb.store import Store
from rolloutdb.store.sqlite import prepared

Statement = tuple[str, Any, bool]  # (sql, parameters, executemany)

_recording: dict[int, list[Statement]] = {}  # id(sqlite3 connection) -> its open capture


def _install_prepared_hooks() -> None:
    """Wrap Prepared.run/many once per process: they record only while a capture is open,
    for the shadow store's connection; the measured store (never captured: its calls run
    with no capture open) pays one extra call and an empty-dict test per statement."""
    if getattr(prepared.Prepared, "_replay_hooked", False):
        return
    run, many = prepared.Prepared.run, prepared.Prepared.many

    def run_recorded(self, conn, params=None):
        cur = run(self, conn, params)
        if not _recording:
            return cur
        out = _recording.get(id(prepared._driver(conn)))
        if out is not None:
            out.append((self.sql, dict(params or {}), False))
        return cur

    def many_recorded(self, conn, rows):
        cur = many(self, conn, rows)
        if not _recording:
            return cur
        out = _recording.get(id(prepared._driver(conn)))
        if out is not None:
            out.append((self.sql, [dict(r) for r in rows], True))
        return cur

    setattr(prepared.Prepared, "run", run_recorded)
    setattr(prepared.Prepared, "many", many_recorded)
    setattr(prepared.Prepared, "_replay_hooked", True)


def copy_file(src: Path, dst: Path) -> None:
    """A consistent copy of a live WAL store (sqlite3's backup: committed state only)."""
    with contextlib.closing(sqlite3.connect(src)) as s, contextlib.closing(sqlite3.connect(dst)) as d:
        s.backup(d)


class ShadowStore:
    """A store on a copy of the measured file whose every transaction's SQL is captured."""

    def __init__(self, path: Path):
        _install_prepared_hooks()
        self.store = Store.open(path)
        self._writer = self.store.db._writer.connection.driver_connection
        self._current: list[Statement] | None = None
        event.listen(self.store.db.engine, "before_cursor_execute", self._on_execute)

    def _on_execute(self, conn, cursor, statement, parameters, context, executemany) -> None:
        if self._current is not None and conn.connection.driver_connection is self._writer:
            self._current.append((statement, parameters, bool(executemany)))

    def capture(self, call: Callable[[Store], Any]) -> list[Statement]:
        """Run `call(store)` and return the statements it issued (its transactions')."""
        self._current = out = []
        _recording[id(self._writer)] = out
        try:
            call(self.store)
        finally:
            _recording.pop(id(self._writer), None)
            self._current = None
        return out

    def close(self) -> None:
        self.store.close()


def replay(raw: sqlite3.Connection, statements: list[Statement]) -> float:
    """`statements` in one write transaction on `raw`; returns its wall time in seconds."""
    t0 = time.perf_counter()
    raw.execute("BEGIN IMMEDIATE")
    for sql, params, many in statements:
        if many:
            raw.executemany(sql, params)
        else:
            raw.execute(sql, params).fetchall()
    raw.execute("COMMIT")
    return time.perf_counter() - t0


@contextlib.contextmanager
def replay_floor(measured: Store, where: Path, connect: Callable[[Path], sqlite3.Connection]) -> Iterator[tuple[ShadowStore, sqlite3.Connection]]:
    """A shadow store and a raw connection, each on its own copy of `measured`'s file as
    it is now (call it between transactions)."""
    shadow_path, raw_path = where / "shadow.sqlite", where / "replay.sqlite"
    copy_file(measured.path, shadow_path)
    copy_file(measured.path, raw_path)
    shadow = ShadowStore(shadow_path)
    raw = connect(raw_path)
    try:
        yield shadow, raw
    finally:
        raw.close()
        shadow.close()
