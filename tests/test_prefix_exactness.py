"""Prefix-level exactness on the reference engine (issue 13, item 3): a call cut at any
point and continued from its prefix ends exactly as the uninterrupted call, token for
token, logprob for logprob, version for version. What tests/test_reference_engine.py
already proves (seeded and greedy streams, a stop string straddling the cut, min_tokens
and penalties counting the prefix, max_tokens at the limit) is not repeated here; this
module adds:

- a stop string completed inside the prefix ends the continued call at once, decoding
  nothing;
- a cut between the bytes of one multi-byte character decodes to the same text;
- a prefix decoded under version v and continued after a refit keeps v on its tokens and
  the new version on the rest, so batch age stays exact;
- a call the engine declares it cannot cut (`PrefixCapture.cut_support`) is left out of
  the cut on its own, and the trace's `call_fallback` says why (a real run, in process,
  on a reference engine with that one capability turned off).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from pathlib import Path

import pytest

from rolloutdb.controller.training.pump import batch_age
from rolloutdb.gpu_capture import GenerationRequest, ReferenceEngine, SamplingParams, build_tiny_policy, encode_strict
from rolloutdb.gpu_capture.protocol import PrefixCapture
from rolloutdb.store import codec, open_tracer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "seed0", seed=0)


@pytest.fixture(scope="module")
def engine(policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=64, num_threads=1) as eng:
        yield eng


def prompt(eng, i: int) -> list[int]:
    return encode_strict(eng.tokenizer, f"task {i}: {i * 7 % 13} + {i * 5 % 11} = ?\n", add_bos=True)


def call(rid, prompt_ids, **params) -> GenerationRequest:
    return GenerationRequest(rid, prompt_ids, SamplingParams(**params))


def continued(request: GenerationRequest, full, k: int, rid: str | None = None) -> GenerationRequest:
    """The call as a restore re-issues it: same prompt and params, the first k tokens of
    `full` (with their logprobs and versions) as its prefix."""
    return GenerationRequest(rid or request.request_id, request.prompt_ids, request.params,
                             prefix_ids=full.token_ids[:k], prefix_versions=full.token_versions[:k],
                             prefix_logprobs=full.logprobs[:k])


def assert_same_output(got, expected):
    assert got.token_ids == expected.token_ids
    assert got.logprobs == expected.logprobs  # bit-exact floats
    assert got.token_versions == expected.token_versions
    assert (got.finish_reason, got.text, got.extra["stop_reason"]) == (
        expected.finish_reason, expected.text, expected.extra["stop_reason"])


# ---- a stop string completed inside the prefix ---------------------------------------------


def _stop_ending_a_call(eng):
    """A seeded call and a two-character stop string its plain output first completes at
    some token n past min_tokens, well before the end: (request with the stop, n, the plain
    output). n is found here by decoding, not by the engine's stop search."""
    tok = eng.tokenizer
    plain = [call(f"p{s}", prompt(eng, s % 7), max_tokens=40, min_tokens=4, temperature=1.0, seed=s) for s in range(32)]
    for request, out in zip(plain, eng.generate(plain)):
        texts = [tok.decode(out.token_ids[:n], skip_special_tokens=True) for n in range(len(out.token_ids) + 1)]
        for n in range(12, len(out.token_ids) - 5):
            stop = texts[n][-2:]
            if len(stop) == 2 and texts[n - 1] != texts[n] and stop not in texts[n - 1]:
                params = SamplingParams(max_tokens=40, min_tokens=4, temperature=1.0, seed=request.params.seed,
                                        stop=("QQQ", stop))
                return GenerationRequest("stop", request.prompt_ids, params), n, out
    raise AssertionError("no seed gave a stop string to end a call with")


def test_a_stop_string_completed_inside_the_prefix_ends_the_continued_call_at_once_as_it_ended_uninterrupted(engine):
    request, n, plain = _stop_ending_a_call(engine)
    uninterrupted = engine.generate([request])[0]
    assert (uninterrupted.finish_reason, len(uninterrupted.token_ids)) == ("stop", n)
    assert uninterrupted.extra["stop_reason"] == request.params.stop[1]
    assert uninterrupted.token_ids == plain.token_ids[:n]
    rows, steps = engine.decoded_rows, engine.steps
    # Cut right after the token that completed the stop string (the finished call a cut
    # saved whole before its commit), and cut later still (a prefix running past it).
    for k, source in ((n, uninterrupted), (n + 5, plain)):
        got = engine.generate([continued(request, source, k)])[0]
        assert_same_output(got, uninterrupted)
        assert got.extra["num_prefix_tokens"] == k
    assert (engine.decoded_rows, engine.steps) == (rows, steps)  # no engine step decoded anything


def test_a_stop_string_inside_the_prefix_but_before_min_tokens_does_not_end_the_continued_call(engine):
    request, n, plain = _stop_ending_a_call(engine)
    late = GenerationRequest("late", request.prompt_ids, SamplingParams(
        max_tokens=40, min_tokens=n, temperature=1.0, seed=request.params.seed, stop=request.params.stop))
    uninterrupted = engine.generate([late])[0]
    assert len(uninterrupted.token_ids) > n  # the stop at n came within the first min_tokens: not searched
    assert_same_output(engine.generate([continued(late, uninterrupted, n)])[0], uninterrupted)


# ---- a cut inside a multi-byte character ---------------------------------------------------

ALPHABET = "aé€"  # 'é' is two UTF-8 bytes, '€' three: each byte one token (9 tokens in all)


@pytest.fixture(scope="module")
def multibyte(tmp_path_factory):
    path = build_tiny_policy(tmp_path_factory.mktemp("policy") / "multibyte", seed=0, alphabet=ALPHABET)
    with ReferenceEngine(path, max_batch_size=64, num_threads=1) as eng:
        yield eng


def _split_characters(eng, char: str, calls: int = 64):
    """Seeded calls whose output holds `char` whole, each with the index of its first
    byte's token (found by comparing token ids with the character's bytes' ids)."""
    byte_ids = eng.tokenizer.encode(char, add_special_tokens=False)
    assert len(byte_ids) == len(char.encode()) > 1, "each byte of the character should be one token"
    bos = eng.tokenizer.bos_token_id
    # min_tokens 0 as in the stop-string case below (masking EOS would change the draws).
    batch = [call(f"m{s}", [bos, *eng.tokenizer.encode("aé", add_special_tokens=False)], max_tokens=60,
                  temperature=1.0, seed=s) for s in range(calls)]
    found = []
    for request, out in zip(batch, eng.generate(batch)):
        ids = out.token_ids
        starts = [i for i in range(len(ids) - len(byte_ids) + 1) if ids[i:i + len(byte_ids)] == byte_ids]
        if starts:
            found.append((request, out, starts[0], byte_ids))
    return found


@pytest.mark.parametrize("char", ["é", "€"])
def test_a_call_cut_between_the_bytes_of_one_character_continues_to_the_same_text(multibyte, char):
    tok = multibyte.tokenizer
    found = _split_characters(multibyte, char, calls=128 if char == "é" else 512)
    assert found, f"no call decoded {char!r}"
    request, uninterrupted, start, byte_ids = found[0]
    assert char in uninterrupted.text
    for inside in range(1, len(byte_ids)):  # after the first byte, (for '€') after the second
        k = start + inside
        assert tok.decode(uninterrupted.token_ids[:k]).endswith("\ufffd")  # the cut splits the character
        got = multibyte.generate([continued(request, uninterrupted, k)])[0]
        assert_same_output(got, uninterrupted)
        # What the environment's parser gets: the token ids, decoded whole.
        assert tok.decode(got.token_ids, skip_special_tokens=True) == uninterrupted.text
        assert tok.decode(got.token_ids[: start + len(byte_ids)]).endswith(char)
    # A stop string that is the character itself, completed by the byte after the cut.
    stopping = GenerationRequest("ms", request.prompt_ids, SamplingParams(
        max_tokens=60, min_tokens=0, temperature=1.0, seed=request.params.seed, stop=(char,)))
    stopped = multibyte.generate([stopping])[0]
    assert (stopped.finish_reason, stopped.extra["stop_reason"]) == ("stop", char)
    first = len(stopped.token_ids) - len(byte_ids)
    assert stopped.token_ids[first:] == byte_ids and stopped.text.endswith(char) and "\ufffd" not in stopped.text[-1:]
    for inside in range(1, len(byte_ids)):
        assert_same_output(multibyte.generate([continued(stopping, stopped, first + inside)])[0], stopped)


# ---- refit: prefix tokens keep the version that produced them -------------------------------


class _StepGate:
    """Pauses the engine's worker after a chosen step, so a refit lands between two steps."""

    def __init__(self, eng, at_step: int):
        self.eng, self.at_step, self.start = eng, at_step, eng.steps
        self.reached, self.release = threading.Event(), threading.Event()
        eng.step_callback = self._callback

    def _callback(self, step):
        if step - self.start == self.at_step:
            self.reached.set()
            self.release.wait(30)


def test_a_prefix_decoded_under_version_v_and_continued_after_a_refit_keeps_v_on_its_tokens_and_v_plus_1_after(
        policy_dir, tmp_path):
    other = build_tiny_policy(tmp_path / "seed1", seed=1)  # the weights of version 5
    from rolloutdb.gpu_capture import load_policy

    new_state = load_policy(other)[0].state_dict()
    request = call("f", [1, 5, 6, 7, 8, 9], max_tokens=24, min_tokens=24, temperature=1.0, seed=9)
    k = 7
    # The uninterrupted call: version 4 decodes k tokens, then the refit to 5 lands.
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1, policy_version=4) as eng:
        gate = _StepGate(eng, at_step=k)
        future = eng.submit(request)
        assert gate.reached.wait(60)
        eng.load_weights(new_state, version=5)
        gate.release.set()
        uninterrupted = future.result(60)
        eng.step_callback = None
    # The same call cut at k under version 4 (what a snapshot saved before the stop).
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1, policy_version=4) as eng:
        whole = eng.generate([request])[0]
        cut = whole.token_ids[:k], whole.logprobs[:k], whole.token_versions[:k]
    assert cut[2] == [4] * k and uninterrupted.token_ids[:k] == cut[0]
    # Resumed after the restart on an engine that already runs version 5.
    with ReferenceEngine(other, max_batch_size=4, num_threads=1, policy_version=5) as eng:
        got = eng.generate([GenerationRequest("f", request.prompt_ids, request.params, prefix_ids=cut[0],
                                              prefix_versions=cut[2], prefix_logprobs=cut[1])])[0]
        recomputed = eng.generate([GenerationRequest("g", request.prompt_ids, request.params, prefix_ids=cut[0],
                                                     prefix_versions=cut[2])])[0]
    assert got.token_versions == [4] * k + [5] * (24 - k)
    assert got.logprobs[:k] == cut[1]  # the logprobs version 4 reported, not version 5's
    assert recomputed.logprobs[:k] != cut[1]  # (version 5's would differ: keeping them matters)
    assert_same_output(got, uninterrupted)
    # Batch age of a step-7 batch (trained on version 6) made of this call, by hand:
    # k tokens 2 versions old and 24 - k tokens 1 version old.
    assert batch_age(7, [codec.version_runs(got.token_versions)]) == ((6 - 4) * k + (6 - 5) * (24 - k)) / 24


# ---- a call the engine cannot cut falls back on its own --------------------------------------

LONG = 12
REFUSED = f"min_tokens >= {LONG} (test engine: no long min_tokens on a continued call)"


class EngineWithoutLongMinTokensCuts(ReferenceEngine):
    """The reference engine with one capability turned off: it cannot continue a call
    whose min_tokens is LONG or more from a prefix, says so through `cut_support`, and
    refuses such a continuation if one is submitted anyway."""

    def cut_support(self, request):
        return REFUSED if request.params.min_tokens >= LONG else None

    def submit(self, request):
        if request.prefix_ids and request.params.min_tokens >= LONG:
            raise ValueError(f"{request.request_id}: {REFUSED}")
        return super().submit(request)


def _rows(db: Path, sql: str, *args) -> list[tuple]:
    uri = f"file:{db}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
        return conn.execute(sql, args).fetchall()


@pytest.fixture(scope="module")
def refused_run(tmp_path_factory, monkeypatch_module):
    from rolloutdb import cli
    from rolloutdb.controller.job import build

    made = []

    def build_engine(config, policy_dir):
        made.append(EngineWithoutLongMinTokensCuts(policy_dir, max_batch_size=config.generation.max_batch_size,
                                                   num_threads=config.cluster.torch_threads))
        return made[-1]

    monkeypatch_module.setattr(build, "build_engine", build_engine)
    # The controller leaves its trace writer to close at interpreter exit; in process, the
    # test closes it (writing what is still queued) before reading the file.
    from rolloutdb.controller.job import controller

    tracers = []
    monkeypatch_module.setattr(controller, "open_tracer",
                               lambda *a, **k: tracers.append(open_tracer(*a, **k)) or tracers[-1])
    run_dir = tmp_path_factory.mktemp("refused") / "run"
    # The long-tail task sets each reply's (min_tokens, max_tokens) to (L, L + 1); with a
    # light tail (alpha 0.3) about half the targets are LONG digits or more (refused here),
    # and both kinds run long enough to be caught by cuts.
    code = cli.main(["train", "--config", str(REPO / "examples" / "multiturn.yaml"), "--run-dir", str(run_dir),
                     "run.seed=5", "algorithm.total_steps=8", "environment.tail_alpha=0.3", "algorithm.discard_zero_variance=false",
                     "rollout_recovery.target_level=prefix", "rollout_checkpointing.interval_s=0.05",
                     "rollout_checkpointing.keep_last=1000", "checkpointing.keep_last=1000", "checkpointing.interval_steps=1", "trace.enabled=true", "logging.progress=false",
                     "logging.plot=false"])
    assert code == 0
    for tracer in tracers:
        tracer.close()
    assert made and isinstance(made[0], PrefixCapture)
    return run_dir


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_reference_engine_can_cut_every_call(engine):
    assert isinstance(engine, PrefixCapture)
    for params in (dict(temperature=0.0), dict(temperature=1.0, seed=3, top_p=0.9),
                   dict(stop=("x",), min_tokens=5, presence_penalty=0.5, frequency_penalty=-0.5)):
        assert engine.cut_support(call("c", [1, 5], max_tokens=8, **params)) is None


def test_a_call_the_engine_cannot_cut_is_left_out_of_the_cut_alone_and_the_trace_says_why(refused_run):
    trace = refused_run / "logs" / "rollout_trace.sqlite"
    fallbacks = _rows(trace, "SELECT t, attempt_id, turn, reason FROM call_fallback")
    # The engine's refusals, besides in-process calls whose previous turn was not yet
    # committed at the cut (`turn_not_committed`, a fallback of every engine).
    reasons = {r for *_, r in fallbacks}
    assert REFUSED in reasons and reasons <= {REFUSED, "turn_not_committed"}, fallbacks
    cut = _rows(trace, "SELECT t, group_id, generation_index, attempt FROM call_cut")
    assert cut, "the cuttable calls were still cut"
    # Attempt by attempt, cut by cut: no call is both cut and left out. A cut's own
    # snapshot maps (group, generation, attempt) to the attempt ids running at it (a
    # settled group's attempts have left the live store); every snapshot is kept but the
    # bootstrap's (pruned once step_1 exists), so the cuts checked are those on disk.
    snapshots = sorted(refused_run.glob("checkpoints/*/rollout_snapshots/*/rollout_state.sqlite"))
    at_cut = {json.loads((db.parent / "manifest.json").read_text())["cut_time"]: db for db in snapshots}
    checked = 0
    for cut_time, db in at_cut.items():
        ids = {(g, i, a): aid for aid, g, i, a in _rows(
            db, "SELECT attempt_id, group_id, generation_index, attempt FROM rollouts")}
        cut_here = {ids[(g, i, a)] for t, g, i, a in cut if abs(t - cut_time) < 1e-6}
        left_out = {a for t, a, _, _ in fallbacks if abs(t - cut_time) < 1e-6}
        assert not cut_here & left_out, (cut_time, cut_here, left_out)
        checked += bool(cut_here)
    assert checked, "no kept snapshot's cut cut a call"
    # Every snapshot left on disk saved prefixes of cuttable calls only (min_tokens < LONG).
    chunks = [row for db in snapshots for row in _rows(db, "SELECT attempt_id, min_tokens FROM token_chunks")]
    assert chunks and all(mn < LONG for _, mn in chunks), chunks
