"""Token choice and stop-string search for the reference engine, as pure functions.

Resumability is the point of every choice here. A call continued from a saved prefix of
k tokens must pick exactly the tokens the uninterrupted call would have picked, so
nothing may depend on how many tokens this engine instance has decoded, on the batch, or
on a random stream that restarts with the process:

* The random number for output position i (prefix included) is a pure function of the
  call's seed and i (`position_uniform`), not a draw from a stateful generator.
* Sampling is inverse-CDF over the probabilities sorted by (probability desc, token id
  asc), so ties resolve the same way everywhere.
* Penalties count every output token, prefix included, as the uninterrupted call does.
* A stop string counts when it ends inside the characters the newest token added, so one
  straddling the cut (its head in the prefix, its tail in new tokens) is found.

Reported logprob of a token: log-softmax of the raw logits divided by the temperature
(temperature 1 for greedy calls), before penalties, min-tokens masking and top-p. That
is the quantity a trainer recomputes from the same weights for the GRPO importance ratio
(it cannot see penalties or the top-p nucleus; the built-in trainer divides by the same
temperature: controller/job/build.py `logprob_temperature`), so on-policy ratios are
exactly 1 up to float noise. The token itself is drawn from the processed distribution (penalties,
masking, temperature, top-p).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int) -> float:
    """A number in [0, 1) for output position `position` of a call seeded `seed`,
    independent of everything else (53 random bits, the same on every platform)."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (mixed >> 11) * 2.0**-53


def request_seed(engine_seed: int, request_id: str) -> int:
    """Seed of a call that did not set one: a function of the engine seed and the call's
    id, so a call continued under the same id on an engine with the same seed still
    draws the same tokens."""
    digest = hashlib.blake2b(f"{engine_seed}\x00{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def continuation_seed(seed: int, prefix_length: int) -> int:
    """The seed a sampled call continued after `prefix_length` tokens hands an engine whose
    random stream restarts with each request (vLLM's per-request generator). Reusing `seed`
    would replay the draws that already chose the prefix, so the first new token's draw
    would be the first prefix token's, correlated with the prefix; a seed derived from
    (seed, prefix length) gives a fresh stream, so each new token is a fresh sample given
    the prompt and the prefix (distribution-exact, by the chain rule), and a continuation
    at the same cut draws the same tokens again."""
    digest = hashlib.blake2b(f"{seed}\x00continued-at\x00{prefix_length}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFFFFFFFFFF


@dataclass
class RowChoice:
    """How to pick the next token of one call."""

    temperature: float  # 0 = greedy
    top_p: float
    uniform: float  # position_uniform(seed, output position)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    counts: torch.Tensor | None = None  # [vocab] occurrences of each token in the output so far
    banned: Sequence[int] = ()  # token ids that may not be chosen now (EOS under min_tokens)


def choose_tokens(logits: torch.Tensor, rows: Sequence[RowChoice]) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits` [M, vocab]; return (token ids, reported logprobs).

    Every operation is row-wise, so a row's choice does not depend on the other rows."""
    m = logits.shape[0]
    report_temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows], dtype=logits.dtype)
    reported = torch.log_softmax(logits / report_temps[:, None], dim=-1)

    processed = logits.clone()
    for i, r in enumerate(rows):
        if r.counts is not None and (r.presence_penalty or r.frequency_penalty):
            # OpenAI / vLLM semantics: subtract frequency * count and presence * [count > 0].
            processed[i] -= r.frequency_penalty * r.counts + r.presence_penalty * (r.counts > 0).to(logits.dtype)
        if r.banned:
            processed[i, list(r.banned)] = float("-inf")

    tokens = [0] * m
    greedy = [i for i, r in enumerate(rows) if r.temperature <= 0]
    if greedy:
        picked = torch.argmax(processed[greedy], dim=-1)  # first maximum on ties
        for i, t in zip(greedy, picked.tolist()):
            tokens[i] = t
    sampled = [i for i, r in enumerate(rows) if r.temperature > 0]
    if sampled:
        temps = torch.tensor([rows[i].temperature for i in sampled], dtype=logits.dtype)
        probs = torch.softmax(processed[sampled] / temps[:, None], dim=-1).double()
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        top_p = torch.tensor([rows[i].top_p for i in sampled], dtype=torch.float64)
        # Nucleus: the smallest prefix of the sorted tokens whose mass reaches top_p.
        keep = (before < top_p[:, None]) & (sorted_probs > 0)
        keep[:, 0] = True
        kept = sorted_probs * keep
        cumulative = torch.cumsum(kept, dim=-1)
        uniforms = torch.tensor([rows[i].uniform for i in sampled], dtype=torch.float64)
        target = uniforms * cumulative[:, -1]
        position = (cumulative <= target[:, None]).sum(dim=-1)
        position = torch.minimum(position, keep.sum(dim=-1) - 1)  # guard float round-off
        chosen = order.gather(1, position[:, None]).squeeze(1)
        for i, t in zip(sampled, chosen.tolist()):
            tokens[i] = t
    logprobs = reported[torch.arange(m), torch.tensor(tokens)].tolist()
    return tokens, logprobs


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], temperature: float) -> list[float]:
    """Reported logprobs (see the module docstring) of given tokens, one per logits row."""
    temp = temperature if temperature > 0 else 1.0
    reported = torch.log_softmax(logits / temp, dim=-1)
    return reported[torch.arange(len(token_ids)), torch.tensor(list(token_ids))].tolist()


def find_stop(previous_text: str, text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The stop string occurrence that ends inside what changed from `previous_text` to
    `text` (the characters the newest token added), earliest end first, ties to the
    earlier stop in `stops`. Returns (end index in text, stop string) or None."""
    unchanged = len(os.path.commonprefix([previous_text, text]))
    best: tuple[int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(0, unchanged - len(stop) + 1))
        if start >= 0 and (best is None or start + len(stop) < best[0]):
            best = (start + len(stop), stop)
    return best
