"""Restore's work on in-flight attempts (issue 32, item 2): restart normalization reads
what the running attempts saved and leaves them running, so its work does not grow with
their number; the rollout pump abandons each (reason `restart`) in the transaction that
starts its replacement (`ledger.restart_attempts`). Checked through a second sqlite3
connection."""

from __future__ import annotations

import sqlite3

import pytest

from rolloutdb.store import IllegalTransition, Publisher, Reservation, Store, ledger, pools
from rolloutdb.store.live.invariants import check_invariants
from test_restore import gen, make_store, publish_anchor, restore, snapshot

GROUPS, GENERATIONS = 1000, 3  # generation 0 finished, 1 and 2 running: 2000 running attempts
ROLLOUT_ROWS = "SELECT attempt_id, group_id, generation_index, attempt, state, abandon_reason, ended_at FROM rollouts"


def _in_flight_snapshot(tmp_path, groups: int = GROUPS):
    """A snapshot with `groups` dispatched groups, generation 0 finished and the others
    running, the first ten running attempts (every third id) with a saved prefix chunk."""
    live = tmp_path / "run" / "rollout_state.sqlite"
    store = make_store(live)
    pub = Publisher(tmp_path / "ckpt")
    publish_anchor(pub, None)
    ids = store.reserve([Reservation(s, 0, 100 + s) for s in range(groups)], num_generations=GENERATIONS,
                        target_step=1)
    attempts = store.dispatch(ids, policy_version=0)  # group by group, generation by generation
    with store.atomic() as tx:
        ledger.finish_attempts(tx, [(a, gen()) for a in attempts[::GENERATIONS]])
        for a in attempts[1:30:GENERATIONS]:
            pools.add_chunk(tx, a, [7, 8], prefix_count=0, max_tokens=8, min_tokens=0, policy_version=0)
    snap = snapshot(pub, store, "bootstrap")
    store.close()
    return live, pub, snap, ids


def test_a_restore_with_thousands_of_running_attempts_leaves_every_row_as_the_snapshot_has_it(
    tmp_path, second_connection
):
    live, _, snap, groups = _in_flight_snapshot(tmp_path)
    with sqlite3.connect(snap / "rollout_state.sqlite") as conn:
        before = conn.execute(ROLLOUT_ROWS + " ORDER BY attempt_id").fetchall()
    assert sum(1 for r in before if r[4] == "running") == GROUPS * (GENERATIONS - 1)

    plan = restore(snap, live)

    assert "abandoned_attempts" not in plan.counts
    assert plan.counts["generations_to_run"] == GROUPS * (GENERATIONS - 1)
    assert [(g.group_id, g.generations_to_run) for g in plan.redispatch] == [(g, (1, 2)) for g in groups]
    assert plan.to_finalize == []
    assert len(plan.saved_prefixes) == 10
    assert 0 < plan.timings["in_flight"] <= plan.timings["ledger"]  # timed inside the ledger phase
    conn = second_connection(live)
    assert conn.execute(ROLLOUT_ROWS + " ORDER BY attempt_id").fetchall() == before  # not one row written
    assert conn.execute("SELECT count(*) FROM token_chunks").fetchone()[0] == 10  # kept with their attempts
    assert set(conn.execute("SELECT DISTINCT state FROM prompt_groups")) == {("dispatched",)}
    assert check_invariants(conn).ok


def test_restarting_a_restored_group_abandons_exactly_its_stopped_attempts_and_starts_the_next(
    tmp_path, second_connection
):
    live, _, snap, groups = _in_flight_snapshot(tmp_path, groups=4)
    restore(snap, live)
    with sqlite3.connect(live) as conn:
        stopped = dict(((g, i), (a, n)) for a, g, i, n in conn.execute(
            "SELECT attempt_id, group_id, generation_index, attempt FROM rollouts WHERE state = 'running'"))
    first = groups[0]
    with Store.open(live) as store, store.atomic() as tx:
        new, left = ledger.restart_attempts(tx, [(first, 1), (first, 2)], policy_version=3)

    assert left == [(first, 1, 0, 0), (first, 2, 0, 0)]  # (group, generation, attempt, the version it ran)
    conn = second_connection(live)
    rows = {a: (state, reason, ended) for a, state, reason, ended in conn.execute(
        "SELECT attempt_id, state, abandon_reason, ended_at FROM rollouts")}
    for i in (1, 2):
        state, reason, ended = rows[stopped[(first, i)][0]]
        assert (state, reason) == ("abandoned", "restart") and ended is not None
    assert [tuple(r) for r in conn.execute(
        f"SELECT generation_index, attempt, state, policy_version FROM rollouts WHERE attempt_id IN ({new[0]}, {new[1]}) "
        "ORDER BY generation_index")] == [(1, 1, "running", 3), (2, 1, "running", 3)]
    others = [a for (g, _), (a, _) in stopped.items() if g != first]
    assert all(rows[a] == ("running", None, None) for a in others)  # the other groups wait for their turn
    # Group 0's generation 1 had the saved chunk: it left with its attempt (invariant 3).
    assert conn.execute("SELECT count(*) FROM token_chunks WHERE attempt_id = ?", (stopped[(first, 1)][0],)).fetchone()[0] == 0
    assert check_invariants(conn).ok


def test_a_restart_that_cannot_start_a_generation_abandons_nothing(tmp_path):
    """Generation 0 finished: starting it again is refused, and the transaction's abandon
    of generations 1 and 2's stopped attempts rolls back with it."""
    live, _, snap, groups = _in_flight_snapshot(tmp_path, groups=2)
    restore(snap, live)
    with Store.open(live) as store:
        with pytest.raises(IllegalTransition, match="already has a running or finished attempt"):
            with store.atomic() as tx:
                ledger.restart_attempts(tx, [(groups[0], 1), (groups[0], 2), (groups[0], 0)], policy_version=1)
    with sqlite3.connect(live) as conn:
        assert conn.execute("SELECT count(*) FROM rollouts WHERE state = 'abandoned'").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM rollouts WHERE state = 'running'").fetchone()[0] == 4


def test_a_snapshot_cut_between_the_restore_and_the_restart_keeps_the_saved_progress(tmp_path):
    """A stop soon after a resume (a preemptible cluster): the groups not yet restarted
    still hold what their attempts saved, so the next snapshot has it and the next
    restore reads it again."""
    live, pub, snap, groups = _in_flight_snapshot(tmp_path, groups=10)
    first = restore(snap, live)
    with Store.open(live) as store:
        with store.atomic() as tx:  # the pump restarts group 0 only before the stop
            ledger.restart_attempts(tx, [(groups[0], 1), (groups[0], 2)], policy_version=0)
        again = snapshot(pub, store, "bootstrap")
    live.unlink()
    second = restore(again, live)
    assert len(first.saved_prefixes) == 10
    # Group 0's one chunk went with its restart (its new attempt saves again at a later cut).
    assert set(second.saved_prefixes) == set(first.saved_prefixes) - {(groups[0], 1)}


def test_a_restart_of_part_of_a_restored_group_is_refused_and_abandons_nothing(tmp_path):
    """Generation 2 of the group also ran at the cut: restarting generation 1 alone would
    leave the stopped run's attempt running beside the new ones."""
    live, _, snap, groups = _in_flight_snapshot(tmp_path, groups=2)
    restore(snap, live)
    with Store.open(live) as store:
        with pytest.raises(IllegalTransition, match=f"group {groups[0]} generation 2: attempt 0 is running and was not "
                                                    "named for restart"):
            with store.atomic() as tx:
                ledger.restart_attempts(tx, [(groups[0], 1)], policy_version=1)
    with sqlite3.connect(live) as conn:
        assert conn.execute("SELECT count(*) FROM rollouts WHERE state = 'abandoned'").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM token_chunks").fetchone()[0] == 2


def test_a_restored_group_cannot_be_discarded_for_zero_variance_before_its_generations_ran_again(tmp_path):
    """The algorithm judges a whole group (`LedgerDispatch.discard`): a pump that dropped a
    restored group with the algorithm's reason, its stopped attempts still running, would
    pass lost work off as the algorithm's choice (`rolloutdb verify` does not count those
    discards as lost). The other reasons discard whatever the group holds."""
    from rolloutdb.controller.run.dispatch import GroupHandle, LedgerDispatch

    live, _, snap, groups = _in_flight_snapshot(tmp_path, groups=2)
    plan = restore(snap, live)
    handles = [GroupHandle(g.group_id, g.reservation, g.target_step, g.num_generations) for g in plan.redispatch]
    with Store.open(live) as store:
        with pytest.raises(IllegalTransition, match=f"group {groups[0]}: cannot be discarded for zero_reward_variance "
                                                    "with 1 of 3 generations finished"):
            with store.atomic() as tx:
                LedgerDispatch().discard(tx, handles[:1], reason=ledger.ZERO_REWARD_VARIANCE)
        with store.atomic() as tx:
            LedgerDispatch().discard(tx, handles[1:], reason="resume_check")
    with sqlite3.connect(live) as conn:
        assert conn.execute("SELECT state FROM prompt_groups WHERE group_id = ?", (groups[0],)).fetchone() == ("dispatched",)
        assert conn.execute("SELECT count(*) FROM prompt_groups WHERE group_id = ?", (groups[1],)).fetchone() == (0,)  # settled
