"""`rollouts` keeps the indexes its reads use (revision v1_13_a): its key, UNIQUE
(group_id, generation_index, attempt) for every look-up by group, and a partial index of
the abandoned attempts for the snapshot pump's per-snapshot read of them. What each
statement does is read from SQLite's own plan (EXPLAIN QUERY PLAN) of the statement the
store issued, caught with a trace callback on a plain sqlite3 connection (which gives it
with its bound values, as SQLite plans it: a partial index needs the value)."""

from __future__ import annotations

import contextlib
import sqlite3

import pytest

from rolloutdb.store import Reservation, Store, queries


def _store_with_attempts(tmp_path):
    path = tmp_path / "live.sqlite"
    store = Store.create(path, replay_capacity=8)
    ids = store.reserve([Reservation(s, 0, s) for s in range(20)], num_generations=2, target_step=1)
    attempts = store.dispatch(ids, policy_version=0)
    store.abandon(attempts[:3], "deadline")
    store.close()
    return path


def _plans(path, read):
    """Run `read(conn)` on a plain connection; each statement it issued with its plan."""
    issued: list[str] = []
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.set_trace_callback(issued.append)
        out = read(conn)
        conn.set_trace_callback(None)
        return out, [(sql, [r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql)]) for sql in issued]


def test_the_abandoned_attempts_are_read_through_their_partial_index(tmp_path):
    path = _store_with_attempts(tmp_path)
    keys, plans = _plans(path, lambda conn: queries.episode_keys(conn, "abandoned", except_reason="restart"))
    assert len(keys) == 3
    ((sql, plan),) = plans
    assert plan == ["SEARCH rollouts USING INDEX ix_rollouts_abandoned (state=?)"], (sql, plan)


def test_the_attempts_of_a_group_are_found_through_the_unique_index(tmp_path):
    path = _store_with_attempts(tmp_path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        plan = [r[3] for r in conn.execute("EXPLAIN QUERY PLAN SELECT attempt_id FROM rollouts WHERE group_id = 3")]
        indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'rollouts'")}
    assert plan == ["SEARCH rollouts USING COVERING INDEX sqlite_autoindex_rollouts_1 (group_id=?)"]
    assert indexes == {"sqlite_autoindex_rollouts_1", "ix_rollouts_abandoned"}


def test_an_unknown_state_is_refused_before_any_sql():
    with pytest.raises(ValueError, match="rollout state 'gone' unknown; use one of running, finished, abandoned"):
        queries.episode_keys(sqlite3.connect(":memory:"), "gone")
