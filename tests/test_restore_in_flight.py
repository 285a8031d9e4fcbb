"""Restore's work on in-flight attempts (issue 32, item 2): restart normalization abandons
every running attempt of the snapshot in a constant number of statements
(`ledger.abandon_every_running_attempt`), whatever their number, and every group they
belonged to comes back for redispatch. Checked through a second sqlite3 connection."""

from __future__ import annotations

import sqlite3

import pytest
import sqlalchemy.exc

from rolloutdb.store import Publisher, Reservation, ledger, pools
from rolloutdb.store.live.invariants import check_invariants
from test_restore import gen, make_store, publish_anchor, restore, snapshot

GROUPS, GENERATIONS = 1000, 3  # generation 0 finished, 1 and 2 running: 2000 running attempts


def test_a_restore_with_thousands_of_running_attempts_abandons_every_one_and_hands_back_every_group(
    tmp_path, second_connection
):
    live = tmp_path / "run" / "rollout_state.sqlite"
    store = make_store(live)
    pub = Publisher(tmp_path / "ckpt")
    publish_anchor(pub, None)
    groups = store.reserve([Reservation(s, 0, 100 + s) for s in range(GROUPS)], num_generations=GENERATIONS,
                           target_step=1)
    attempts = store.dispatch(groups, policy_version=0)  # group by group, generation by generation
    with store.atomic() as tx:
        ledger.finish_attempts(tx, [(a, gen()) for a in attempts[::GENERATIONS]])
        # Saved progress on some running attempts: restore reads it, then clears it.
        for a in attempts[1:30:GENERATIONS]:
            pools.add_chunk(tx, a, [7, 8], prefix_count=0, max_tokens=8, min_tokens=0, policy_version=0)
    snap = snapshot(pub, store, "bootstrap")
    store.close()
    with sqlite3.connect(snap / "rollout_state.sqlite") as conn:
        running = {a for (a,) in conn.execute("SELECT attempt_id FROM rollouts WHERE state = 'running'")}
    assert len(running) == GROUPS * (GENERATIONS - 1)

    plan = restore(snap, live)

    assert plan.counts["abandoned_attempts"] == len(running)
    assert [(g.group_id, g.generations_to_run) for g in plan.redispatch] == [(g, (1, 2)) for g in groups]
    assert plan.to_finalize == []
    assert len(plan.saved_prefixes) == 10
    assert 0 < plan.timings["in_flight"] <= plan.timings["ledger"]  # timed inside the ledger phase
    conn = second_connection(live)
    assert conn.execute("SELECT count(*) FROM rollouts WHERE state = 'running'").fetchone()[0] == 0
    abandoned = {a for (a,) in conn.execute(
        "SELECT attempt_id FROM rollouts WHERE state = 'abandoned' AND abandon_reason = 'restart'")}
    assert abandoned == running
    assert conn.execute("SELECT count(*) FROM rollouts WHERE ended_at IS NULL").fetchone()[0] == 0
    assert set(conn.execute("SELECT DISTINCT state FROM prompt_groups")) == {("dispatched",)}
    assert conn.execute("SELECT count(*) FROM token_chunks").fetchone()[0] == 0
    assert check_invariants(conn).ok


def test_abandoning_every_running_attempt_leaves_the_connection_checking_constraints(tmp_path):
    """The abandon leaves the table's CHECKs on (a faster variant skipped them for its
    UPDATE): a later bad write on the same connection is refused, and an unknown reason is
    refused before anything is written; both transactions roll back."""
    store = make_store(tmp_path / "s.sqlite")
    (g,) = store.reserve([Reservation(0, 0, 100)], num_generations=2, target_step=1)
    store.dispatch([g], policy_version=0)
    with pytest.raises(sqlalchemy.exc.IntegrityError, match="CHECK constraint failed"):
        with store.atomic() as tx:
            assert ledger.abandon_every_running_attempt(tx, "restart") == 2
            tx.exec_driver_sql("UPDATE rollouts SET abandon_reason = NULL")  # abandoned with no reason
    with pytest.raises(ValueError, match="abandon reason 'bogus' unknown"):
        with store.atomic() as tx:
            ledger.abandon_every_running_attempt(tx, "bogus")
    store.close()
    with sqlite3.connect(tmp_path / "s.sqlite") as conn:  # both transactions rolled back
        assert conn.execute("SELECT count(*) FROM rollouts WHERE state = 'running'").fetchone()[0] == 2
