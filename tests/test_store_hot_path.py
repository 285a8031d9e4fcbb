"""The store's hot path (statements compiled once, run on the sqlite3 cursor, id lists as
one JSON parameter) keeps the ledger's promises; checked through a second connection."""

from __future__ import annotations

import pytest
from sqlalchemy import DateTime, bindparam, select

from rolloutdb.store import FinishedGeneration, IllegalTransition, Reservation, ledger, pools
from rolloutdb.store.live.codec import encode_version_counts
from rolloutdb.store.live.schema import T
from rolloutdb.store.sqlite.prepared import Prepared


def _gen(n=3):
    return FinishedGeneration(list(range(n)), [-0.5] * n, 1.0, [(0, n)])


def _states(conn) -> dict[int, str]:
    return dict(conn.execute("SELECT group_id, state FROM prompt_groups").fetchall())


def test_a_misfit_in_the_middle_of_a_batch_is_named_and_no_group_of_the_batch_moves(store, second_connection):
    ids = store.reserve([Reservation(s, 0, s) for s in range(3)], num_generations=1, target_step=1)
    with store.atomic() as tx:
        ledger.dispatch_without_attempts(tx, [ids[1]], policy_version=0)
    with pytest.raises(IllegalTransition, match=rf"group {ids[1]}: cannot go from dispatched to dispatched"):
        store.dispatch(ids, policy_version=0)
    assert _states(second_connection(store.path)) == {ids[0]: "reserved", ids[1]: "dispatched", ids[2]: "reserved"}


def test_an_attempt_already_finished_in_the_middle_of_a_batch_is_named_and_nothing_is_written(store, second_connection):
    (gid,) = store.reserve([Reservation(0, 0, 0)], num_generations=3, target_step=1)
    attempts = store.dispatch([gid], policy_version=0)
    store.finish(attempts[1], _gen())
    with pytest.raises(IllegalTransition, match=rf"attempt {attempts[1]}: cannot go from finished to finished"):
        with store.atomic() as tx:
            ledger.finish_attempts(tx, [(a, _gen()) for a in attempts])
    conn = second_connection(store.path)
    assert conn.execute("SELECT attempt_id, state FROM rollouts ORDER BY attempt_id").fetchall() == [
        (attempts[0], "running"), (attempts[1], "finished"), (attempts[2], "running")]
    assert conn.execute("SELECT count(*) FROM samples").fetchone() == (1,)


def test_a_group_listed_twice_in_one_transition_is_refused(store, second_connection):
    (gid,) = store.reserve([Reservation(0, 0, 0)], num_generations=1, target_step=1)
    with pytest.raises(IllegalTransition, match=rf"group {gid}: listed twice in one transition \(asked to become discarded\)"):
        store.discard([gid, gid], reason="error")
    assert _states(second_connection(store.path)) == {gid: "reserved"}


def test_a_group_with_no_attempt_at_all_cannot_be_sealed(store, second_connection):
    (gid,) = store.reserve([Reservation(0, 0, 0)], num_generations=2, target_step=1)
    with store.atomic() as tx:
        ledger.dispatch_without_attempts(tx, [gid], policy_version=0)
    with pytest.raises(IllegalTransition, match=rf"group {gid}: cannot seal with 0 of 2 generations finished"):
        store.seal([gid])
    assert _states(second_connection(store.path)) == {gid: "dispatched"}


def test_one_transition_moves_more_groups_than_sqlite_binds_variables(store, second_connection):
    n = 40_000  # SQLite binds at most 32,766 variables per statement
    ids = store.reserve([Reservation(s, 0, s) for s in range(n)], num_generations=1, target_step=1)
    assert len(set(ids)) == n
    store.discard(ids[: n - 1], reason="error")
    conn = second_connection(store.path)
    assert conn.execute("SELECT state, count(*) FROM prompt_groups GROUP BY state ORDER BY state").fetchall() == [
        ("reserved", 1)]
    # The discarded positions 0 .. n-2 settled as one row of discards: one entry (gap 0,
    # length n - 1 = 39,999 as the varint bytes 0xBF 0xB8 0x02, code 1 = 'error').
    assert conn.execute("SELECT seq_start, seq_end, trained_step, others FROM settled_steps").fetchall() == [
        (0, n - 1, None, bytes([0, 0xBF, 0xB8, 0x02, 1]))]
    assert conn.execute("SELECT code, reason FROM discard_reasons").fetchall() == [(1, "error")]
    assert conn.execute("SELECT state FROM prompt_groups WHERE group_id = ?", (ids[-1],)).fetchone() == ("reserved",)


def test_spare_prompts_come_back_oldest_first_and_leave_the_pool(store, second_connection):
    with store.atomic() as tx:
        pools.push_spare(tx, [Reservation(s, 0, 100 + s) for s in (7, 2, 5, 9)])
        taken = pools.pop_spare(tx, 3)
    assert taken == [Reservation(2, 0, 102), Reservation(5, 0, 105), Reservation(7, 0, 107)]
    conn = second_connection(store.path)
    assert conn.execute("SELECT sample_seq, prompt_id FROM spare_prompts").fetchall() == [(9, 109)]


def test_a_hot_path_call_outside_a_transaction_joins_one_that_a_rollback_undoes(store, second_connection):
    with store.db.engine.connect() as conn:
        ledger.reserve_groups(conn, [Reservation(0, 0, 0)], num_generations=1, target_step=1)
        assert conn.in_transaction()
        conn.rollback()
    assert _states(second_connection(store.path)) == {}


def test_a_statement_whose_values_need_sqlalchemys_processing_is_refused_when_built():
    groups = T["prompt_groups"]
    with pytest.raises(TypeError, match="'when'.*DateTime"):
        Prepared(select(groups.c.group_id).where(groups.c.created_at > bindparam("when", type_=DateTime())))


def test_values_written_into_a_statement_are_literals_and_only_named_parameters_are_bound(store):
    groups = T["prompt_groups"]
    stmt = Prepared(select(groups.c.sample_seq).where(groups.c.state == "reserved", groups.c.epoch == bindparam("e")))
    assert "'reserved'" in stmt.sql and ":e" in stmt.sql
    store.reserve([Reservation(s, s % 2, s) for s in range(4)], num_generations=1, target_step=1)
    with store.read() as conn:
        assert sorted(r for (r,) in stmt.run(conn, {"e": 1}).fetchall()) == [1, 3]


def test_version_runs_are_stored_as_compact_json():
    assert encode_version_counts([(3, 24), (4, 8)]) == "[[3,24],[4,8]]"
    assert encode_version_counts([]) == "[]"


def test_the_sampler_cursor_never_moves_back_and_a_refused_move_names_both_positions(store, second_connection):
    with store.atomic() as tx:
        pools.advance_cursor(tx, 10, 0)
        pools.advance_cursor(tx, 10, 1)  # staying put is allowed
    with pytest.raises(IllegalTransition, match="sampler cursor: cannot move back from 10 to 5"):
        with store.atomic() as tx:
            pools.advance_cursor(tx, 5, 2)
    store.reserve([Reservation(3, 1, 3)], num_generations=1, target_step=1)  # below the cursor: it stays
    conn = second_connection(store.path)
    assert conn.execute("SELECT next_seq, epoch FROM sampler_state").fetchone() == (10, 1)
    store.reserve([Reservation(12, 2, 12)], num_generations=1, target_step=1)
    assert conn.execute("SELECT next_seq, epoch FROM sampler_state").fetchone() == (13, 2)


def test_groups_entering_replay_in_one_batch_each_carry_their_own_tokens_and_prompt(store, second_connection):
    ids = store.reserve([Reservation(0, 0, 50), Reservation(1, 0, 51)], num_generations=2, target_step=1)
    attempts = store.dispatch(ids, policy_version=0)  # group by group, generation by generation
    with store.atomic() as tx:
        ledger.finish_attempts(tx, [(a, _gen(n)) for a, n in zip(attempts, (3, 5, 2, 7))])
        ledger.seal_groups(tx, ids)
        ledger.enter_replay(tx, ids)
    conn = second_connection(store.path)
    assert conn.execute("SELECT group_id, prompt_id, num_tokens FROM replay_groups ORDER BY group_id").fetchall() == [
        (ids[0], 50, 8), (ids[1], 51, 9)]
    assert conn.execute("SELECT group_id, generation_index, prompt_id, num_tokens FROM samples ORDER BY sample_id").fetchall() == [
        (ids[0], 0, 50, 3), (ids[0], 1, 50, 5), (ids[1], 0, 51, 2), (ids[1], 1, 51, 7)]
