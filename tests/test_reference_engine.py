"""The embedded policy and the CPU reference engine: real weights, real decoding.

The central claim: a call continued from a saved prefix decodes exactly (token ids and
logprobs, bit for bit) what the uninterrupted call decodes, alone or in any batch, under
greedy and seeded sampling, with stop strings, min_tokens and penalties counting the
prefix. The random tiny policy has nearly flat logits, which makes these tests sharp:
near-ties are everywhere, so any numeric drift would flip tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait

import pytest
import torch

from rolloutdb.gpu_capture import (
    GenerationEngine,
    GenerationRequest,
    ReferenceEngine,
    SamplingParams,
    build_tiny_policy,
    encode_strict,
    generate_all,
    load_policy,
)
from rolloutdb.gpu_capture.invariant_forward import InvariantDecoder


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "seed0", seed=0)


@pytest.fixture(scope="module")
def other_policy_dir(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("policy") / "seed1", seed=1)


@pytest.fixture(scope="module")
def engine(policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=16, num_threads=1) as eng:
        yield eng


def prompt(eng, i: int) -> list[int]:
    return encode_strict(eng.tokenizer, f"task {i}: {i * 7 % 13} + {i * 5 % 11} = ?\n", add_bos=True)


def call(rid, prompt_ids, **params) -> GenerationRequest:
    return GenerationRequest(rid, prompt_ids, SamplingParams(**params))


def resumed(request: GenerationRequest, full, k: int, *, with_logprobs: bool = True) -> GenerationRequest:
    """The call as a restore would re-issue it: same prompt and params, k saved tokens."""
    return GenerationRequest(
        request.request_id,
        request.prompt_ids,
        request.params,
        prefix_ids=full.token_ids[:k],
        prefix_versions=full.token_versions[:k],
        prefix_logprobs=full.logprobs[:k] if with_logprobs else (),
    )


def assert_same_output(got, expected):
    assert got.token_ids == expected.token_ids
    assert got.logprobs == expected.logprobs  # bit-exact floats, not approximately
    assert got.token_versions == expected.token_versions
    assert (got.finish_reason, got.text) == (expected.finish_reason, expected.text)


class StepGate:
    """Pauses the engine's worker after a chosen step so the test can act between two
    steps deterministically (the worker holds no lock while paused)."""

    def __init__(self, eng, at_step: int):
        self.eng, self.at_step = eng, at_step
        self.reached, self.release = threading.Event(), threading.Event()
        self.start_step = eng.steps
        eng.step_callback = self._callback

    def _callback(self, step):
        if step - self.start_step == self.at_step:
            self.reached.set()
            self.release.wait(30)

    def run_in_background(self, requests):
        box = {}
        thread = threading.Thread(target=lambda: box.update(out=self.eng.generate(requests)))
        thread.start()
        assert self.reached.wait(30), "the engine never reached the gated step"
        return thread, box

    def finish(self, thread, box):
        self.release.set()
        thread.join(30)
        self.eng.step_callback = None
        return box["out"]


# ---- the policy directory ----------------------------------------------------------------


def test_the_policy_directory_loads_with_auto_classes_and_holds_only_safetensors(policy_dir):
    from transformers import AutoTokenizer, LlamaForCausalLM

    names = sorted(p.name for p in policy_dir.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))]
    tok = AutoTokenizer.from_pretrained(policy_dir)
    model = LlamaForCausalLM.from_pretrained(policy_dir)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id
    ids = tok.encode("x: 12 + 7 = ?")
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == "x: 12 + 7 = ?"


def test_building_twice_with_one_seed_gives_the_same_weight_bytes(tmp_path, policy_dir):
    again = build_tiny_policy(tmp_path / "again", seed=0)
    other = build_tiny_policy(tmp_path / "other", seed=3)
    assert (again / "model.safetensors").read_bytes() == (policy_dir / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (policy_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (policy_dir / "model.safetensors").read_bytes()


def test_text_outside_the_alphabet_is_refused_by_encode_strict(engine):
    with pytest.raises(ValueError, match="outside the tokenizer's alphabet"):
        encode_strict(engine.tokenizer, "naïve")


# ---- the forward pass --------------------------------------------------------------------


def test_the_invariant_forward_matches_the_hf_model(policy_dir):
    model, _ = load_policy(policy_dir)
    fwd = InvariantDecoder(model, num_slots=2, max_len=256)
    seq = torch.randint(3, model.config.vocab_size, (90,), generator=torch.Generator().manual_seed(0))
    ours = fwd.forward(seq, torch.zeros(90, dtype=torch.long), torch.arange(90), torch.arange(90))
    with torch.no_grad():
        theirs = model(seq[None]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_a_row_gets_the_same_bits_alone_in_a_batch_and_inside_a_prefill(policy_dir):
    model, _ = load_policy(policy_dir)
    fwd = InvariantDecoder(model, num_slots=4, max_len=256)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(3, model.config.vocab_size, (70,), generator=gen)
    other = torch.randint(3, model.config.vocab_size, (70,), generator=gen)
    prefill = fwd.forward(seq, torch.zeros(70, dtype=torch.long), torch.arange(70), torch.arange(70))
    one_by_one = torch.stack(
        [fwd.forward(seq[i : i + 1], torch.tensor([1]), torch.tensor([i]), torch.tensor([0]))[0] for i in range(70)]
    )
    assert torch.equal(one_by_one, prefill)
    # Slot 2 prefills 40 tokens next to 23 rows of another call, then decodes beside it.
    mixed = fwd.forward(
        torch.cat([other[:23], seq[:40]]),
        torch.tensor([3] * 23 + [2] * 40),
        torch.cat([torch.arange(23), torch.arange(40)]),
        torch.arange(23, 63),
    )
    assert torch.equal(mixed, prefill[:40])
    for i in range(40, 70):
        pair = fwd.forward(torch.stack([other[i - 17], seq[i]]), torch.tensor([3, 2]), torch.tensor([i - 17, i]), torch.tensor([1]))
        assert torch.equal(pair[0], prefill[i])


# ---- the engine --------------------------------------------------------------------------


def test_the_engine_implements_the_generation_engine_protocol(engine):
    assert isinstance(engine, GenerationEngine)


def test_decoding_is_incremental_one_row_per_call_after_the_prefill(engine):
    prompts = [prompt(engine, i) for i in range(3)]
    rows = []
    forward = engine._forward.forward

    def counting_forward(tokens, slots, positions, logit_rows):
        rows.append(len(tokens))
        return forward(tokens, slots, positions, logit_rows)

    engine._forward.forward = counting_forward
    try:
        engine.generate([call(f"i{i}", p, max_tokens=8, min_tokens=8, seed=i) for i, p in enumerate(prompts)])
    finally:
        del engine._forward.forward
    assert rows == [sum(map(len, prompts))] + [3] * 7


def test_greedy_tokens_are_the_hf_models_argmax_and_logprobs_agree(engine, policy_dir):
    model, _ = load_policy(policy_dir)
    p = prompt(engine, 1)
    out = engine.generate([call("g", p, max_tokens=24, min_tokens=24, temperature=0.0)])[0]
    with torch.no_grad():
        logits = model(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1 : -1]
    chosen = logits[torch.arange(24), torch.tensor(out.token_ids)]
    assert torch.all(chosen >= logits.max(-1).values - 1e-4)
    reference = torch.log_softmax(logits, -1)[torch.arange(24), torch.tensor(out.token_ids)]
    torch.testing.assert_close(torch.tensor(out.logprobs), reference, rtol=0, atol=1e-4)


def test_a_nucleus_of_one_token_samples_the_greedy_tokens(engine):
    p = prompt(engine, 2)
    greedy = engine.generate([call("a", p, max_tokens=16, min_tokens=16, temperature=0.0)])[0]
    nucleus = engine.generate([call("b", p, max_tokens=16, min_tokens=16, temperature=1.0, top_p=1e-9, seed=5)])[0]
    assert nucleus.token_ids == greedy.token_ids


def test_two_engines_with_the_same_seeds_and_threads_give_identical_outputs(engine, policy_dir):
    batch = [call(f"d{i}", prompt(engine, i), max_tokens=20, temperature=1.0, top_p=0.95, seed=i) for i in range(5)]
    first = engine.generate(batch)
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1) as second_engine:
        second = second_engine.generate(batch)
    for a, b in zip(first, second):
        assert_same_output(a, b)
    assert len({tuple(r.token_ids) for r in first}) == 5  # seeds really differ per call


def test_a_second_process_decodes_the_same_tokens_and_logprobs(engine, policy_dir):
    batch = [call(f"p{i}", prompt(engine, i), max_tokens=16, min_tokens=16, temperature=1.0, seed=40 + i) for i in range(3)]
    here = engine.generate(batch)
    script = f"""
import json
from rolloutdb.gpu_capture import ReferenceEngine, GenerationRequest, SamplingParams
reqs = {json.dumps([[r.request_id, list(r.prompt_ids), r.params.seed] for r in batch])}
with ReferenceEngine({str(policy_dir)!r}, max_batch_size=8, num_threads=1) as eng:
    out = eng.generate([GenerationRequest(rid, p, SamplingParams(max_tokens=16, min_tokens=16, temperature=1.0, seed=s))
                        for rid, p, s in reqs])
print(json.dumps([[r.token_ids, r.logprobs] for r in out]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert there == [[r.token_ids, r.logprobs] for r in here]


MODES = {
    "greedy": dict(temperature=0.0),
    "seeded_t1": dict(temperature=1.0, seed=7),
    "seeded_top_p": dict(temperature=0.8, top_p=0.9, seed=11),
}


@pytest.mark.parametrize("mode", MODES)
def test_a_call_continued_from_a_prefix_decodes_exactly_the_uninterrupted_tokens(engine, mode):
    settings = dict(MODES[mode])
    seed = settings.pop("seed", None)
    batch = [
        call(f"c{i}", prompt(engine, i), max_tokens=40, min_tokens=40, seed=None if seed is None else seed + i, **settings)
        for i in range(6)
    ]
    full = engine.generate(batch)
    fresh = [call(f"x{i}", prompt(engine, 20 + i), max_tokens=30, temperature=1.0, seed=i) for i in range(5)]
    for k in (1, 7, 20, 39):
        same_batch = engine.generate([resumed(r, f, k) for r, f in zip(batch, full)])
        for got, expected in zip(same_batch, full):
            assert_same_output(got, expected)
        alone = engine.generate([resumed(batch[2], full[2], k)])[0]
        assert_same_output(alone, full[2])
        among_others = engine.generate(fresh[:3] + [resumed(batch[4], full[4], k)] + fresh[3:])[3]
        assert_same_output(among_others, full[4])


def test_the_multiply_and_sum_fallback_also_continues_exactly(policy_dir):
    # The path taken on a CPU whose GEMM fails the tile probe.
    with ReferenceEngine(policy_dir, max_batch_size=8, num_threads=1, linear_mode="reduce") as eng:
        batch = [call(f"r{i}", prompt(eng, i), max_tokens=20, min_tokens=20, temperature=1.0, top_p=0.9, seed=i) for i in range(3)]
        full = eng.generate(batch)
        for k in (3, 17):
            assert_same_output(eng.generate([resumed(batch[1], full[1], k)])[0], full[1])
            assert_same_output(eng.generate([resumed(r, f, k) for r, f in zip(batch, full)])[2], full[2])


def test_calls_joining_a_running_batch_decode_what_they_decode_alone(engine, policy_dir):
    first = [call(f"j{i}", prompt(engine, i), max_tokens=24, min_tokens=24, temperature=1.0, seed=i) for i in range(3)]
    later = [call(f"k{i}", prompt(engine, 9 + i), max_tokens=12, min_tokens=12, temperature=0.0) for i in range(2)]
    alone = [engine.generate([r])[0] for r in first + later]
    with ReferenceEngine(load_policy(policy_dir), max_batch_size=8, num_threads=1) as eng:
        gate = StepGate(eng, at_step=4)
        thread, box = gate.run_in_background(first)
        joined = {}
        joiner = threading.Thread(target=lambda: joined.update(out=eng.generate(later)))
        joiner.start()
        deadline = time.monotonic() + 60
        while "k1" not in eng.running_tokens():  # queued while the first calls are paused
            assert joiner.is_alive()
            assert time.monotonic() < deadline, "the later calls never joined the running batch in 60 s"
        gate.finish(thread, box)  # next step: their prefill rows beside the decode rows
        joiner.join(30)
    for got, expected in zip(box["out"] + joined["out"], alone):
        assert_same_output(got, expected)


def test_a_call_continued_without_its_prefix_logprobs_recomputes_them_bit_exactly_under_the_same_weights(engine):
    request = call("r", prompt(engine, 3), max_tokens=30, min_tokens=30, temperature=0.7, seed=3)
    full = engine.generate([request])[0]
    again = engine.generate([resumed(request, full, 12, with_logprobs=False)])[0]
    assert_same_output(again, full)


def _find_call_with_long_output(eng, **params):
    for seed in range(50):
        request = call("s", prompt(eng, seed % 7), seed=seed, **params)
        out = eng.generate([request])[0]
        if len(out.text) >= 30 and out.finish_reason == "length":
            return request, out
    raise AssertionError("no seed gave a long output")


def test_a_stop_string_straddling_the_cut_is_found_after_continuation(engine):
    request, full = _find_call_with_long_output(engine, max_tokens=60, temperature=1.0)
    text = full.text
    for k in range(10, 50):
        cut = len(engine.tokenizer.decode(full.token_ids[:k], skip_special_tokens=True))
        stop = text[cut - 2 : cut + 2]
        if len(stop) == 4 and text.find(stop) == cut - 2:
            break
    else:
        pytest.fail("no cut with a stop string found only there")
    with_stop = GenerationRequest("s", request.prompt_ids, SamplingParams(max_tokens=60, temperature=1.0, seed=request.params.seed, stop=("QQQQQ", stop)))
    uninterrupted = engine.generate([with_stop])[0]
    assert (uninterrupted.finish_reason, uninterrupted.extra["stop_reason"]) == ("stop", stop)
    assert uninterrupted.text == text[: cut + 2]  # truncated after the stop string, which is kept
    continued = engine.generate([resumed(with_stop, uninterrupted, k)])[0]
    assert_same_output(continued, uninterrupted)


def _eos_eager_state(eng):
    """Weights under which EOS is by far the most likely token at every step: a constant
    hidden dimension nothing writes to, read by EOS's output row."""
    state = {name: p.detach().clone() for name, p in eng.model.named_parameters()}
    state["model.embed_tokens.weight"][:, 0] = 10.0
    for i in range(eng.model.config.num_hidden_layers):
        state[f"model.layers.{i}.self_attn.o_proj.weight"][0, :] = 0.0
        state[f"model.layers.{i}.mlp.down_proj.weight"][0, :] = 0.0
    state["lm_head.weight"][eng.eos_token_id, 0] = 5.0
    return state


def test_min_tokens_counts_the_prefix_so_a_call_continued_after_a_cut_masks_eos_exactly_as_long(policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1) as eng:
        eng.load_weights(_eos_eager_state(eng), version=3)
        request = call("m", prompt(eng, 0), max_tokens=20, min_tokens=5, temperature=0.0)
        full = eng.generate([request])[0]
        # Five tokens EOS could not be, then EOS: it is kept as the last token, not in text.
        assert len(full.token_ids) == 6 and full.token_ids[-1] == eng.eos_token_id
        assert eng.eos_token_id not in full.token_ids[:5]
        assert (full.finish_reason, full.extra["stop_reason"]) == ("stop", "eos")
        assert full.token_versions == [3] * 6
        assert full.text == eng.tokenizer.decode(full.token_ids[:5])
        for k in (2, 4):  # min_tokens counted over prefix + new tokens: still six in all
            assert_same_output(eng.generate([resumed(request, full, k)])[0], full)


def test_a_call_continued_after_a_cut_searches_no_stop_string_among_its_first_min_tokens_prefix_included(engine):
    tok = engine.tokenizer
    candidates = [call(f"t{seed}", prompt(engine, 5), max_tokens=7, min_tokens=6, temperature=1.0, seed=seed) for seed in range(96)]
    for request, full in zip(candidates, engine.generate(candidates)):
        pieces = [tok.decode([t], skip_special_tokens=True) for t in full.token_ids]
        if len(pieces) < 7:
            continue
        stop = pieces[6]
        if len(stop) == 1 and stop in "".join(pieces[:6]):
            break  # the stop string occurs early, inside the min_tokens window
    else:
        pytest.fail("no suitable seed")
    params = SamplingParams(max_tokens=30, min_tokens=6, temperature=1.0, seed=request.params.seed, stop=(stop,))
    stopping = GenerationRequest("t", request.prompt_ids, params)
    uninterrupted = engine.generate([stopping])[0]
    assert len(uninterrupted.token_ids) == 7 and uninterrupted.extra["stop_reason"] == stop
    continued = engine.generate([resumed(stopping, uninterrupted, 4)])[0]
    assert_same_output(continued, uninterrupted)


@pytest.mark.parametrize("mode", ["greedy", "seeded_top_p"])
def test_penalties_count_the_prefix_so_a_call_continued_after_a_cut_matches_the_uninterrupted_call(engine, mode):
    settings = dict(MODES[mode])
    penalized = call("q", prompt(engine, 4), max_tokens=40, min_tokens=40, presence_penalty=0.3, frequency_penalty=0.4, **settings)
    plain = call("q", prompt(engine, 4), max_tokens=40, min_tokens=40, **settings)
    full = engine.generate([penalized])[0]
    assert full.token_ids != engine.generate([plain])[0].token_ids  # the penalties bite
    for k in (3, 20, 33):
        assert_same_output(engine.generate([resumed(penalized, full, k)])[0], full)
    if mode == "greedy":
        # What an engine that resets output state does (prefix moved into the prompt):
        naive = call("q", list(penalized.prompt_ids) + full.token_ids[:20], max_tokens=20, min_tokens=20,
                     presence_penalty=0.3, frequency_penalty=0.4, temperature=0.0)
        assert engine.generate([naive])[0].token_ids != full.token_ids[20:]


def test_max_tokens_is_respected_and_a_call_cut_at_the_limit_returns_at_once_when_continued(engine):
    out = engine.generate([call("l", prompt(engine, 6), max_tokens=9, min_tokens=9, seed=1)])[0]
    assert len(out.token_ids) == 9 and out.finish_reason == "length" and out.extra["stop_reason"] is None
    steps = engine.steps
    done = engine.generate([resumed(call("l", prompt(engine, 6), max_tokens=9, seed=1), out, 9)])[0]
    assert done.token_ids == out.token_ids and done.finish_reason == "length"
    assert engine.steps == steps  # nothing was decoded


def test_running_tokens_read_between_steps_are_prefixes_of_the_final_outputs(engine):
    batch = [call(f"w{i}", prompt(engine, i), max_tokens=30, min_tokens=30, seed=i) for i in range(4)]
    gate = StepGate(engine, at_step=10)
    thread, box = gate.run_in_background(batch)
    snapshot = engine.running_tokens()
    final = gate.finish(thread, box)
    assert set(snapshot) == {r.request_id for r in batch}
    for r, out in zip(batch, final):
        assert snapshot[r.request_id] == out.token_ids[:10]


def test_running_tokens_polled_during_generation_are_always_prefixes(engine):
    batch = [call(f"v{i}", prompt(engine, i), max_tokens=40, min_tokens=40, seed=i) for i in range(4)]
    box, snapshots = {}, []
    thread = threading.Thread(target=lambda: box.update(out=engine.generate(batch)))
    thread.start()
    deadline = time.monotonic() + 120
    while thread.is_alive():
        assert time.monotonic() < deadline, "generation did not finish in 120 s"
        snapshots.append(engine.running_tokens())
    thread.join()
    final = {r.request_id: r.token_ids for r in box["out"]}
    for snap in snapshots:
        for rid, tokens in snap.items():
            assert final[rid][: len(tokens)] == tokens


def test_load_weights_mid_call_tags_later_tokens_with_the_new_version(policy_dir, other_policy_dir):
    new_model, _ = load_policy(other_policy_dir)
    new_state = new_model.state_dict()
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1) as eng:
        request = call("f", prompt(eng, 2), max_tokens=24, min_tokens=24, temperature=1.0, seed=9)
        before = eng.generate([request])[0]
        gate = StepGate(eng, at_step=5)
        thread, box = gate.run_in_background([request])
        eng.load_weights(new_state, version=1)
        (out,) = gate.finish(thread, box)
        assert eng.policy_version == 1
    assert out.token_versions == [0] * 5 + [1] * 19
    assert out.token_ids[:5] == before.token_ids[:5] and out.token_ids != before.token_ids
    # The tokens after the refit are exactly those of the call resumed on the new weights.
    with ReferenceEngine(other_policy_dir, max_batch_size=4, num_threads=1, policy_version=1) as new_engine:
        assert_same_output(new_engine.generate([resumed(request, out, 5)])[0], out)


def test_load_weights_refuses_a_state_dict_of_another_shape(engine):
    state = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    state.pop("lm_head.weight")
    with pytest.raises(ValueError, match="missing \\['lm_head.weight'\\]"):
        engine.load_weights(state, version=9)
    assert engine.policy_version == 0


def test_abort_ends_running_and_waiting_calls_with_finish_reason_abort(policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=1, num_threads=1) as eng:
        running = call("a", prompt(eng, 0), max_tokens=30, min_tokens=30, seed=1)
        waiting = call("b", prompt(eng, 1), max_tokens=30, min_tokens=30, seed=2)
        gate = StepGate(eng, at_step=3)
        thread, box = gate.run_in_background([running, waiting])
        assert set(eng.running_tokens()) == {"a", "b"}
        eng.abort(["b", "a", "not-a-call"])
        a, b = gate.finish(thread, box)
    assert (a.finish_reason, len(a.token_ids)) == ("abort", 3)
    assert (b.finish_reason, b.token_ids) == ("abort", [])


def test_bad_requests_are_refused_before_anything_runs(engine):
    good = call("ok", prompt(engine, 0), max_tokens=4)
    bad = [
        call("e", [], max_tokens=4),
        call("e", [1, 5], max_tokens=0),
        call("e", [1, 5], max_tokens=4, top_p=0.0),
        call("e", [1, 5], max_tokens=4, stop=("",)),
        GenerationRequest("e", [1, 5], SamplingParams(max_tokens=4), prefix_ids=[7, 8], prefix_versions=[0]),
        call("e", [1, 10**6], max_tokens=4),
    ]
    steps = engine.steps
    for request in bad:
        with pytest.raises(ValueError, match="request 'e'"):
            engine.generate([good, request])
    with pytest.raises(ValueError, match="distinct"):
        engine.generate([good, good])
    assert engine.steps == steps and engine.running_tokens() == {}


# ---- streaming: submit -----------------------------------------------------------------


def test_submitted_calls_complete_one_by_one_and_a_short_call_is_not_held_by_a_long_one(policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1) as eng:
        long_call = eng.submit(call("long", prompt(eng, 0), max_tokens=60, min_tokens=60, seed=1))
        short_call = eng.submit(call("short", prompt(eng, 1), max_tokens=3, min_tokens=3, seed=2))
        done, _ = wait([long_call, short_call], timeout=60, return_when=FIRST_COMPLETED)
        assert done == {short_call}, "the short call waited for the long one"
        assert not long_call.done()
        assert len(short_call.result().token_ids) == 3
        assert len(long_call.result(timeout=60).token_ids) == 60


def test_a_call_submitted_while_others_run_decodes_what_it_decodes_alone(engine, policy_dir):
    first = call("s0", prompt(engine, 0), max_tokens=20, min_tokens=20, temperature=1.0, seed=3)
    later = call("s1", prompt(engine, 5), max_tokens=10, min_tokens=10, temperature=1.0, seed=4)
    alone = [engine.generate([first])[0], engine.generate([later])[0]]
    with ReferenceEngine(load_policy(policy_dir), max_batch_size=8, num_threads=1) as eng:
        seen = threading.Event()
        eng.step_callback = lambda step: seen.set() if step >= 5 else None
        f0 = eng.submit(first)
        assert seen.wait(60)
        f1 = eng.submit(later)  # joins the running batch at its next step
        got = [f0.result(timeout=60), f1.result(timeout=60)]
    for g, expected in zip(got, alone):
        assert_same_output(g, expected)


def test_submit_refuses_a_bad_request_or_a_running_id_and_queues_nothing(engine):
    with pytest.raises(ValueError, match="request 'e'"):
        engine.submit(call("e", [], max_tokens=4))
    running = engine.submit(call("dup", prompt(engine, 0), max_tokens=30, min_tokens=30, seed=1))
    with pytest.raises(ValueError, match="already running"):
        engine.submit(call("dup", prompt(engine, 1), max_tokens=4))
    assert len(running.result(timeout=60).token_ids) == 30


def test_generate_all_submits_every_request_and_returns_results_in_order(engine):
    requests = [call(f"ga{i}", prompt(engine, i), max_tokens=2 + 3 * i, min_tokens=2 + 3 * i, seed=i) for i in range(3)]
    results = generate_all(engine, requests)
    assert [r.request_id for r in results] == ["ga0", "ga1", "ga2"]
    assert [len(r.token_ids) for r in results] == [2, 5, 8]
    with pytest.raises(ValueError, match="distinct"):
        generate_all(engine, [requests[0], requests[0]])


def test_the_engine_counts_its_busy_time_and_the_rows_it_decoded(policy_dir):
    with ReferenceEngine(policy_dir, max_batch_size=4, num_threads=1) as eng:
        eng.generate([call(f"b{i}", prompt(eng, i), max_tokens=5, min_tokens=5, seed=i) for i in range(2)])
        assert eng.decoded_rows == 10
        assert 0 < eng.busy_s
