"""Turn-level recovery in the store: episodes saved after each finished turn with their
transcript (revision v1_2_a), through `pools.put_episodes`, and handed back by a real
restore as `SavedEpisode`s.

Real store files; persisted rows are read through a second sqlite3 connection and
decoded with numpy, not with the store's codec. Expected bytes and runs are written out
by hand.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import struct

import numpy as np
import pytest

from rolloutdb.store import EpisodeProgress, FinishedGeneration, Publisher, SavedEpisode, ledger, pools
from rolloutdb.store.restore.apply import restore_snapshot
from transcripts import saved_transcripts
from test_restore import FIXTURES, RUN, make_store, publish_anchor, reserve, snapshot

# A two-turn episode: reply (3 tokens, version 4), observation (2 tokens), reply (2 tokens,
# version 5: a refit landed between the turns). Logprobs are exact in float32.
TOKENS = [101, 102, 103, 7, 8, 104, 105]
LOGPROBS = [-0.5, -0.25, -1.125, 0.0, 0.0, -2.0, -0.0625]
VERSIONS = [4, 4, 4, -1, -1, 5, 5]
RUNS = [[4, 3], [-1, 2], [5, 2]]  # by hand from VERSIONS
STATE = {"board": [[1, 0], [0, 2]], "moves": 2, "note": "ünïcode"}


def progress(attempt_id: int, group_id: int, gen: int, attempt: int = 0, *, turn: int = 2,
             tokens=TOKENS, logprobs=LOGPROBS, versions=VERSIONS, state=STATE) -> EpisodeProgress:
    return EpisodeProgress(attempt_id, group_id, gen, attempt, turn, state, tokens, logprobs, versions)


def rows(conn: sqlite3.Connection) -> dict[str, tuple]:
    """episode key -> (attempt id, turn, state, token ids, logprobs, version runs): the
    transcript joined from its pieces by tests/transcripts.py (the documented layout)."""
    transcripts = saved_transcripts(conn)
    out = {}
    for key, attempt_id, turn, state in conn.execute("SELECT episode_key, attempt_id, turn, state FROM env_episodes"):
        t = transcripts[attempt_id]
        assert t.problem is None, t.problem
        out[key] = (attempt_id, turn, state, t.token_ids, t.logprobs, t.version_token_counts)
    return out


def test_put_episodes_writes_rows_a_second_connection_reads_back_byte_exact(tmp_path, second_connection):
    store = make_store(tmp_path / "live.sqlite")
    g = reserve(store, 0, 1)
    a0, a1 = store.dispatch([g], policy_version=4)
    with store.atomic() as tx:
        pools.put_episodes(tx, [progress(a0, g, 0), progress(a1, g, 1, turn=1, tokens=[9], logprobs=[-0.75],
                                                             versions=[4], state={})])
    store.close()

    saved = rows(second_connection(tmp_path / "live.sqlite"))
    assert set(saved) == {f"{g}.0-a0", f"{g}.1-a0"}
    attempt_id, turn, state, tokens, logprobs, runs = saved[f"{g}.0-a0"]
    assert (attempt_id, turn, json.loads(state)) == (a0, 2, STATE)
    assert tokens == struct.pack("<7i", *TOKENS)
    assert np.frombuffer(tokens, "<i4").tolist() == TOKENS
    assert logprobs == struct.pack("<7f", *LOGPROBS)
    assert np.frombuffer(logprobs, "<f4").tolist() == LOGPROBS
    assert json.loads(runs) == RUNS
    assert saved[f"{g}.1-a0"][1:] == (1, "{}", struct.pack("<i", 9), struct.pack("<f", -0.75), "[[4,1]]")


def test_an_upsert_replaces_the_row_of_the_same_key_and_leaves_the_others(tmp_path, second_connection):
    store = make_store(tmp_path / "live.sqlite")
    g = reserve(store, 0, 1)
    a0, a1 = store.dispatch([g], policy_version=4)
    with store.atomic() as tx:
        pools.put_episodes(tx, [progress(a0, g, 0, turn=1, tokens=TOKENS[:5], logprobs=LOGPROBS[:5],
                                         versions=VERSIONS[:5]), progress(a1, g, 1, turn=1)])
    with store.atomic() as tx:  # the next turn of generation 0 only
        pools.put_episodes(tx, [progress(a0, g, 0, turn=2, state={"moves": 2})])
    with store.atomic() as tx:  # a state-only writer replaces the transcript too
        pools.put_episode(tx, a1, turn=3, state={"moves": 3})
    store.close()

    saved = rows(second_connection(tmp_path / "live.sqlite"))
    assert len(saved) == 2
    assert saved[f"{g}.0-a0"][:3] == (a0, 2, '{"moves": 2}')
    assert np.frombuffer(saved[f"{g}.0-a0"][3], "<i4").tolist() == TOKENS
    assert json.loads(saved[f"{g}.0-a0"][5]) == RUNS
    assert saved[f"{g}.1-a0"] == (a1, 3, '{"moves": 3}', None, None, None)


def test_a_finished_attempt_keeps_no_episode_row_and_a_running_one_keeps_its_own(tmp_path, second_connection):
    store = make_store(tmp_path / "live.sqlite")
    g = reserve(store, 0, 1)
    a0, a1 = store.dispatch([g], policy_version=4)
    with store.atomic() as tx:
        pools.put_episodes(tx, [progress(a0, g, 0), progress(a1, g, 1)])
    with store.atomic() as tx:  # one group-commit batch finishing one of the two
        ledger.finish_attempts(tx, [(a0, FinishedGeneration(TOKENS, LOGPROBS, 1.0, [(4, 3), (-1, 2), (5, 2)]))])
    conn = second_connection(tmp_path / "live.sqlite")
    assert list(rows(conn)) == [f"{g}.1-a0"]
    store.abandon([a1], "deadline")
    assert rows(conn) == {}
    assert store.check_invariants().ok
    store.close()


@pytest.mark.parametrize("bad, what", [
    (dict(logprobs=LOGPROBS[:-1]), "7 token ids, 6 logprobs and 7 token versions"),
    (dict(versions=VERSIONS + [5]), "7 token ids, 7 logprobs and 8 token versions"),
    (dict(tokens=TOKENS[:3]), "3 token ids, 7 logprobs and 7 token versions"),
])
def test_a_transcript_whose_lengths_differ_is_refused_in_one_line_and_nothing_is_written(
    bad, what, tmp_path, second_connection
):
    store = make_store(tmp_path / "live.sqlite")
    g = reserve(store, 0, 1)
    a0, a1 = store.dispatch([g], policy_version=4)
    with store.atomic() as tx:  # the good row comes first: it must not be written either
        with pytest.raises(ValueError) as info:
            pools.put_episodes(tx, [progress(a0, g, 0), progress(a1, g, 1, **bad)])
    store.close()  # the transaction committed: whatever put_episodes wrote would be there
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert f"episode {g}.1-a0: transcript of {what}" in message and "nothing was written" in message
    assert rows(second_connection(tmp_path / "live.sqlite")) == {}


def test_a_restore_hands_back_the_transcript_each_running_episode_had_at_the_cut(tmp_path):
    """B runs two generations: gen 0 saved a transcript, gen 1 only its state. C's
    attempt finished before the cut (no row); D's was abandoned for a deadline and its
    retry has not saved a turn. After the cut the live store saves B gen 0's next turn:
    the restore brings back the cut's."""
    live = tmp_path / "run" / "rollout_state.sqlite"
    store = make_store(live)
    pub = Publisher(tmp_path / "ckpt")
    publish_anchor(pub, None)
    B, C, D = (reserve(store, seq, 1) for seq in (0, 1, 2))
    b0, b1 = store.dispatch([B], policy_version=0)
    c0, c1 = store.dispatch([C], policy_version=0)
    d0, d1 = store.dispatch([D], policy_version=0)
    with store.atomic() as tx:
        pools.put_episodes(tx, [progress(b0, B, 0), progress(c0, C, 0), progress(d0, D, 0)])
        pools.put_episode(tx, b1, turn=1, state={"moves": 1})
        ledger.finish_attempts(tx, [(c0, FinishedGeneration([1], [-0.5], 0.0, [(0, 1)]))])
        ledger.abandon_attempts(tx, [d0], "deadline")
        ledger.start_attempts(tx, [(D, 0)], policy_version=0)
    snap = snapshot(pub, store, "bootstrap")
    with store.atomic() as tx:
        pools.put_episodes(tx, [progress(b0, B, 0, turn=3, tokens=TOKENS + [1], logprobs=LOGPROBS + [-1.0],
                                         versions=VERSIONS + [5])])
    store.close()

    plan = restore_snapshot(snap, live, **RUN, groups_per_step=2)

    assert plan.saved_episodes == {
        (B, 0): SavedEpisode(f"{B}.0-a0", 0, 2, STATE, TOKENS, LOGPROBS, VERSIONS),
        (B, 1): SavedEpisode(f"{B}.1-a0", 0, 1, {"moves": 1}, None, None, None),
    }
    assert plan.counts["generations_to_run"] == 5  # b0, b1, c1, d1 and D gen 0's retry


def _fixture_snapshot(tmp_path, revision: str):
    fixture = FIXTURES / f"store_{revision}.sqlite"
    pub = Publisher(tmp_path / "ckpt")
    publish_anchor(pub, 5)
    snap = pub.publish_rollout_snapshot("step_5", lambda p: shutil.copyfile(fixture, p)).path
    with sqlite3.connect(f"file:{fixture}?mode=ro", uri=True) as conn:
        cfg, data, forest = conn.execute("SELECT config_fingerprint, dataset_fingerprint, forest_training FROM run_meta").fetchone()
        saved = conn.execute(
            "SELECT a.group_id, a.generation_index, a.attempt, e.* FROM env_episodes e JOIN rollouts a USING (attempt_id) "
            "WHERE a.state = 'running'").fetchall()
        columns = [d[0] for d in conn.execute("SELECT * FROM env_episodes").description]
    conn.close()
    live = tmp_path / "run" / "rollout_state.sqlite"
    live.parent.mkdir()
    plan = restore_snapshot(snap, live, config_fingerprint=cfg, dataset_fingerprint=data,
                            forest_training=json.loads(forest), groups_per_step=4)
    return plan, [(g, i, a, dict(zip(columns, rest))) for g, i, a, *rest in saved]


def test_an_episode_saved_before_v1_2_a_comes_back_from_a_restore_without_a_transcript(tmp_path):
    plan, saved = _fixture_snapshot(tmp_path, "v1_1_a")
    assert len(saved) == 4 and plan.upgraded_from == "v1_1_a"
    assert plan.saved_episodes == {
        (g, i): SavedEpisode(row["episode_key"], a, row["turn"], json.loads(row["state"]), None, None, None)
        for g, i, a, row in saved
    }


def test_an_episode_of_the_v1_2_a_fixture_comes_back_with_the_transcript_it_holds(tmp_path):
    plan, saved = _fixture_snapshot(tmp_path, "v1_2_a")
    assert len(saved) == 4
    expected = {}
    for g, i, a, row in saved:
        versions = [v for v, n in json.loads(row["version_token_counts"]) for _ in range(n)]
        expected[(g, i)] = SavedEpisode(row["episode_key"], a, row["turn"], json.loads(row["state"]),
                                        np.frombuffer(row["token_ids"], "<i4").tolist(),
                                        np.frombuffer(row["logprobs"], "<f4").tolist(), versions)
        assert -1 in versions and len(versions) == len(expected[(g, i)].token_ids) > 0
    assert plan.saved_episodes == expected


def test_a_stored_transcript_that_does_not_line_up_reads_back_as_none(tmp_path):
    """Not written by put_episodes (it refuses these): a hand-edited or damaged row is
    restarted, not resumed from tokens that do not line up with their logprobs."""
    store = make_store(tmp_path / "live.sqlite")
    g = reserve(store, 0, 1)
    a0, a1 = store.dispatch([g], policy_version=4)
    with store.atomic() as tx:
        pools.put_episodes(tx, [progress(a0, g, 0), progress(a1, g, 1)])
        tx.exec_driver_sql("UPDATE episode_tokens SET version_token_counts = '[[4,3],[-1,2]]' WHERE attempt_id = ?", (a1,))
    with store.read() as conn:
        got = pools.read_episodes(conn, running_only=True)
    store.close()
    assert got[(g, 0)].token_ids == TOKENS
    assert (got[(g, 1)].token_ids, got[(g, 1)].logprobs, got[(g, 1)].token_versions) == (None, None, None)


# ---------------------------------------------------------------- appended pieces (v1_11_a)


def _pieces(conn: sqlite3.Connection, attempt_id: int) -> list[tuple[int, list[int]]]:
    return [(first, np.frombuffer(t, "<i4").tolist()) for first, t in conn.execute(
        "SELECT first_token, token_ids FROM episode_tokens WHERE attempt_id = ? ORDER BY first_token", (attempt_id,))]


def test_a_turns_save_appends_only_the_tokens_the_turn_added(tmp_path, second_connection):
    """Three saves of one attempt, each naming what the one before wrote: three pieces,
    each holding only its turn's tokens, that join into the transcript (a save that
    rewrote the transcript so far would leave one piece of every token)."""
    store = make_store(tmp_path / "live.sqlite")
    g = reserve(store, 0, 1)
    a0, _ = store.dispatch([g], policy_version=4)
    for turn, (saved, upto) in enumerate([(0, 3), (3, 5), (5, 7)], start=1):
        with store.atomic() as tx:
            pools.put_episodes(tx, [EpisodeProgress(a0, g, 0, 0, turn, STATE, TOKENS[:upto], LOGPROBS[:upto],
                                                    VERSIONS[:upto], saved_tokens=saved)])
    store.close()
    conn = second_connection(tmp_path / "live.sqlite")
    assert _pieces(conn, a0) == [(0, TOKENS[:3]), (3, TOKENS[3:5]), (5, TOKENS[5:])]
    assert conn.execute("SELECT turn, transcript_tokens FROM env_episodes").fetchall() == [(3, 7)]
    attempt_id, turn, _, tokens, logprobs, runs = rows(conn)[f"{g}.0-a0"]
    assert np.frombuffer(tokens, "<i4").tolist() == TOKENS and np.frombuffer(logprobs, "<f4").tolist() == LOGPROBS
    assert json.loads(runs) == RUNS


def test_a_save_that_starts_over_replaces_every_piece_and_a_state_only_save_drops_them(tmp_path, second_connection):
    store = make_store(tmp_path / "live.sqlite")
    g = reserve(store, 0, 1)
    a0, _ = store.dispatch([g], policy_version=4)
    with store.atomic() as tx:
        pools.put_episodes(tx, [progress(a0, g, 0, tokens=TOKENS[:3], logprobs=LOGPROBS[:3], versions=VERSIONS[:3])])
        pools.put_episodes(tx, [EpisodeProgress(a0, g, 0, 0, 2, STATE, TOKENS, LOGPROBS, VERSIONS, saved_tokens=3)])
    with store.atomic() as tx:  # saved_tokens 0 (another writer's whole copy): one piece
        pools.put_episodes(tx, [progress(a0, g, 0, tokens=TOKENS[:4], logprobs=LOGPROBS[:4], versions=VERSIONS[:4])])
    assert _pieces(second_connection(tmp_path / "live.sqlite"), a0) == [(0, TOKENS[:4])]
    with store.atomic() as tx:  # more saved than the transcript holds: written whole, not trusted
        pools.put_episodes(tx, [EpisodeProgress(a0, g, 0, 0, 2, STATE, TOKENS[:2], LOGPROBS[:2], VERSIONS[:2],
                                                saved_tokens=6)])
    assert _pieces(second_connection(tmp_path / "live.sqlite"), a0) == [(0, TOKENS[:2])]
    with store.atomic() as tx:
        pools.put_episode(tx, a0, turn=3, state={"only": "state"})
    store.close()
    conn = second_connection(tmp_path / "live.sqlite")
    assert _pieces(conn, a0) == []
    assert conn.execute("SELECT transcript_tokens FROM env_episodes").fetchall() == [(None,)]


@pytest.mark.parametrize("end", ["finish", "abandon"])
def test_an_attempt_that_ends_leaves_no_piece_of_its_transcript(tmp_path, second_connection, end):
    store = make_store(tmp_path / "live.sqlite")
    g = reserve(store, 0, 1)
    a0, a1 = store.dispatch([g], policy_version=4)
    with store.atomic() as tx:
        pools.put_episodes(tx, [progress(a0, g, 0), progress(a1, g, 1)])
    if end == "finish":
        store.finish(a0, FinishedGeneration([1, 2], [-0.5, -0.5], 1.0, [(4, 2)]))
    else:
        store.abandon([a0], "deadline")
    store.close()
    conn = second_connection(tmp_path / "live.sqlite")
    assert conn.execute("SELECT DISTINCT attempt_id FROM episode_tokens").fetchall() == [(a1,)]
    assert conn.execute("SELECT count(*) FROM env_episodes").fetchone() == (1,)


@pytest.mark.parametrize("damage", [
    "UPDATE episode_tokens SET first_token = first_token + 1 WHERE first_token > 0",  # a gap
    "DELETE FROM episode_tokens WHERE first_token > 0",  # a lost piece: fewer tokens than recorded
    "UPDATE env_episodes SET transcript_tokens = transcript_tokens + 1",  # a count the pieces do not reach
    "UPDATE episode_tokens SET logprobs = substr(logprobs, 1, 4) WHERE first_token > 0",  # lengths that differ
])
def test_pieces_that_do_not_make_one_transcript_read_back_as_none(tmp_path, damage):
    """Not written by put_episodes: such an episode is restarted rather than resumed."""
    store = make_store(tmp_path / "live.sqlite")
    g = reserve(store, 0, 1)
    a0, a1 = store.dispatch([g], policy_version=4)
    with store.atomic() as tx:
        for attempt_id, index in ((a0, 0), (a1, 1)):
            pools.put_episodes(tx, [progress(attempt_id, g, index, tokens=TOKENS[:3], logprobs=LOGPROBS[:3],
                                             versions=VERSIONS[:3])])
            pools.put_episodes(tx, [EpisodeProgress(attempt_id, g, index, 0, 2, STATE, TOKENS, LOGPROBS, VERSIONS,
                                                    saved_tokens=3)])
        tx.exec_driver_sql(damage.replace("WHERE", f"WHERE attempt_id = {a1} AND") if "WHERE" in damage
                           else f"{damage} WHERE attempt_id = {a1}")
    with store.read() as conn:
        got = pools.read_episodes(conn, running_only=True)
    store.close()
    assert (got[(g, 0)].token_ids, got[(g, 0)].logprobs, got[(g, 0)].token_versions) == (TOKENS, LOGPROBS, VERSIONS)
    assert (got[(g, 1)].token_ids, got[(g, 1)].logprobs, got[(g, 1)].token_versions) == (None, None, None)
