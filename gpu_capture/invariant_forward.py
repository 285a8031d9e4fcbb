"""A batch-invariant forward pass of a Hugging Face Llama-family decoder (Llama, Mistral,
Qwen2, Qwen3) over a slot KV cache.

Why not call the HF model: prefix recovery must continue a call *bit-exactly* as if it
had never stopped. A resumed call is prefilled (prompt + saved prefix in one pass) in a
batch that differs from the one it was decoded in. With ordinary kernels the numbers a
token gets depend on that context: a [M, K] x [K, N] GEMM takes a different code path
for M = 1 (gemv) than for M = 32, and different M's block the reduction differently,
so logits move in the last bits (measured here: F.linear rows differ between M = 1 and
any M >= 2, and between M = 80 and smaller M's for 2 of 78 sizes). A near-tie then flips
a greedy token, or a seeded draw lands on the other side of a CDF boundary.

So every quantity a row computes depends only on that row's own token, position and KV
cache entries, through reductions whose order is fixed by sizes that do not depend on
the batch:
  * Linear layers run on tiles of exactly `tile_rows` rows (zero-padded). A GEMM of one
    fixed shape gives each row the same bits whatever its tile position and tile mates
    (checked by `probe_tiled_linear` when the engine starts; if the check fails on some
    CPU we fall back to an explicit multiply-and-sum whose reduction order is torch's
    per-element reduction over the fixed inner size).
  * Attention is per row: query x the row's own slot of the cache, over a key length
    that is a function of the row's position alone (its position rounded up to
    `attention_bucket`); masked keys get weight exactly 0. Reductions are elementwise
    products summed over fixed dims, never a GEMM whose shape follows the batch.
  * RMSNorm, softmax, RoPE and the MLP activation are row-wise.
  * What the family adds to Llama is row-wise too: Qwen2's q/k/v biases (added after the
    tiled product), Qwen3's per-head RMSNorm of queries and keys before RoPE, and the
    sliding window of Mistral (every layer) and of Qwen2/Qwen3 (the layers `layer_types`
    names): keys further back than the window get weight exactly 0, as the causal mask's.
Therefore a row decoded alone, in a batch of 31 others, or as one of 40 prefill rows of
its own prompt gets identical logits. Prefill and decode are the same code path: a step
is just a set of rows (slot, position, token).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

# The decoders this forward computes exactly as Hugging Face does (tests compare logits
# per family). Chosen by model_type, not by module names: Granite, say, has Llama's
# module names but scales embeddings, residuals and logits, which this forward would
# silently skip.
INVARIANT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def invariant_forward_refusal(config) -> str | None:
    """Why this forward cannot run a model of `config` (a transformers config), or None."""
    model_type = getattr(config, "model_type", None)
    if model_type not in INVARIANT_MODEL_TYPES:
        return (f"the reference engine's batch-invariant forward runs {', '.join(INVARIANT_MODEL_TYPES)} "
                f"decoders, not model_type {model_type!r}; set generation.backend: vllm for this model")
    return None


def sliding_windows(config) -> list[int | None]:
    """Each layer's attention window (None: the whole causal past), as the HF model
    applies it: Mistral's `sliding_window` holds for every layer; Qwen2/Qwen3 set it only
    with use_sliding_window, for the layers `layer_types` marks "sliding_attention"."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if window is None:
        return [None] * layers
    if kinds is None:
        return [window] * layers
    return [window if kind == "sliding_attention" else None for kind in kinds]


def probe_tiled_linear(shapes: set[tuple[int, ...]], tile_rows: int, seed: int = 0) -> bool:
    """True when, for every weight shape (out, in), a row's F.linear result on a tile of
    `tile_rows` rows is independent of its position in the tile and of its tile mates."""
    gen = torch.Generator().manual_seed(seed)
    for out_features, in_features in sorted(shapes):
        weight = torch.randn(out_features, in_features, generator=gen)
        rows = torch.randn(tile_rows, in_features, generator=gen)
        reference = F.linear(rows, weight)
        for shift in (1, tile_rows // 2 + 1):
            mates = torch.randn(tile_rows, in_features, generator=gen)
            order = torch.roll(torch.arange(tile_rows), shift)
            mixed = rows[order].clone()
            mixed[: tile_rows // 2] = mates[: tile_rows // 2]  # half the tile: new mates
            got = F.linear(mixed, weight)
            keep = torch.arange(tile_rows // 2, tile_rows)
            if not torch.equal(got[keep], reference[order[keep]]):
                return False
    return True


class InvariantDecoder:
    """Runs the weights of a causal LM of `INVARIANT_MODEL_TYPES` (read live from the
    module, so an in-place refit is seen at the next step) over `num_slots` cache slots of
    `max_len` positions."""

    def __init__(
        self,
        model,
        *,
        num_slots: int,
        max_len: int,
        tile_rows: int = 16,
        attention_bucket: int = 64,
        linear_mode: str = "auto",
        device: str | torch.device = "cpu",
    ) -> None:
        config = model.config
        refusal = invariant_forward_refusal(config)
        if refusal is not None:
            raise ValueError(refusal)
        self.model = model
        self.device = torch.device(device)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.max_len = max_len
        self.tile_rows = tile_rows
        self.attention_bucket = attention_bucket
        self.windows = sliding_windows(config)
        # GQA: query head h reads kv head h // group.
        group = self.num_heads // self.num_kv_heads
        self.kv_head_of = torch.arange(self.num_heads, device=self.device) // group
        shape = (num_slots, self.num_kv_heads, max_len, self.head_dim)
        # Zero-filled so a masked (weight 0) stale entry never multiplies into NaN.
        n_layers = config.num_hidden_layers
        self.cache_k = [torch.zeros(shape, device=self.device) for _ in range(n_layers)]
        self.cache_v = [torch.zeros(shape, device=self.device) for _ in range(n_layers)]
        with torch.no_grad():
            positions = torch.arange(max_len, device=self.device)[None, :]
            probe = torch.zeros(1, device=self.device, dtype=torch.float32)
            cos, sin = model.model.rotary_emb(probe, positions)  # the model's own RoPE
        self.cos, self.sin = cos[0].float(), sin[0].float()  # [max_len, head_dim]
        if linear_mode == "auto":
            shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
            linear_mode = "tiled" if probe_tiled_linear(shapes, tile_rows) else "reduce"
            if linear_mode == "reduce":
                warnings.warn("tiled GEMM is not row-invariant on this CPU; using the slower multiply-and-sum linear")
        if linear_mode not in ("tiled", "reduce"):
            raise ValueError(f"linear_mode must be 'auto', 'tiled' or 'reduce', not {linear_mode!r}")
        self.linear_mode = linear_mode

    # ---- row-invariant building blocks -------------------------------------------------

    def linear(self, x: torch.Tensor, module: torch.nn.Linear) -> torch.Tensor:
        weight, bias = module.weight, module.bias
        n = x.shape[0]
        if self.linear_mode == "reduce":
            out = torch.cat([(x[i : i + 64].unsqueeze(1) * weight.unsqueeze(0)).sum(-1) for i in range(0, n, 64)])
        else:
            t = self.tile_rows
            pad = (-n) % t
            if pad:
                x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            x = x.contiguous()  # tiles of t rows then start 64-byte aligned for any width
            out = torch.cat([F.linear(x[i : i + t], weight) for i in range(0, n + pad, t)])[:n]
        return out + bias if bias is not None else out

    @staticmethod
    def rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
        # Same arithmetic as LlamaRMSNorm (and Mistral's, Qwen2's, Qwen3's).
        variance = x.pow(2).mean(-1, keepdim=True)
        return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions].unsqueeze(1)  # [N, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def attention(self, layer: int, q: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """q [N, H, D] -> [N, H, D]; each row attends over its own slot up to its position."""
        out = torch.empty_like(q)
        bucket = self.attention_bucket
        key_len = torch.clamp((positions // bucket + 1) * bucket, max=self.max_len)
        grouped = self.num_kv_heads != self.num_heads
        for length in torch.unique(key_len).tolist():
            idx = torch.nonzero(key_len == length).squeeze(1)
            sel = slots[idx]
            # Slice first so the gather copies only the `length` positions used.
            keys = self.cache_k[layer][:, :, :length].index_select(0, sel)  # [n, kvH, L, D]
            values = self.cache_v[layer][:, :, :length].index_select(0, sel)
            if grouped:
                keys, values = keys[:, self.kv_head_of], values[:, self.kv_head_of]
            scores = (q[idx].unsqueeze(2) * keys).sum(-1) * self.scaling  # [n, H, L]
            key_positions = torch.arange(length, device=self.device)[None, :]
            masked = key_positions > positions[idx][:, None]  # the future
            window = self.windows[layer]
            if window is not None:  # and what lies behind the window (HF: key > query - window)
                masked |= key_positions <= positions[idx][:, None] - window
            scores = scores.masked_fill(masked[:, None, :], float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            out[idx] = (weights.unsqueeze(-1) * values).sum(-2)
        return out

    # ---- the step ------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self, token_ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, logit_rows: torch.Tensor
    ) -> torch.Tensor:
        """One step over N rows (any mix of prefill and decode rows). Writes each row's
        K/V at (slot, position) and returns float32 logits for `logit_rows` [M, vocab].
        Rows of one slot must come in position order; a row sees every earlier position
        of its slot (written in this step or before)."""
        m = self.model.model
        n = token_ids.shape[0]
        hidden = m.embed_tokens.weight[token_ids]
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = self.rms_norm(hidden, layer.input_layernorm)
            q = self.linear(x, attn.q_proj).view(n, self.num_heads, self.head_dim)
            k = self.linear(x, attn.k_proj).view(n, self.num_kv_heads, self.head_dim)
            v = self.linear(x, attn.v_proj).view(n, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's dimension
                q, k = self.rms_norm(q, attn.q_norm), self.rms_norm(k, attn.k_norm)
            q, k = self.rope(q, positions), self.rope(k, positions)
            self.cache_k[i][slots, :, positions] = k
            self.cache_v[i][slots, :, positions] = v
            context = self.attention(i, q, slots, positions).reshape(n, self.num_heads * self.head_dim)
            hidden = hidden + self.linear(context, attn.o_proj)
            x = self.rms_norm(hidden, layer.post_attention_layernorm)
            mlp = layer.mlp
            gated = mlp.act_fn(self.linear(x, mlp.gate_proj)) * self.linear(x, mlp.up_proj)
            hidden = hidden + self.linear(gated, mlp.down_proj)
        final = self.rms_norm(hidden[logit_rows], m.norm)
        return self.linear(final, self.model.lm_head).float()
