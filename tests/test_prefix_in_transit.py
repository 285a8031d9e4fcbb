"""At prefix level a cut finds every call that finished before it, wherever it is on
its way to the store: still in the engine, done but not yet taken from the pump's
completion queue (in transit), or absorbed by the pump but not yet committed. A call in
none of those places is in the store. Here the pump's thread never runs, so finished
calls stay in transit until the test hands them to the pump one by one."""

from __future__ import annotations

import concurrent.futures

from test_streaming_pump import LengthEnv, close, make_parts, policy_dir  # noqa: F401 - fixture

from rolloutdb.controller.rollout.pump import RolloutPump


def _finished_calls(pump: RolloutPump) -> dict:
    futures = list(pump.calls.running)
    concurrent.futures.wait(futures, timeout=60)
    assert all(f.done() for f in futures), "the engine did not finish the calls in time"
    return {f.result().request_id: f for f in futures}


def test_calls_done_in_the_engine_but_not_yet_taken_by_the_pump_are_saved_whole(tmp_path, policy_dir):  # noqa: F811
    parts, _ = make_parts(tmp_path, policy_dir, LengthEnv(long=5, long_prompt=None),
                          overrides={"rollout_recovery": {"target_level": "prefix"}})
    try:
        pump = RolloutPump(parts)
        pump._commit()  # dispatches the first step's groups and submits their calls
        done = _finished_calls(pump)
        assert len(done) == 8
        assert parts.engine.running_calls() == {}  # no longer in the engine...
        saved = pump.uncommitted_calls()  # ...so the pump must hand them to the cut
        assert set(saved) == set(done)
        for rid, future in done.items():
            result = future.result()
            call = saved[rid]
            assert (call.token_ids, call.logprobs, call.token_versions) == (
                result.token_ids, result.logprobs, result.token_versions)
            assert len(call.token_ids) == 5 and (call.max_tokens, call.min_tokens) == (5, 5)
    finally:
        close(parts)


def test_a_call_the_pump_takes_stays_visible_to_the_cut_until_its_batch_commits(tmp_path, policy_dir):  # noqa: F811
    parts, _ = make_parts(tmp_path, policy_dir, LengthEnv(long=5, long_prompt=None),
                          overrides={"rollout_recovery": {"target_level": "prefix"}})
    try:
        pump = RolloutPump(parts)
        pump._commit()
        done = _finished_calls(pump)
        taken = sorted(done)[:3]
        for rid in taken:
            pump.calls.on_done(done[rid])  # absorbed: out of `running`, into the batch
        assert set(pump.uncommitted_calls()) == set(done)
        pump._commit()  # the batch with the three commits: the store has them now
        assert set(pump.uncommitted_calls()) == set(done) - set(taken)
    finally:
        close(parts)
