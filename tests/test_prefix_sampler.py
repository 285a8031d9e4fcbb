"""A saved prefix names the sampler that decoded it, and a continuation is reported
bitwise-exact only by an engine of that same sampler (issue 29 item 3; revision
v1_10_a). Reference engine, real SQLite files, checked through a second connection.

Why it matters: bitwise means "token for token the uninterrupted call", which holds only
where the engine that continues draws exactly as the one that decoded the prefix did;
vLLM changed its sampling RNG within 2026, so a prefix saved under one version and
continued under another would otherwise be claimed bitwise.
"""

from __future__ import annotations

import shutil
import sqlite3
import time
from pathlib import Path

import pytest

from rolloutdb.gpu_capture import GenerationRequest, ReferenceEngine, SamplingParams, build_tiny_policy, encode_strict
from rolloutdb.gpu_capture.protocol import sampler_change
from rolloutdb.gpu_capture.reference_engine import SAMPLER_IDENTITY
from rolloutdb.store import ChunkReference, Reservation, SegmentRef, Store, pools
from rolloutdb.store.sqlite.upgrade import upgrade_file

FIXTURES = Path(__file__).resolve().parent / "fixtures"
OTHER = "vllm/0.31.0/v1-per-request-generator"
PARAMS = SamplingParams(max_tokens=24, min_tokens=0, temperature=1.0, seed=99)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "seed0", seed=0)


def _prompt(eng) -> list[int]:
    return encode_strict(eng.tokenizer, "task 3: 8 + 4 = ?\n", add_bos=True)


def _continue(eng, whole, k: int, sampler: str | None, rid: str):
    return eng.submit(GenerationRequest(rid, _prompt(eng), PARAMS, prefix_ids=whole.token_ids[:k],
                                        prefix_versions=whole.token_versions[:k], prefix_logprobs=whole.logprobs[:k],
                                        prefix_sampler=sampler)).result(60)


def test_a_running_call_carries_the_engines_sampler_identity(policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1) as eng:
        assert eng.sampler_identity == SAMPLER_IDENTITY
        future = eng.submit(GenerationRequest("c", _prompt(eng), SamplingParams(max_tokens=400, seed=1)))
        deadline = time.monotonic() + 60
        calls = {}
        while not calls.get("c") and time.monotonic() < deadline:
            calls = eng.running_calls()
        eng.abort(["c"])
        future.result(60)
    assert calls["c"].sampler == SAMPLER_IDENTITY


def test_a_prefix_another_sampler_decoded_continues_distribution_exact_never_reported_bitwise(policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1) as eng:
        whole = eng.submit(GenerationRequest("w", _prompt(eng), PARAMS)).result(60)
        same = _continue(eng, whole, 8, SAMPLER_IDENTITY, "same")
        other = _continue(eng, whole, 8, OTHER, "other")
        unknown = _continue(eng, whole, 8, None, "unknown")
    assert same.extra["prefix_exactness"] == "bitwise" and same.token_ids == whole.token_ids
    assert other.extra["prefix_exactness"] == "distribution" and other.token_ids[:8] == whole.token_ids[:8]
    assert unknown.extra["prefix_exactness"] == "distribution"
    assert "prefix_fallback" not in other.extra


def test_asked_for_bitwise_a_prefix_another_sampler_decoded_restarts_naming_both(policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1, prefix_exactness="bitwise") as eng:
        whole = eng.submit(GenerationRequest("w", _prompt(eng), PARAMS)).result(60)
        other = _continue(eng, whole, 8, OTHER, "other")
        same = _continue(eng, whole, 8, SAMPLER_IDENTITY, "same")
    assert other.extra["prefix_fallback"].startswith("engine_changed_not_bitwise")
    assert OTHER in other.extra["prefix_fallback"] and SAMPLER_IDENTITY in other.extra["prefix_fallback"]
    assert other.extra["num_prefix_tokens"] == 0
    assert other.token_ids == whole.token_ids  # restarted from scratch: seeded, so the same call
    assert same.extra["prefix_exactness"] == "bitwise"


def test_the_rule_names_an_unrecorded_sampler_and_lets_a_call_without_prefix_through():
    request = GenerationRequest("r", [1, 2], PARAMS, prefix_ids=[5], prefix_versions=[0])
    assert "unrecorded sampler" in sampler_change(request, SAMPLER_IDENTITY)
    assert sampler_change(GenerationRequest("r", [1, 2], PARAMS), SAMPLER_IDENTITY) is None


def test_chunks_store_their_sampler_and_a_prefix_of_mixed_samplers_has_none(tmp_path):
    store = Store.create(tmp_path / "s.sqlite", config_fingerprint="c", dataset_fingerprint="d", ledger_dispatch=True,
                         replay_capacity=4, seed=0)
    segment = SegmentRef(1, "segment_000001.sqlite", "0" * 64, 10, 2)
    groups = store.reserve([Reservation(0, 0, 0)], num_generations=2, target_step=1)
    a, b = store.dispatch(groups, policy_version=0)  # two running attempts
    with store.atomic() as tx:
        pools.put_prefixes(tx, [pools.CallPrefix(a, [3, 4], [-1.0, -1.0], [0, 0], 8, 0, SAMPLER_IDENTITY)])
        raw = tx.connection.driver_connection
        pools.put_chunk_references(raw, [ChunkReference(b, 0, 0, 8, 0, 0, segment, 0, OTHER),
                                         ChunkReference(b, 1, 1, 8, 0, 1, segment, 1, None)])
    store.close()
    with sqlite3.connect(tmp_path / "s.sqlite") as conn:
        rows = conn.execute("SELECT attempt_id, chunk_index, sampler FROM token_chunks ORDER BY attempt_id, chunk_index")
        assert rows.fetchall() == [(a, 0, SAMPLER_IDENTITY), (b, 0, OTHER), (b, 1, None)]
    chunk = lambda i, who: pools.Chunk(7, i, i, [9], 8, 0, 0, [-1.0], who)  # noqa: E731
    assert pools.CallPrefix.of([chunk(0, OTHER), chunk(1, OTHER)]).sampler == OTHER
    assert pools.CallPrefix.of([chunk(0, OTHER), chunk(1, SAMPLER_IDENTITY)]).sampler is None


def test_a_store_upgraded_from_v1_9_a_reads_its_chunks_as_of_an_unrecorded_sampler(tmp_path):
    path = tmp_path / "store.sqlite"
    shutil.copyfile(FIXTURES / "store_v1_9_a.sqlite", path)
    upgrade_file(path)
    store = Store.open(path)
    try:
        with store.read() as conn:
            attempts = [a for (a,) in conn.exec_driver_sql("SELECT DISTINCT attempt_id FROM token_chunks").all()]
            chunks = pools.read_chunks_of(conn, attempts)
    finally:
        store.close()
    assert attempts and all(c.sampler is None for cs in chunks.values() for c in cs)
    assert all(pools.CallPrefix.of(cs).sampler is None for cs in chunks.values())


def test_a_call_that_finished_before_its_commit_is_saved_whole_with_its_engines_sampler(policy_dir):
    # A cut saves a call the pump has finished but not committed as a complete prefix
    # (live_episode.whole_call); its sampler comes from the result, or the resumed call
    # would be reported distribution although the engine that decoded it resumes it.
    from types import SimpleNamespace

    from rolloutdb.controller.rollout.live_episode import whole_call

    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1) as eng:
        result = eng.submit(GenerationRequest("w", _prompt(eng), PARAMS)).result(60)
    assert result.extra["sampler"] == SAMPLER_IDENTITY
    saved = whole_call(result, SimpleNamespace(limits=(PARAMS.max_tokens, PARAMS.min_tokens), cut_refused=None))
    assert saved.sampler == SAMPLER_IDENTITY and saved.token_ids == result.token_ids
