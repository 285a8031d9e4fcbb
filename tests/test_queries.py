"""The pumps' named reads (`rolloutdb.store.queries`) return what a second connection
sees in the file, for a store built through the ledger's transitions."""

from __future__ import annotations

import contextlib
import sqlite3
import time

from rolloutdb.store import FinishedGeneration, Reservation, Store, ledger, pools, queries


def _gen(n: int, reward: float, versions: list[tuple[int, int]]) -> FinishedGeneration:
    return FinishedGeneration(list(range(n)), [-0.5] * n, reward, versions)


def _build(path) -> tuple[Store, int, int, list[int]]:
    """Group a (step 2) in replay with rewards 0 and 1; group b (step 3) dispatched, its
    generation 0 finished, 1 abandoned and running again as attempt 1."""
    store = Store.create(path)
    (a,) = store.reserve([Reservation(0, 0, 10)], num_generations=2, target_step=2)
    (b,) = store.reserve([Reservation(1, 0, 11)], num_generations=2, target_step=3)
    with store.atomic() as tx:
        pools.set_shortfall(tx, 4, 1)
    a0, a1 = store.dispatch([a], policy_version=0)
    store.finish(a0, _gen(3, 0.0, [(0, 2), (1, 1)]))
    store.finish(a1, _gen(5, 1.0, [(1, 5)]))
    store.seal([a])
    store.enter_replay([a])
    b0, b1 = store.dispatch([b], policy_version=1)
    store.finish(b0, _gen(2, 0.5, [(1, 2)]))
    store.abandon([b1], "restart")
    with store.atomic() as tx:
        (again,) = ledger.start_attempts(tx, [(b, 1)], policy_version=2)
    return store, a, b, [b0, again]


def test_the_pumps_reads_match_what_a_second_connection_sees(tmp_path):
    path = tmp_path / "s.sqlite"
    store, a, b, (b0, again) = _build(path)
    with store, store.read() as conn:
        assert queries.highest_stamped_step(conn) == 4  # the shortfall row of step 4
        assert queries.highest_group_id(conn) == b  # b has a sample, so it counts
        assert queries.attempt_numbers(conn, [b0, again]) == {b0: 0, again: 1}
        assert queries.sample_rewards(conn, [a, b]) == {a: [0.0, 1.0], b: [0.5]}
        assert queries.sample_tokens(conn, [a, b]) == {a: 8, b: 2}
        assert queries.version_token_counts(conn, [a]) == {a: {0: 2, 1: 6}}
        assert queries.replay_groups_for_step(conn, 2) == [a] and queries.replay_groups_for_step(conn, 3) == []
        assert [(r[0], r[1], r[2]) for r in queries.samples_of(conn, [b, a])] == [(a, 0, 10), (a, 1, 10), (b, 0, 11)]
        assert queries.episode_keys(conn, "running") == [f"{b}.1-a1"]
        assert queries.episode_keys(conn, "abandoned") == [f"{b}.1-a0"]
        assert queries.episode_keys(conn, "abandoned", except_reason="restart") == []  # b1 was abandoned by a restart
        assert queries.episode_keys(conn, "abandoned", except_reason="error") == [f"{b}.1-a0"]
    with contextlib.closing(sqlite3.connect(path)) as raw:
        assert queries.episode_keys(raw, "running") == [f"{b}.1-a1"]  # a snapshot cut's raw connection
        assert raw.execute("SELECT sum(num_tokens) FROM samples WHERE group_id = ?", (a,)).fetchone()[0] == 8
        assert raw.execute("SELECT max(step) FROM step_shortfall").fetchone()[0] == 4


def test_an_empty_store_has_no_stamped_step_and_no_group(tmp_path):
    with Store.create(tmp_path / "s.sqlite") as store, store.read() as conn:
        assert queries.highest_stamped_step(conn) is None
        assert queries.highest_group_id(conn) == 0
        assert queries.samples_of(conn, [1]) == []
