"""The prefix cut's engine seam and order: the engines answer only what is new since given
offsets (`PrefixCapture.running_calls(since=...)`), the snapshot pump reads them before
its cut with the commit lock NOT held, and a token of a policy version newer than the
cut's trainer step is never saved. Real parts: the reference engine on the tiny policy,
a real store file, a real Publisher and snapshot pump; what was saved is read back
through a second connection."""

from __future__ import annotations

import dataclasses

from test_hostile_proofs_pump import DEADLINE_S, StepGate, Weights, _saved_calls
from test_streaming_pump import LengthEnv, make_parts, policy_dir  # noqa: F401 - fixture

from rolloutdb.controller.recovery.cut_contents import up_to_version
from rolloutdb.controller.recovery.env_checkpoint import NoEnvironmentCheckpoint
from rolloutdb.controller.recovery.snapshot_pump import SnapshotPump
from rolloutdb.controller.rollout.pump import RolloutPump
from rolloutdb.controller.run.sampler import PromptOrder
from rolloutdb.gpu_capture import ReferenceEngine
from rolloutdb.gpu_capture.protocol import GenerationRequest, RunningCall, SamplingParams
from rolloutdb.store import Publisher
from rolloutdb.store.checkpoints.layout import SNAPSHOT_DB


# ---- the engine seam ------------------------------------------------------------------------


def test_the_reference_engine_answers_each_call_from_its_offset_on_and_the_tails_add_up_to_the_whole(policy_dir):  # noqa: F811
    with ReferenceEngine(policy_dir, max_batch_size=2, num_threads=1) as engine:
        gate = StepGate(engine, at=5)
        future = engine.submit(GenerationRequest("c", [1, 5, 6], SamplingParams(max_tokens=30, seed=3)))
        assert gate.reached.wait(DEADLINE_S)
        whole = engine.running_calls()["c"]
        assert whole.start == 0 and len(whole.token_ids) == 5 and whole.end == 5
        tail = engine.running_calls({"c": 3})["c"]
        assert (tail.start, tail.token_ids, tail.logprobs, tail.token_versions) == (
            3, whole.token_ids[3:], whole.logprobs[3:], whole.token_versions[3:])
        at_end = engine.running_calls({"c": 5})["c"]
        assert (at_end.start, at_end.token_ids, at_end.end) == (5, [], 5)
        past = engine.running_calls({"c": 9})["c"]  # an offset past the end: answered whole
        assert past == whole
        assert engine.running_calls({"other": 2})["c"] == whole
        gate.release.set()
        result = future.result(DEADLINE_S)
    assert result.token_ids[:5] == whole.token_ids


def test_a_call_keeps_only_its_tokens_up_to_the_cuts_version():
    call = RunningCall([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0], [0, 1, 1, 2], 10, 0, None, start=7)
    assert up_to_version(call, 1) == dataclasses.replace(call, token_ids=[1, 2, 3], logprobs=[-1.0, -2.0, -3.0],
                                                         token_versions=[0, 1, 1])
    assert up_to_version(call, 2) is call
    assert up_to_version(call, -1).token_ids == [] and up_to_version(call, -1).start == 7


# ---- the order of the cut -------------------------------------------------------------------


class LockWatchingEngine(ReferenceEngine):
    """Notes whether the train pump's commit lock was held when the cut read it."""

    commit_lock = None
    held_at_read: list[bool] = []

    def running_calls(self, since=None):
        self.held_at_read = [*self.held_at_read, self.commit_lock.locked()]
        return super().running_calls(since)


class NewerVersionEngine(ReferenceEngine):
    """Reports, after each call's tokens, two more decoded by policy version 1 (what a
    refit racing the read would add), though the trainer is at step 0."""

    def running_calls(self, since=None):
        calls = super().running_calls(since)
        return {rid: dataclasses.replace(c, token_ids=[*c.token_ids, 7, 8], logprobs=[*c.logprobs, -1.0, -1.0],
                                         token_versions=[*c.token_versions, 1, 1])
                for rid, c in calls.items()}


def _cut_gated(tmp_path, policy_dir, engine_class):  # noqa: F811
    """A prefix-level pump whose long calls have decoded 6 tokens, the engine held after
    its sixth step, cut by a real snapshot attempt at step 0. Returns (snapshot file, engine)."""
    first = [r.prompt_id for r in PromptOrder(64, seed=0).take(0, 4)]
    parts, _ = make_parts(tmp_path, policy_dir, LengthEnv(long=40, long_prompt=first[0]),
                          overrides={"algorithm": {"groups_per_step": 4, "group_size": 2},
                                     "rollout_recovery": {"target_level": "prefix"}})
    parts.engine.close()
    eng = parts.engine = engine_class(policy_dir, max_batch_size=16, num_threads=1)
    eng.commit_lock = parts.runtime.commit_lock
    gate = StepGate(eng, at=6)
    publisher = Publisher(tmp_path / "checkpoints")
    try:
        pump = RolloutPump(parts)
        pump._commit()  # dispatches and submits; the pump's loop never runs
        assert gate.reached.wait(DEADLINE_S), "the engine did not reach its sixth step"
        publisher.publish_bootstrap(Weights().save_checkpoint)
        snapshots = SnapshotPump(parts, publisher, interval_s=60.0, config_text="a: 1\n",
                                 env_checkpoint=NoEnvironmentCheckpoint())
        snapshots.uncommitted_calls = pump.uncommitted_calls
        result = snapshots.attempt(force=True)
        assert result.outcome == "published", result
    finally:
        parts.runtime.stop.set()
        gate.release.set()
        parts.engine.close()
        parts.store.close()
        publisher.close()
    return tmp_path / "checkpoints" / "bootstrap" / "rollout_snapshots" / f"snapshot_{result.sequence}" / SNAPSHOT_DB, eng


def test_the_cut_reads_the_engines_running_calls_with_the_commit_lock_not_held(tmp_path, policy_dir):  # noqa: F811
    snap, eng = _cut_gated(tmp_path, policy_dir, LockWatchingEngine)
    assert eng.held_at_read == [False], "the engine was read holding the commit lock (or not once)"
    saved = _saved_calls(snap)
    assert sorted(len(t) for t, _, _ in saved.values() if len(t) > 1) == [6, 6], "the long calls were still saved"


def test_no_token_of_a_policy_version_newer_than_the_cuts_trainer_step_is_saved(tmp_path, policy_dir):  # noqa: F811
    snap, _ = _cut_gated(tmp_path, policy_dir, NewerVersionEngine)
    saved = _saved_calls(snap)
    assert saved, "the running calls were saved"
    for rid, (tokens, _, versions) in saved.items():
        assert versions == [0] * len(tokens), f"{rid}: saved versions {versions} at a cut of step 0"
    assert sorted(len(t) for t, _, _ in saved.values() if len(t) > 1) == [6, 6]



class _Logprob:
    def __init__(self, value: float):
        self.logprob = value


class _Reads(list):
    """vLLM's output token list, counting the positions read through it."""

    read = 0

    def __getitem__(self, index):
        got = super().__getitem__(index)
        _Reads.read += len(got) if isinstance(index, slice) else 1
        return got


class _PerPosition(list):
    read = 0

    def __getitem__(self, index):
        _PerPosition.read += 1
        return super().__getitem__(index)


def _vllm_processor(output: list[int], starts: list[tuple[str, int]]):
    """An object shaped like vLLM's output processor, as `read_request_states` reads it
    (the real one needs vLLM, not installed here; tests/test_vllm_engine.py runs that)."""
    ns = type("NS", (), {})
    state = ns()
    state.detokenizer = ns()
    state.detokenizer.output_token_ids = _Reads(output)
    state.logprobs_processor = ns()
    state.logprobs_processor.logprobs = _PerPosition({t: _Logprob(-0.5 * (i + 1))} for i, t in enumerate(output))
    state.weight_version_starts = starts
    llm = ns()
    llm.output_processor = ns()
    llm.output_processor.request_states = {"v-0": state}
    llm.output_processor.external_req_ids = {"v": ["v-0"]}
    return llm


def test_the_vllm_engine_reads_only_the_positions_past_the_offset_and_its_tails_add_up_to_the_whole():
    from rolloutdb.gpu_capture.vllm_engine import read_request_states, tail_of_call, vllm_offset

    output = list(range(10, 30))  # vLLM's 20 tokens after our 3-token prefix
    llm = _vllm_processor(output, [("0", 0), ("1", 12)])
    prefix, prefix_logprobs, prefix_versions = [1, 2, 3], [-0.1, -0.2, -0.3], [0, 0, 0]

    def read(offset):
        _Reads.read = _PerPosition.read = 0
        states = read_request_states(llm, ["v"], {"v": vllm_offset(offset, len(prefix))})
        return tail_of_call(prefix, prefix_logprobs, prefix_versions, offset, states.get("v"), 5)

    whole = read(0)
    assert whole[0] == prefix + output and whole[3] == 0
    assert whole[2] == [0] * 3 + [0] * 12 + [1] * 8
    assert whole[1] == prefix_logprobs + [-0.5 * (i + 1) for i in range(20)]
    for offset in (2, 3, 4, 17, 23):
        tokens, logprobs, versions, start = read(offset)
        assert start == offset and (tokens, logprobs, versions) == (whole[0][offset:], whole[1][offset:],
                                                                     whole[2][offset:]), offset
        assert _Reads.read == _PerPosition.read == 23 - max(offset, 3), "read more of vLLM's output than the tail"
    assert read(40)[3] == 0 and read(40)[0] == whole[0]  # past the end: whole
