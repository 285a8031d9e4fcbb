"""GRPO on torch: the embedded default `Trainer`.

One `train_step` is one optimizer step on a batch of finished groups, in two stages
(`StagedTrainer`): `prepare_step` computes it (forward, backward, checks, gradient
clipping) and `commit_step` applies it (optimizer step, weight check, step counter), so
the train pump holds the commit lock only around the second. The step:
- advantages are group-normalized: (reward - group mean) / (group std + eps), the std
  taken over the group (population std, as GRPO papers write it); `scale_rewards=False`
  keeps only the mean subtraction (Dr. GRPO);
- every policy token gets its sequence's advantage and an importance ratio
  exp(logp_new - logp_old) against the log-probability the generating policy reported
  (`Completion.logprobs`), both at the temperature the engine reported it at
  (`GRPOConfig.temperature`), so groups generated under an older policy version (the
  asynchronous case) are corrected, and the ratio is clipped PPO-style to
  [1 - clip_eps, 1 + clip_eps_high];
- tokens the environment wrote (`loss_mask` 0) are context, never trained;
- `shared_prefix_packing` lays each group out as one row, its prompt once and a tree
  attention mask over the completions (controller/training/packing.py): the same loss and
  gradients as one row per completion, up to float rounding, in fewer tokens;
- optional KL penalty to the initial policy (k3 estimator); off by default (KL-free);
- optional entropy bonus at the policy's tokens; a tiny policy trained with Adam at the
  learning rates that make it learn in minutes tends to collapse onto one reply per
  prompt, after which every group is flat and there is nothing left to learn from
  (bench/grpo_learning_curve.py measures this; 0.01-0.03 kept every tried seed learning).

The model is any causal LM in a Hugging Face directory (config.json, model.safetensors,
tokenizer files); nothing here depends on how that directory was made.

Checkpoints hold no pickle: weights in `model.safetensors` (the directory stays a loadable
HF model directory: config and tokenizer files are copied beside it), optimizer tensors
and the RNG state in `trainer_state.safetensors`, everything else in `trainer_state.json`.
Loading restores the exact bits, so a resumed trainer takes the same next step.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rolloutdb.controller.training.packing import PackedBatch, additive_mask, micro_batches, pack, pack_shared_prefix
from rolloutdb.controller.protocols import CheckpointState, Completion, NonFiniteTraining, TrainGroup
from rolloutdb.controller.training.checkpoints import write_checkpoint_state

CHECKPOINT_FORMAT = 1
WEIGHTS_FILE = "model.safetensors"
STATE_TENSORS_FILE = "trainer_state.safetensors"
STATE_JSON_FILE = "trainer_state.json"
REFERENCE_FILE = "reference.safetensors"
NON_FINITE_ADVICE = ("lower the learning rate (algorithm.learning_rate, or the trainer factory's option), "
                     "and check the rewards and the model's weights")
# Files of the source model directory that make a checkpoint a loadable model directory.
MODEL_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass
class GRPOConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # None: symmetric clipping
    adv_eps: float = 1e-6
    scale_rewards: bool = True  # divide by the group std (False: Dr. GRPO)
    max_grad_norm: float | None = 1.0
    kl_coef: float = 0.0  # > 0 keeps a frozen copy of the initial weights
    # > 0 rewards the policy's entropy at its own tokens: keeps a tiny policy from
    # collapsing onto one reply per prompt (then every group is flat: nothing to learn).
    entropy_coef: float = 0.0
    # "token_mean": every policy token in the batch weighs the same (long replies are not
    # diluted); "sequence_mean": mean per sequence, then over sequences (original GRPO).
    loss_aggregation: str = "token_mean"
    # sequences per forward/backward; None: all. Under shared_prefix_packing a micro-batch
    # takes whole groups (controller/training/packing.py micro_batches).
    micro_batch_size: int | None = None
    # One row per group: the shared prompt once, a tree attention mask over the
    # completions (controller/training/packing.py); same loss and gradients, fewer tokens.
    shared_prefix_packing: bool = False
    seed: int = 0  # recorded with the checkpoint; a step itself draws no random numbers
    # The temperature the engine reported the old logprobs at: the policy's logprobs are
    # computed at it too (log-softmax of logits / temperature), so that a sample of the
    # policy has ratio 1 and an older policy's samples are corrected against the tempered
    # distribution they were drawn from. The reference engine reports at the call's
    # temperature (controller/job/build.py passes generation.temperature); vLLM reports raw
    # logprobs (1.0). Greedy calls (temperature 0) report at 1.0. One per run: a call an
    # agent server makes at a temperature of its own is corrected against this one.
    temperature: float = 1.0

    def __post_init__(self):
        if self.loss_aggregation not in ("token_mean", "sequence_mean"):
            raise ValueError("loss_aggregation must be token_mean or sequence_mean")
        if not 0 < self.clip_eps < 1:
            raise ValueError("clip_eps must be in (0, 1)")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError("temperature must be a positive number (1.0 for greedy calls and raw logprobs)")
        self.betas = tuple(self.betas)


@dataclass
class PreparedStep:
    """A step `prepare_step` computed and `commit_step` has not applied: the gradients
    stay in the parameters' `.grad`; these are the step it makes and its metrics."""

    step: int  # the trainer's `step` + 1 when prepared: committed only as that step
    metrics: dict[str, float]


# ------------------------------------------------------------------- pure computations


def group_advantages(rewards: Sequence[float], eps: float = 1e-6,
                     scale: bool = True) -> list[float]:
    """(r - mean) / (std + eps) with the population std of the group; a group whose
    rewards are all equal gets zero advantages (nothing to learn from it)."""
    n = len(rewards)
    if n == 0:
        return []
    if max(rewards) == min(rewards):
        return [0.0] * n  # exactly zero, not float noise around the mean
    top = max(abs(r) for r in rewards)
    if scale and top > _SQUARE_SAFE:
        # A reward past ~1e154 overflows its square (and a sum of a few past 1e308): the
        # scaled advantage does not depend on the rewards' unit, so compute it in units of
        # the largest. Below this line the arithmetic is the plain one, bit for bit.
        return group_advantages([r / top for r in rewards], eps / top, scale)
    mean = sum(rewards) / n
    if not scale:
        return [r - mean for r in rewards]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + eps) for r in rewards]


_SQUARE_SAFE = 1e150


def clipped_token_losses(logp_new: torch.Tensor, logp_old: torch.Tensor,
                         advantages: torch.Tensor, clip_low: float,
                         clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO surrogate -min(ratio*A, clip(ratio, 1-low, 1+high)*A) and whether
    each token was clipped. Shapes broadcast ([B, T] with advantages [B, 1])."""
    ratio = torch.exp(logp_new - logp_old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    losses = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).detach()
    return losses, was_clipped


def aggregate(token_losses: torch.Tensor, mask: torch.Tensor, how: str,
              total_tokens: torch.Tensor | float | None = None,
              n_sequences: int | None = None) -> torch.Tensor:
    """Reduce masked per-token losses to one scalar (see GRPOConfig.loss_aggregation).
    `total_tokens` / `n_sequences` default to this tensor's own; a micro-batch passes
    the whole batch's so that the micro-batch losses add up to the batch loss."""
    mask = mask.to(token_losses.dtype)
    masked = token_losses * mask
    if how == "token_mean":
        if total_tokens is None:
            total_tokens = mask.sum().clamp(min=1.0)
        return masked.sum() / total_tokens
    if n_sequences is None:
        n_sequences = token_losses.shape[0]
    return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum() / n_sequences


def token_logprobs(model: torch.nn.Module, batch: PackedBatch, rows: slice = slice(None),
                   seqs: slice | None = None, with_entropy: bool = False, temperature: float = 1.0):
    """Log-probabilities of the output tokens of sequences `seqs` (default: `rows`, the
    plain layout's one row per sequence) under `model` at `temperature`, [seqs, T],
    running the forward pass on `rows`, which must hold those sequences; with
    `with_entropy`, also the entropy of the policy's distribution at each of them."""
    seqs = rows if seqs is None else seqs
    mask = batch.attention_mask[rows]
    if mask.dim() == 3:  # a tree mask (pack_shared_prefix): the model's dtype, additive
        mask = additive_mask(mask, next(model.parameters()).dtype)
    extra = {} if batch.position_ids is None else {"position_ids": batch.position_ids[rows]}
    logits = model(input_ids=batch.input_ids[rows], attention_mask=mask, **extra).logits.float()
    row_of = batch.seq_rows[seqs] - (rows.start or 0)
    picked = logits[row_of.unsqueeze(1), batch.gather_positions[seqs]]  # [seqs, T, V]
    if temperature != 1.0:
        picked = picked / temperature
    logp_all = torch.log_softmax(picked, dim=-1)
    logp = logp_all.gather(-1, batch.target_ids[seqs].unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp
    return logp, -(logp_all.exp() * logp_all).sum(-1)


# --------------------------------------------------------------------------- trainer


class GRPOTrainer:
    """Implements `rolloutdb.controller.protocols.Trainer` for a causal LM on torch."""

    def __init__(self, model_dir: str | Path, config: GRPOConfig | None = None):
        from transformers import AutoModelForCausalLM

        self.config = config or GRPOConfig()
        self.model_dir = Path(model_dir)
        # No global torch.manual_seed here: the engine and the controller share this
        # process, and a step draws no random numbers (weights come from the directory).
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.train()
        self.pad_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.config.lr, betas=self.config.betas,
            eps=self.config.adam_eps, weight_decay=self.config.weight_decay)
        self.reference = None
        if self.config.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self._step = 0
        self._copy_buffers: dict[str, torch.Tensor] = {}  # checkpoint_state's, reused

    @property
    def step(self) -> int:
        return self._step

    # ----------------------------------------------------------------------- training

    def train_step(self, groups: Sequence[TrainGroup]) -> dict[str, float]:
        """One whole step: `commit_step(prepare_step(groups))`."""
        return self.commit_step(self.prepare_step(groups))

    def prepare_step(self, groups: Sequence[TrainGroup]) -> PreparedStep:
        """Forward and backward over the batch, the loss and gradient checks and the
        gradient clipping; the gradients stay in the parameters' `.grad` for
        `commit_step`. Changes no weight, no optimizer state and not `step`."""
        cfg = self.config
        completions: list[Completion] = []
        advantages: list[float] = []
        for g in groups:
            rewards = [c.reward for c in g.completions]
            completions.extend(g.completions)
            advantages.extend(group_advantages(rewards, cfg.adv_eps, cfg.scale_rewards))
        if cfg.shared_prefix_packing:
            batch = pack_shared_prefix([g.completions for g in groups], advantages, self.pad_id)
        else:
            batch = pack(completions, advantages, self.pad_id)
        B = batch.target_ids.shape[0]  # sequences (completions), whichever the layout
        # Normalizers over the whole batch, so micro-batching changes no gradient.
        total_tokens = batch.loss_mask.sum().clamp(min=1.0)
        clip_high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high

        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = clipped_sum = kl_sum = ratio_sum = entropy_sum = 0.0
        for rows, seqs in micro_batches(batch, cfg.micro_batch_size):
            mask = batch.loss_mask[seqs]
            new, entropy = token_logprobs(self.model, batch, rows, seqs, with_entropy=True, temperature=cfg.temperature)
            old = batch.old_logprobs[seqs]
            # Environment tokens and padding may carry any "old" logprob; keep them out
            # of exp() so a garbage value cannot turn into inf * 0 = nan.
            old = torch.where(mask > 0, old, new.detach())
            losses, was_clipped = clipped_token_losses(new, old, batch.advantages[seqs],
                                                       cfg.clip_eps, clip_high)
            if self.reference is not None:
                with torch.no_grad():
                    ref = token_logprobs(self.reference, batch, rows, seqs, temperature=cfg.temperature)
                d = ref - new
                kl = torch.exp(d) - d - 1.0
                losses = losses + cfg.kl_coef * kl
                kl_sum += float((kl.detach() * mask).sum())
            if cfg.entropy_coef:
                losses = losses - cfg.entropy_coef * entropy
            entropy_sum += float((entropy.detach() * mask).sum())
            part = aggregate(losses, mask, cfg.loss_aggregation, total_tokens, B)
            part.backward()
            loss_sum += float(part.detach())
            clipped_sum += float((was_clipped.float() * mask).sum())
            ratio_sum += float((torch.exp(new.detach() - old) * mask).sum())
        # Nothing non-finite reaches the weights: the loss and the gradient are checked
        # here, before the optimizer step; the weights it makes in commit_step.
        step = self._step + 1
        if not math.isfinite(loss_sum):
            raise NonFiniteTraining(step, "the loss", loss_sum, NON_FINITE_ADVICE)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if cfg.max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        else:
            grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        if not math.isfinite(grad_norm):
            raise NonFiniteTraining(step, "the gradient's norm", grad_norm, NON_FINITE_ADVICE)
        n_tok = float(total_tokens)
        rewards = [c.reward for c in completions]
        return PreparedStep(step, {
            "loss": loss_sum,
            "reward_mean": sum(rewards) / len(rewards),
            "clip_fraction": clipped_sum / n_tok,
            "ratio_mean": ratio_sum / n_tok,
            "kl": kl_sum / n_tok,
            "entropy": entropy_sum / n_tok,
            "grad_norm": grad_norm,
            "policy_tokens": n_tok,
            "sequences": float(B),
        })

    def commit_step(self, prepared: PreparedStep) -> dict[str, float]:
        """The optimizer step on the gradients `prepare_step` left, the check of the
        weights it made (before anyone sees them: refit, checkpoint) and the step
        counter. The weight check is one pass over the parameters."""
        if prepared.step != self._step + 1:
            raise ValueError(f"a step prepared as step {prepared.step} cannot be committed at step {self._step + 1}")
        self.optimizer.step()
        for name, weight in self.model.named_parameters():
            if not bool(torch.isfinite(weight).all()):
                value = float(weight.detach()[~torch.isfinite(weight.detach())].flatten()[0])
                raise NonFiniteTraining(prepared.step, f"weight {name} after the optimizer step", value,
                                        NON_FINITE_ADVICE)
        self._step += 1
        return dict(prepared.metrics)

    @torch.no_grad()
    def logprobs_of(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> list[float]:
        """The current policy's log-probability of each of `token_ids` after
        `prompt_ids`, at the configured temperature (for tests, and for engines that report
        no logprobs)."""
        c = Completion(list(prompt_ids), list(token_ids), [0.0] * len(token_ids),
                       [self._step] * len(token_ids), 0.0)
        batch = pack([c], [0.0], self.pad_id)
        return token_logprobs(self.model, batch, temperature=self.config.temperature)[0, : len(token_ids)].tolist()

    # -------------------------------------------------------------------------- refit

    def export_weights(self) -> dict[str, torch.Tensor]:
        """A detached copy of the state dict (tied tensors stay shared), safe to hand to
        an engine while training continues."""
        out: dict[str, torch.Tensor] = {}
        copies: dict[int, torch.Tensor] = {}
        for name, t in self.model.state_dict().items():
            key = t.data_ptr()
            if key not in copies:
                copies[key] = t.detach().clone()
            out[name] = copies[key]
        return out

    # --------------------------------------------------------------------- checkpoint

    def save_checkpoint(self, directory: Path) -> list[Path]:
        return write_checkpoint_state(self._state(copy=False), Path(directory))

    def checkpoint_state(self) -> CheckpointState:
        """A copy of everything save_checkpoint writes, for `checkpointing.async`: the
        weights, the optimizer's moments (2x the weights under AdamW) and the RNG state
        copied into CPU buffers kept for the run (3x the parameter bytes of memory). The
        buffers are reused: the next call overwrites this state, which is safe because
        `TrainerCheckpoints` asks again only once this state is written (one write at a
        time). Reuse makes the copy one memcpy without allocation: fresh buffers cost
        ~0.3 s of CPU per 541 MiB here, first-touch page faults included, reused ones
        ~0.06 s (bench/bench_async_checkpoint.py, 2026-12-01)."""
        return self._state(copy=True)

    def _state(self, *, copy: bool) -> CheckpointState:
        def own(key: str, t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if not copy:
                return t.contiguous()
            buf = self._copy_buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self._copy_buffers[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            return buf.copy_(t)

        state = CheckpointState(metadata={WEIGHTS_FILE: {"format": "pt"}, REFERENCE_FILE: {"format": "pt"}})
        state.tensors[WEIGHTS_FILE] = {k: own(f"w.{k}", v) for k, v in _dedup_shared(self.model.state_dict()).items()}
        state.copies = {name: self.model_dir / name for name in MODEL_SIDE_FILES if (self.model_dir / name).is_file()}
        if self.reference is not None:
            state.tensors[REFERENCE_FILE] = {k: own(f"r.{k}", v)
                                             for k, v in _dedup_shared(self.reference.state_dict()).items()}
        opt = self.optimizer.state_dict()
        tensors: dict[str, torch.Tensor] = {"rng.cpu": torch.get_rng_state()}
        state_json: dict[str, dict[str, Any]] = {}
        for idx, entry in opt["state"].items():
            state_json[str(idx)] = {}
            for k, v in entry.items():
                if torch.is_tensor(v):
                    tensors[f"optimizer.state.{idx}.{k}"] = own(f"o.{idx}.{k}", v)
                else:
                    state_json[str(idx)][k] = v
        state.tensors[STATE_TENSORS_FILE] = tensors
        # json round trip: a deep copy of the param groups, taken now, not at write time
        state.documents[STATE_JSON_FILE] = json.loads(json.dumps({
            "format": CHECKPOINT_FORMAT,
            "step": self._step,
            "config": asdict(self.config),
            "optimizer": {"param_groups": opt["param_groups"], "state_scalars": state_json},
        }))
        return state

    def load_checkpoint(self, directory: Path) -> None:
        directory = Path(directory)
        for name in (WEIGHTS_FILE, STATE_TENSORS_FILE, STATE_JSON_FILE):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"checkpoint {directory} lacks {name}")
        doc = json.loads((directory / STATE_JSON_FILE).read_text())
        if doc.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"checkpoint {directory} has format {doc.get('format')!r}, "
                             f"this code reads {CHECKPOINT_FORMAT}")
        _load_weights(self.model, load_file(directory / WEIGHTS_FILE))
        if self.reference is not None and (directory / REFERENCE_FILE).is_file():
            _load_weights(self.reference, load_file(directory / REFERENCE_FILE))
        tensors = load_file(directory / STATE_TENSORS_FILE)
        state: dict[int, dict[str, Any]] = {}
        for idx, scalars in doc["optimizer"]["state_scalars"].items():
            state[int(idx)] = dict(scalars)
        prefix = "optimizer.state."
        for key, value in tensors.items():
            if key.startswith(prefix):
                idx, name = key[len(prefix):].split(".", 1)
                state.setdefault(int(idx), {})[name] = value
        # torch's load_state_dict takes moments of any shape; the first step would fail on them
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for index, entry in state.items():
            if not 0 <= index < len(params):
                raise ValueError(f"checkpoint {directory} has optimizer state for parameter {index}; "
                                 f"the model has {len(params)}")
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() and value.shape != params[index].shape:
                    raise ValueError(f"checkpoint {directory}: optimizer state {index}.{key} has shape "
                                     f"{tuple(value.shape)}, its parameter's is {tuple(params[index].shape)}")
        groups = doc["optimizer"]["param_groups"]
        for g in groups:
            if "betas" in g:
                g["betas"] = tuple(g["betas"])
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        torch.set_rng_state(tensors["rng.cpu"])
        self._step = int(doc["step"])


def config_from_dict(values: Mapping[str, Any]) -> GRPOConfig:
    """A GRPOConfig from a mapping, refusing keys it does not know."""
    known = {f.name for f in fields(GRPOConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown GRPO setting(s): {', '.join(unknown)}")
    return GRPOConfig(**values)


def _dedup_shared(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings); keep the first
    name of each, as Hugging Face's save_pretrained does."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().contiguous()
    return out


def _load_weights(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy saved tensors into the live parameters (the optimizer keeps pointing at
    them); a name missing from the file is only allowed for a tied alias, and every
    shape must be the model's (`copy_` would broadcast a (64,) tensor into a (128, 64)
    weight without a word)."""
    live = model.state_dict()
    by_ptr: dict[int, str] = {}
    for name, t in live.items():
        by_ptr.setdefault(t.data_ptr(), name)
    with torch.no_grad():
        for name, t in live.items():
            src = tensors.get(name)
            if src is None:
                if by_ptr[t.data_ptr()] != name and by_ptr[t.data_ptr()] in tensors:
                    continue  # tied to a tensor already loaded
                raise KeyError(f"checkpoint lacks weight {name}")
            if src.shape != t.shape:
                raise ValueError(f"checkpoint weight {name} has shape {tuple(src.shape)}, "
                                 f"the model's is {tuple(t.shape)}")
            t.copy_(src)
    extra = sorted(set(tensors) - set(live))
    if extra:
        raise KeyError(f"checkpoint has weights the model lacks: {', '.join(extra[:3])}")
