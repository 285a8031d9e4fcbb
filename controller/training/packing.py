"""How the GRPO trainer lays completions out for the forward pass.

Two layouts, one `PackedBatch`:

- `pack`: one row per completion, prompt + output, right-padded (the plain layout);
- `pack_shared_prefix` (`algorithm.shared_prefix_packing: true`): one row per group, the
  group's shared prompt once, then each completion's own tokens ("forest" packing). A
  tree attention mask lets every completion see the shared prompt and its own earlier
  tokens, never a sibling's, and position ids restart at the shared length for every
  completion, so each output token's logits are those of the plain layout (up to the
  order of floating-point sums; tests/test_shared_prefix_packing.py). A group of G
  completions with a prompt of P tokens then runs P + sum(n_i) tokens instead of
  G * P + sum(n_i): the long-prompt case is where it pays (BENCHMARKS.md).

The shared part is the longest common prefix of the group's prompt_ids. A group whose
prompts differ (a dataset that varies the prompt per generation, or a multi-turn episode
whose caller put more than the first prompt into prompt_ids) is still packed, never
split off: whatever follows the common prefix belongs to each completion's own branch,
with its own positions. Environment tokens inside a multi-turn completion (loss_mask 0)
are ordinary branch tokens: context, never trained. A group with no common prefix at all
is packed correctly too, just without saving anything. Restored prefixes (prefix-level
recovery) are part of token_ids with loss_mask 1 and their original logprobs, so they are
packed and trained like any other policy token.

One row per group, not several groups per row: the attention here is dense over the row
(an additive mask makes SDPA compute all L x L scores and mask them afterwards), so
putting two groups in one row only adds masked-out work, quadratic in the row length;
and the rows of one step's groups have similar lengths (same group size, same prompt
source), so padding rows to the longest costs little. Micro-batches then take whole rows
(`micro_batches`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rolloutdb.controller.protocols import Completion


@dataclass
class PackedBatch:
    """Completions laid out in R rows of L tokens, N sequences of up to T output tokens.

    Output token j of sequence b is `target_ids[b, j]`, predicted by the logits of row
    `seq_rows[b]` at position `gather_positions[b, j]`. The sequences of a row are
    consecutive, and rows hold sequences in order (`micro_batches` relies on both)."""

    input_ids: torch.Tensor  # [R, L]
    # [R, L] 1/0 (plain layout: padding), or [R, L, L] bool: query i may see key j
    attention_mask: torch.Tensor
    target_ids: torch.Tensor  # [N, T]
    gather_positions: torch.Tensor  # [N, T] index into the row's positions
    old_logprobs: torch.Tensor  # [N, T]
    loss_mask: torch.Tensor  # [N, T] 1: policy token, 0: environment token or padding
    advantages: torch.Tensor  # [N, 1]
    seq_rows: torch.Tensor  # [N] the row holding each sequence
    position_ids: torch.Tensor | None = None  # [R, L]; None: 0, 1, 2, ... in every row


def _checked(c: Completion) -> list[int]:
    """The completion's loss mask, after checking its lists agree."""
    if not c.prompt_ids:
        raise ValueError("a completion needs at least one prompt token")
    n = len(c.token_ids)
    if len(c.logprobs) != n:
        raise ValueError("logprobs and token_ids differ in length")
    lm = c.loss_mask if c.loss_mask is not None else [1] * n
    if len(lm) != n:
        raise ValueError("loss_mask and token_ids differ in length")
    return list(lm)


def _outputs(completions: Sequence[Completion], advantages: Sequence[float], pad_id: int):
    """The per-sequence tensors both layouts share: targets, old logprobs, loss mask."""
    N = len(completions)
    T = max(1, max(len(c.token_ids) for c in completions))
    targets = torch.full((N, T), pad_id, dtype=torch.long)
    old = torch.zeros((N, T), dtype=torch.float32)
    mask = torch.zeros((N, T), dtype=torch.float32)
    for b, c in enumerate(completions):
        lm, n = _checked(c), len(c.token_ids)
        if n:
            targets[b, :n] = torch.tensor(c.token_ids)
            old[b, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
            mask[b, :n] = torch.tensor(lm, dtype=torch.float32)
    adv = torch.tensor(list(advantages), dtype=torch.float32).unsqueeze(1)
    return targets, old, mask, adv, T


def pack(completions: Sequence[Completion], advantages: Sequence[float], pad_id: int = 0) -> PackedBatch:
    """One right-padded row per completion: prompt + output."""
    if not completions:
        raise ValueError("empty batch")
    targets, old, mask, adv, T = _outputs(completions, advantages, pad_id)
    B = len(completions)
    L = max(len(c.prompt_ids) + len(c.token_ids) for c in completions)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((B, T), dtype=torch.long)
    for b, c in enumerate(completions):
        P, n = len(c.prompt_ids), len(c.token_ids)
        input_ids[b, : P + n] = torch.tensor([*c.prompt_ids, *c.token_ids])
        attention[b, : P + n] = 1
        positions[b, :n] = torch.arange(P - 1, P - 1 + n)
    return PackedBatch(input_ids, attention, targets, positions, old, mask, adv, torch.arange(B))


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """The length of the longest common prefix of `prompts`."""
    if not prompts:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts)
    for i in range(n):
        t = first[i]
        if any(p[i] != t for p in prompts):
            return i
    return n


SHARED, PAD = -1, -2  # branch ids of the shared prompt and of padding in a row


def pack_shared_prefix(groups: Sequence[Sequence[Completion]], advantages: Sequence[float],
                       pad_id: int = 0) -> PackedBatch:
    """One row per (non-empty) group: the shared prompt once, then each completion's branch
    (the rest of its prompt, then its output), with a tree mask and restarting positions.
    `advantages` are per completion, in the order of the groups' completions."""
    groups = [g for g in groups if g]
    completions = [c for g in groups for c in g]
    if not completions:
        raise ValueError("empty batch")
    targets, old, mask, adv, T = _outputs(completions, advantages, pad_id)
    rows: list[tuple[list[int], list[int], list[int]]] = []  # (tokens, positions, branch ids)
    gather = torch.zeros((len(completions), T), dtype=torch.long)
    seq_rows = torch.zeros(len(completions), dtype=torch.long)
    b = 0
    for r, group in enumerate(groups):
        s = shared_prefix_length([c.prompt_ids for c in group])
        ids, pos, branch = list(group[0].prompt_ids[:s]), list(range(s)), [SHARED] * s
        for k, c in enumerate(group):
            seq = [*c.prompt_ids, *c.token_ids]
            start = len(ids)  # where this branch's sequence index s lands in the row
            ids += seq[s:]
            pos += range(s, len(seq))
            branch += [k] * (len(seq) - s)
            P, n = len(c.prompt_ids), len(c.token_ids)
            # Output token j is sequence index P + j, predicted at sequence index P + j - 1:
            # in the shared part if that is below s, else in this branch.
            gather[b, :n] = torch.tensor([i if i < s else start + i - s for i in range(P - 1, P - 1 + n)],
                                         dtype=torch.long)
            seq_rows[b] = r
            b += 1
        rows.append((ids, pos, branch))
    R, L = len(rows), max(len(ids) for ids, _, _ in rows)
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    branch_ids = torch.full((R, L), PAD, dtype=torch.long)
    for r, (ids, pos, branch) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        position_ids[r, : len(pos)] = torch.tensor(pos)
        branch_ids[r, : len(branch)] = torch.tensor(branch)
    position_ids[branch_ids == PAD] = 0  # padding: any position, never read
    causal = torch.ones((L, L), dtype=torch.bool).tril()
    query, key = branch_ids.unsqueeze(2), branch_ids.unsqueeze(1)
    # A token sees the earlier tokens of its own branch and the whole shared prompt before
    # it; padding sees the shared prompt and earlier padding (never a row of nothing,
    # which would be a softmax over nothing).
    visible = causal & ((query == key) | (key == SHARED))
    return PackedBatch(input_ids, visible, targets, gather, old, mask, adv, seq_rows, position_ids)


def micro_batches(batch: PackedBatch, size: int | None) -> list[tuple[slice, slice]]:
    """(rows, sequences) of each forward/backward: whole rows, at most `size` sequences
    each unless a single row holds more (a packed group is never split: its branches
    share the prompt's activations). None: everything at once."""
    R, N = batch.input_ids.shape[0], batch.target_ids.shape[0]
    if size is None:
        return [(slice(0, R), slice(0, N))]
    counts = torch.bincount(batch.seq_rows, minlength=R).tolist()
    parts, r0, s0, n = [], 0, 0, 0
    for r, c in enumerate(counts):
        if r > r0 and n + c > size:
            parts.append((slice(r0, r), slice(s0, s0 + n)))
            r0, s0, n = r, s0 + n, 0
        n += c
    parts.append((slice(r0, R), slice(s0, s0 + n)))
    return parts


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[R, L, L] bool -> [R, 1, L, L] additive mask (0 visible, dtype's min hidden), the
    4-D form Hugging Face models take as is (transformers' masking_utils returns a 4-D
    mask unchanged; the eager and SDPA attention both add it to the scores). The minimum,
    not -inf: exp underflows to exactly 0 either way, and a row can never become NaN."""
    out = torch.zeros(visible.shape, dtype=dtype)
    return out.masked_fill_(~visible, torch.finfo(dtype).min).unsqueeze(1)
