"""The ledger's transitions, as the pumps use them, checked through a second connection."""

from __future__ import annotations

import pytest

from rolloutdb.store import FinishedGeneration, IllegalTransition, ReplayFullError, Reservation, ledger, pools


def _gen(n=3, reward=1.0, version=0):
    return FinishedGeneration(list(range(n)), [-0.5] * n, reward, [(version, n)])


def _run_group_to_replay(store, seq, generations=2):
    (gid,) = store.reserve([Reservation(seq, 0, seq)], num_generations=generations, target_step=1)
    attempts = store.dispatch([gid], policy_version=0)
    for a in attempts:
        store.finish(a, _gen())
    store.seal([gid])
    store.enter_replay([gid])
    return gid


def test_a_group_moves_from_reserved_to_trained_and_its_payload_is_dropped(store, second_connection):
    gid = _run_group_to_replay(store, 0)
    store.mark_trained([gid], step=1)
    conn = second_connection(store.path)
    # A trained group leaves the ledger and its attempts go; its position (0) is settled.
    assert conn.execute("SELECT count(*) FROM prompt_groups WHERE group_id = ?", (gid,)).fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM rollouts WHERE group_id = ?", (gid,)).fetchone()[0] == 0
    assert conn.execute("SELECT seq_start, seq_end, trained_step, target_step, others FROM settled_steps").fetchall() == [
        (0, 1, 1, 1, None)]
    assert conn.execute("SELECT count(*) FROM samples").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM replay_groups").fetchone()[0] == 0


def test_an_illegal_transition_names_the_group_and_both_states_and_changes_nothing(store, second_connection):
    (gid,) = store.reserve([Reservation(0, 0, 0)], num_generations=1, target_step=1)
    before = store.mutation_counter
    with pytest.raises(IllegalTransition, match=rf"group {gid}: cannot go from reserved to published"):
        store.enter_replay([gid])
    conn = second_connection(store.path)
    assert conn.execute("SELECT state FROM prompt_groups").fetchone() == ("reserved",)
    assert store.mutation_counter == before


def test_a_prompt_cannot_enter_the_ledger_twice(store):
    store.reserve([Reservation(0, 0, 7)], num_generations=1, target_step=1)
    with pytest.raises(Exception, match="UNIQUE"):
        store.reserve([Reservation(1, 0, 7)], num_generations=1, target_step=1)


def test_publishing_takes_one_permit_and_a_full_buffer_refuses(tmp_path):
    from rolloutdb.store import Store

    with Store.create(tmp_path / "s.sqlite", replay_capacity=1) as s:
        _run_group_to_replay(s, 0)
        (gid,) = s.reserve([Reservation(1, 0, 1)], num_generations=1, target_step=1)
        (a,) = s.dispatch([gid], policy_version=0)
        s.finish(a, _gen())
        s.seal([gid])
        with pytest.raises(ReplayFullError, match="1 of 1 permits"):
            s.enter_replay([gid])


def test_an_abandoned_attempt_is_retried_as_the_next_attempt(store, second_connection):
    (gid,) = store.reserve([Reservation(0, 0, 0)], num_generations=1, target_step=1)
    (a0,) = store.dispatch([gid], policy_version=0)
    store.abandon([a0], "restart")
    with store.atomic() as tx:
        (a1,) = ledger.start_attempts(tx, [(gid, 0)], policy_version=1)
    conn = second_connection(store.path)
    rows = conn.execute("SELECT attempt, state, abandon_reason FROM rollouts ORDER BY attempt").fetchall()
    assert rows == [(0, "abandoned", "restart"), (1, "running", None)]


def test_a_rolled_back_transaction_leaves_no_trace(store, second_connection):
    before = store.mutation_counter
    with pytest.raises(RuntimeError):
        with store.atomic() as tx:
            pools.push_spare(tx, [Reservation(0, 0, 0)])
            raise RuntimeError("boom")
    assert second_connection(store.path).execute("SELECT count(*) FROM spare_prompts").fetchone()[0] == 0
    assert store.mutation_counter == before


def test_invariants_hold_for_a_mixed_ledger_and_catch_a_lost_prompt(store):
    _run_group_to_replay(store, 0)
    store.reserve([Reservation(1, 0, 1)], num_generations=1, target_step=2)
    assert store.check_invariants().ok
    with store.atomic() as tx:
        pools.advance_cursor(tx, 5, 0)  # positions 2..4 handed out and recorded nowhere
    report = store.check_invariants()
    assert not report.ok
    assert any("invariant 1" in p and "missing 3 of 5" in p for p in report.problems)


def test_an_attempt_that_ends_keeps_no_chunks_or_episode(store, second_connection):
    (gid,) = store.reserve([Reservation(0, 0, 0)], num_generations=2, target_step=1)
    a0, a1 = store.dispatch([gid], policy_version=0)
    with store.atomic() as tx:
        for a in (a0, a1):
            pools.add_chunk(tx, a, [1, 2], prefix_count=0, max_tokens=8, min_tokens=0, policy_version=0)
            pools.put_episode(tx, a, turn=1, state={"turn": 1})
    store.finish(a0, _gen())
    store.abandon([a1], "deadline")
    conn = second_connection(store.path)
    assert conn.execute("SELECT count(*) FROM token_chunks").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM env_episodes").fetchone()[0] == 0
    assert store.check_invariants().ok


def test_a_store_can_live_in_a_path_with_a_question_mark_or_hash(tmp_path, second_connection):
    from rolloutdb.store import Store

    path = tmp_path / "odd?dir#1" / "live?.sqlite"
    with Store.create(path) as s:
        s.reserve([Reservation(0, 0, 0)], num_generations=1, target_step=1)
    with Store.open(path) as s:
        assert s.check_invariants().ok
    assert second_connection(path).execute("SELECT count(*) FROM prompt_groups").fetchone()[0] == 1
    # The whole name was used: nothing was created under the name cut at the `?`.
    assert {p.name.split("-")[0] for p in path.parent.iterdir()} == {"live?.sqlite"}
    assert not (tmp_path / "odd").exists()
