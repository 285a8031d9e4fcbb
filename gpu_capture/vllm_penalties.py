"""Presence and frequency penalties over the whole output of a continued call on vLLM.

A call continued from a cut prefix is sent to vLLM as prompt + prefix (vllm_engine.py), and
vLLM counts presence/frequency penalties over its *own* output tokens only, so the counts
would restart at the seam. `PrefixPenalties` is a vLLM V1 logits processor that adds the
prefix's share: for every token of the prefix, `frequency x count in the prefix`, and
`presence` once, unless vLLM's own output already holds the token (then vLLM applies the
presence penalty itself). Added to vLLM's own penalties, that is the penalty over prefix +
new tokens, which an uninterrupted call pays.

Where it runs (vllm 0.32, v1/sample/sampler.py): custom processors that can change the
argmax run in `apply_logits_processors` before vLLM's own penalties, and the temperature
is applied afterwards, so the two additive terms compose as the uninterrupted call's one.
Raw logprobs are taken before any processor: the logprobs a call reports are unchanged.

The engine passes the prefix to the processor in `SamplingParams.extra_args[EXTRA_KEY]`
(only for penalised continued calls: every other call costs the processor one dict
lookup at admission). vLLM loads the class by its qualified name
(`PROCESSOR_FQCN`, engine argument `logits_processors`), in the engine-core process too.
The class is built on first access (PEP 562 `__getattr__`) so that importing this module
does not import vLLM (the default test tier never loads it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

EXTRA_KEY = "rolloutdb_prefix_penalties"
PROCESSOR_FQCN = f"{__name__}:PrefixPenalties"
_built: dict[str, type] = {}


def extra_args(prefix: Sequence[int], presence: float, frequency: float) -> dict[str, Any]:
    """What a penalised continued call sends in `SamplingParams.extra_args`."""
    return {EXTRA_KEY: {"prefix": list(prefix), "presence": float(presence), "frequency": float(frequency)}}


def prefix_penalty_fn(prefix: Sequence[int], presence: float, frequency: float):
    """The per-request function vLLM calls each step with (its output ids so far, the row
    of logits): subtracts the prefix's penalties in place and returns the row."""
    import torch

    counts = Counter(prefix)
    tokens = list(counts)
    ids = torch.tensor(tokens, dtype=torch.long)
    frequency_part = torch.tensor([frequency * counts[t] for t in tokens], dtype=torch.float32)
    in_output: set[int] = set()
    seen = [0]  # how many of vLLM's output ids were folded into in_output

    def apply(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_ids) > seen[0]:  # the output only grows: fold in what is new
            in_output.update(output_ids[seen[0]:])
            seen[0] = len(output_ids)
        presence_part = torch.tensor([0.0 if t in in_output else presence for t in tokens], dtype=torch.float32)
        penalty = (frequency_part + presence_part).to(logits.device, logits.dtype)
        logits.index_add_(0, ids.to(logits.device), -penalty)
        return logits

    return apply


def _build() -> type:
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class PrefixPenalties(AdapterLogitsProcessor):
        """vLLM's per-request adapter around `prefix_penalty_fn` (module docstring)."""

        def is_argmax_invariant(self) -> bool:
            return False  # a penalty can change the greedy choice

        def new_req_logits_processor(self, params):
            data = (params.extra_args or {}).get(EXTRA_KEY)
            if not data or not data["prefix"]:
                return None
            return prefix_penalty_fn(data["prefix"], data["presence"], data["frequency"])

    PrefixPenalties.__module__ = __name__
    return PrefixPenalties


def __getattr__(name: str):
    if name == "PrefixPenalties":
        if name not in _built:
            _built[name] = _build()
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
