"""A local Hugging Face model directory as the engines and the trainer use it: the checks
that refuse one before a run starts, and the names its weights go by at a refit.

Any causal LM transformers builds from the directory's config.json (AutoModelForCausalLM
picks the class from its model_type) is a policy: the trainer trains it and vLLM serves
it. The reference engine runs only the decoders its batch-invariant forward computes
exactly (`invariant_forward.INVARIANT_MODEL_TYPES`), so a run with it refuses the others.

Weight names at a refit: the trainer exports `state_dict()`, which lists a tied tensor
under every name it has (tied embeddings: `lm_head.weight` and
`model.embed_tokens.weight`, as small Qwen2 models ship), while a safetensors file and
`named_parameters()` hold it once. `refit_tensors` matches the two through the tie groups
of the model (`tie_groups`) instead of assuming a Llama with untied embeddings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from .invariant_forward import invariant_forward_refusal

# A directory without one of these has no tokenizer AutoTokenizer can build.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
SAFETENSORS_INDEX = "model.safetensors.index.json"


class ModelDirError(ValueError):
    """A model directory that cannot be a policy; the message is one line naming the
    problem and what to do."""


def check_model_dir(model_dir: str | Path, *, engine: str):
    """The directory's transformers config, once the directory is known to hold what a run
    needs: a config that builds a causal LM (built on the meta device: no memory, no
    weights read; about a second for a 7B config), safetensors weights, tokenizer files,
    and an architecture `engine` ("reference" or "vllm") runs. Raises ModelDirError."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_dir)
    key = "policy.model_dir"
    if not (path / "config.json").is_file():
        raise ModelDirError(f"{key}: {path} has no config.json; give a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - whatever transformers says of the directory's config
        detail = " ".join(str(e).split())[:300]
        raise ModelDirError(f"{key}: {path / 'config.json'} does not build a causal language model "
                            f"({type(e).__name__}: {detail}); give a Hugging Face model directory "
                            "transformers can load") from None
    weights_problem = _weights_problem(path)
    if weights_problem is not None:
        raise ModelDirError(f"{key}: {path} {weights_problem}")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(f"{key}: {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the "
                            "model's tokenizer into it with tokenizer.save_pretrained(DIR)")
    if engine == "reference":
        refusal = invariant_forward_refusal(config)
        if refusal is not None:
            raise ModelDirError(f"{key}: {path} holds a {type(config).__name__}: {refusal}")
    return config


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding a directory's weights: the shards its index names,
    else model.safetensors, else every *.safetensors (a trainer checkpoint's optimizer
    file beside model.safetensors is not a weight file). Raises ValueError for an index
    that cannot be read."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"has an unreadable {SAFETENSORS_INDEX}; save the model again with "
                             "save_pretrained(DIR)") from None
        return [path / name for name in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def _weights_problem(path: Path) -> str | None:
    """What is wrong with the directory's weights, or None. Only safetensors are read:
    a pickled .bin can run code when it is loaded."""
    try:
        files = weight_files(path)
    except ValueError as e:
        return str(e)
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        return f"lacks the weight file(s) {', '.join(absent[:3])} its {SAFETENSORS_INDEX} names; copy them in"
    if files:
        return None
    if any(path.glob("pytorch_model*.bin")):
        return ("holds only pickled pytorch_model*.bin weights, which rolloutdb does not load; convert them with "
                "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR) (safetensors)")
    return "holds no model weights (*.safetensors); save the model into it with save_pretrained(DIR)"


def eos_token_ids(*declared) -> frozenset[int]:
    """Every end-of-sequence id among `declared` (config.json's and
    generation_config.json's eos_token_id: each None, an int, or a list, as Llama 3
    instruct models list several); decoding stops at any of them, as transformers' and
    vLLM's generation does."""
    ids: set[int] = set()
    for value in declared:
        if isinstance(value, int) and not isinstance(value, bool):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return frozenset(ids)


def tie_groups(model: torch.nn.Module) -> dict[str, str]:
    """name -> the first name of its tensor, for every state-dict name of `model` that
    shares its parameter with another (tied embeddings); untied names are absent."""
    first: dict[int, str] = {}
    groups: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owner = first.setdefault(id(tensor), name)
        if owner != name:
            groups[name] = groups[owner] = owner
    return groups


def refit_tensors(state_dict: Mapping[str, object], shapes: Mapping[str, tuple[int, ...]],
                  ties: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The tensors of `state_dict` under exactly the names of `shapes` (the engine's own
    weights). A name absent from `state_dict` is filled from another name of its tie
    group; a name of `state_dict` the engine does not hold is allowed only as a tied alias
    of one it does. Raises ValueError before anything is returned: missing and unexpected
    names, then the first shape that differs."""
    by_group = {ties.get(name, name): value for name, value in reversed(list(state_dict.items()))}
    held = {ties.get(name, name) for name in shapes}
    missing = sorted(name for name in shapes if name not in state_dict and ties.get(name, name) not in by_group)
    unexpected = sorted(name for name in state_dict if name not in shapes and ties.get(name, name) not in held)
    if missing or unexpected:
        raise ValueError(f"state dict does not match the policy: missing {missing}, unexpected {unexpected}")
    out = {}
    for name, shape in shapes.items():
        value = state_dict[name] if name in state_dict else by_group[ties.get(name, name)]
        tensor = torch.as_tensor(value).detach()
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != policy's {tuple(shape)}")
        out[name] = tensor
    return out


def checkpoint_ties(model_dir: str | Path) -> dict[str, str]:
    """`tie_groups` of the model a directory's config builds (on the meta device: no
    weights are read), for an engine that holds only the checkpoint's tensor names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return tie_groups(model)
