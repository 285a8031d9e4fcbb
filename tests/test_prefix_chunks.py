"""Prefix chunks (revision v1_3_a): what a prefix cut saves of a running call and what a
restore hands back, on real SQLite files read back through a second connection, and the
engine's side of the cut (`ReferenceEngine.running_calls`) resumed exactly."""

from __future__ import annotations

import contextlib
import sqlite3
import time

import numpy as np
import pytest

from rolloutdb.gpu_capture.protocol import GenerationRequest, PrefixCapture, SamplingParams
from rolloutdb.gpu_capture.reference_engine import ReferenceEngine
from rolloutdb.store import CallPrefix, Reservation, Store, pools

RUN = dict(config_fingerprint="cfg", dataset_fingerprint="data", forest_training={})


def _running_attempt(tmp_path) -> tuple[Store, int]:
    store = Store.create(tmp_path / "s.sqlite", ledger_dispatch=True, replay_capacity=4, **RUN)
    (g,) = store.reserve([Reservation(0, 0, 7)], num_generations=1, target_step=1)
    (attempt_id,) = store.dispatch([g], policy_version=0)
    return store, attempt_id


def test_a_prefix_that_spans_a_refit_is_saved_as_one_chunk_per_version_and_comes_back_whole(tmp_path):
    store, a = _running_attempt(tmp_path)
    tokens, logprobs, versions = [5, 6, 7, 8, 9], [-0.5, -0.25, -1.5, -2.0, -0.125], [3, 3, 3, 4, 4]
    with store.atomic() as tx:
        n = pools.put_prefixes(tx, [CallPrefix(a, tokens, logprobs, versions, max_tokens=12, min_tokens=2)])
    assert n == 2
    with contextlib.closing(sqlite3.connect(tmp_path / "s.sqlite")) as conn:  # a second connection
        rows = conn.execute("SELECT chunk_index, prefix_count, token_ids, logprobs, policy_version, max_tokens, "
                            "min_tokens FROM token_chunks WHERE attempt_id = ? ORDER BY chunk_index", (a,)).fetchall()
    assert [(i, p, np.frombuffer(t, "<i4").tolist(), np.frombuffer(lp, "<f4").tolist(), v, mx, mn)
            for i, p, t, lp, v, mx, mn in rows] == [
        (0, 0, [5, 6, 7], [-0.5, -0.25, -1.5], 3, 12, 2),
        (1, 3, [8, 9], [-2.0, -0.125], 4, 12, 2),
    ]
    with store.read() as conn:
        back = CallPrefix.of(pools.read_chunks(conn, a))
    assert back == CallPrefix(a, tokens, logprobs, versions, 12, 2)
    store.close()


def test_chunks_with_a_gap_or_logprobs_in_some_chunks_only_give_no_prefix(tmp_path):
    store, a = _running_attempt(tmp_path)
    with store.atomic() as tx:
        pools.add_chunk(tx, a, [1, 2], prefix_count=0, max_tokens=8, min_tokens=0, policy_version=0)
        pools.add_chunk(tx, a, [3], prefix_count=5, max_tokens=8, min_tokens=0, policy_version=0)  # a gap
    with store.read() as conn:
        chunks = pools.read_chunks(conn, a)
    assert CallPrefix.of(chunks) is None
    assert CallPrefix.of(chunks[:1]) == CallPrefix(a, [1, 2], None, [0, 0], 8, 0)  # before v1_3_a: no logprobs
    mixed = [chunks[0], pools.Chunk(a, 1, 2, [3], 8, 0, 0, [-1.0])]
    assert CallPrefix.of(mixed) is None
    store.close()


def test_a_prefix_whose_lengths_disagree_is_refused_and_nothing_is_written(tmp_path):
    store, a = _running_attempt(tmp_path)
    good = CallPrefix(a, [1, 2], [-1.0, -1.0], [0, 0], 8, 0)
    bad = CallPrefix(a, [1, 2, 3], [-1.0], [0, 0, 0], 8, 0)
    with pytest.raises(ValueError, match="give one version and one logprob per token"):
        with store.atomic() as tx:
            pools.put_prefixes(tx, [good, bad])
    with contextlib.closing(sqlite3.connect(tmp_path / "s.sqlite")) as conn:
        assert conn.execute("SELECT count(*) FROM token_chunks").fetchone() == (0,)
    store.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from rolloutdb.gpu_capture.tiny_policy import build_tiny_policy

    policy = build_tiny_policy(tmp_path_factory.mktemp("policy"), seed=0)
    with ReferenceEngine(policy, max_batch_size=4) as e:
        yield e


def test_a_call_cut_through_running_calls_resumes_to_exactly_the_uninterrupted_output(engine):
    assert isinstance(engine, PrefixCapture)
    params = SamplingParams(max_tokens=40, min_tokens=6, temperature=1.0, seed=1234, stop=("99",),
                            presence_penalty=0.3, frequency_penalty=0.2)
    prompt = [1, 5, 6, 7, 8]
    whole = engine.submit(GenerationRequest("whole", prompt, params)).result(60)
    future = engine.submit(GenerationRequest("cut", prompt, params))
    cut = None
    deadline = time.monotonic() + 60
    while cut is None and time.monotonic() < deadline:
        call = engine.running_calls().get("cut")
        if call is not None and 3 <= len(call.token_ids) < len(whole.token_ids):
            cut = call
            engine.abort(["cut"])
        elif future.done():
            break
    future.result(60)
    if cut is None:
        pytest.skip("the call finished before a cut could catch it mid-way")
    assert (cut.max_tokens, cut.min_tokens) == (40, 6)
    assert len(cut.logprobs) == len(cut.token_ids) == len(cut.token_versions)
    assert cut.token_ids == whole.token_ids[:len(cut.token_ids)]
    resumed = engine.submit(GenerationRequest("resumed", prompt, params, prefix_ids=cut.token_ids,
                                              prefix_versions=cut.token_versions,
                                              prefix_logprobs=cut.logprobs)).result(60)
    assert resumed.token_ids == whole.token_ids
    assert resumed.logprobs == whole.logprobs
    assert resumed.token_versions == whole.token_versions
    assert resumed.text == whole.text and resumed.finish_reason == whole.finish_reason
    assert engine.cut_hold_s >= 0.0
