"""Does the embedded task learn? A synchronous GRPO loop, timed.

Each step: sample `groups` prompts, generate `group_size` replies each with a batched
KV-cache sampler (a separate copy of the policy, standing in for the engine), score them
with the environment, train one GRPO step, refit the sampler's weights. Prints the reward
curve, the mean reward of the first and last five steps, and the wall time.

    python bench/grpo_learning_curve.py                       # single turn, the
                                                              # recommended quickstart settings
    python bench/grpo_learning_curve.py --env digits_multiturn
    python bench/grpo_learning_curve.py --model-dir DIR       # an existing HF model dir

Without --model-dir the embedded default policy (gpu_capture.tiny_policy: random-init
Llama, byte-level BPE over a small alphabet) is built into a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from rolloutdb.controller.training.grpo import GRPOConfig, GRPOTrainer
from rolloutdb.controller.protocols import Completion, TrainGroup
from rolloutdb.controller.tasks.digits import TASK_ALPHABET, DigitPromptDataset
from rolloutdb.controller.tasks.registry import make_environment


def build_model_dir(directory: Path, hidden: int, layers: int, seed: int,
                    alphabet: str | None) -> Path:
    """The embedded default policy (gpu_capture.tiny_policy), optionally over a smaller
    tokenizer alphabet."""
    from rolloutdb.gpu_capture.tiny_policy import build_tiny_policy

    extra = {"alphabet": alphabet} if alphabet else {}
    return build_tiny_policy(directory, seed=seed, hidden_size=hidden, num_layers=layers,
                             intermediate_size=2 * hidden, **extra)


@torch.no_grad()
def sample(model, prompts: list[list[int]], max_tokens: int, eos_id: int | None,
           gen: torch.Generator, temperature: float = 1.0):
    """Batched ancestral sampling with a KV cache and left padding. Returns, per prompt,
    (token ids, logprobs under the sampling distribution); a reply ends after EOS."""
    from transformers import DynamicCache

    B = len(prompts)
    P = max(len(p) for p in prompts)
    ids = torch.zeros((B, P), dtype=torch.long)
    attn = torch.zeros((B, P), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        attn[b, P - len(p):] = 1
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache()
    out_tokens = [[] for _ in range(B)]
    out_lp = [[] for _ in range(B)]
    done = [False] * B
    step_ids, step_pos = ids, pos
    for _ in range(max_tokens):
        logits = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                       cache=cache, use_cache=True).logits[:, -1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
        chosen = logp.gather(1, nxt.unsqueeze(1)).squeeze(1)
        for b in range(B):
            if not done[b]:
                out_tokens[b].append(int(nxt[b]))
                out_lp[b].append(float(chosen[b]))
                done[b] = eos_id is not None and int(nxt[b]) == eos_id
        if all(done):
            break
        step_ids = nxt.unsqueeze(1)
        step_pos = step_pos[:, -1:] + 1
        attn = torch.cat([attn, torch.ones((B, 1), dtype=torch.long)], dim=1)
    return list(zip(out_tokens, out_lp))


def rollout_groups(model, env, prompt_ids: list[int], group_size: int, max_tokens: int,
                   eos_id: int | None, gen: torch.Generator, version: int) -> list[TrainGroup]:
    """Run every episode of every group turn by turn, batching each turn across all
    episodes; environment tokens enter the completion with loss_mask 0."""
    episodes = []
    for pid in prompt_ids:
        for _ in range(group_size):
            first, state = env.start(pid)
            episodes.append({"pid": pid, "prompt": first, "ctx": list(first), "state": state,
                             "tokens": [], "lp": [], "mask": [], "done": False})
    for _turn in range(env.max_turns):
        live = [e for e in episodes if not e["done"]]
        if not live:
            break
        replies = sample(model, [e["ctx"] for e in live], max_tokens, eos_id, gen)
        for e, (toks, lps) in zip(live, replies):
            turn, e["state"] = env.step(e["state"], toks)
            e["tokens"] += toks
            e["lp"] += lps
            e["mask"] += [1] * len(toks)
            obs = list(turn.observation_ids)
            e["tokens"] += obs
            e["lp"] += [0.0] * len(obs)
            e["mask"] += [0] * len(obs)
            e["ctx"] += toks + obs
            e["done"] = turn.done
    groups = []
    for g, pid in enumerate(prompt_ids):
        comps = [Completion(e["prompt"], e["tokens"], e["lp"], [version] * len(e["tokens"]),
                            env.score(e["state"]), e["mask"])
                 for e in episodes[g * group_size:(g + 1) * group_size]]
        groups.append(TrainGroup(group_id=g, prompt_id=pid, completions=comps))
    return groups


def rollout_with_engine(engine, env, prompt_ids: list[int], group_size: int, max_tokens: int,
                        step: int, seed: int) -> list[TrainGroup]:
    """The controller's own episode runner on the reference engine."""
    from rolloutdb.controller.rollout.episodes import Episode, call_seed, play_episodes
    from rolloutdb.gpu_capture.protocol import SamplingParams

    results = [Episode.start(env, pid, key=f"s{step}.g{g}.{i}", seed=call_seed(seed, step, g, i))
               for g, pid in enumerate(prompt_ids) for i in range(group_size)]
    play_episodes(engine, env, results, SamplingParams(max_tokens=max_tokens, temperature=1.0))
    groups = []
    for g, pid in enumerate(prompt_ids):
        comps = [Completion(r.prompt_ids, r.token_ids, r.logprobs, r.token_versions, r.reward, r.loss_mask)
                 for r in results[g * group_size:(g + 1) * group_size]]
        groups.append(TrainGroup(group_id=g, prompt_id=pid, completions=comps))
    return groups


def run(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tmp = None
    model_dir = args.model_dir
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory()
        alphabet = TASK_ALPHABET if args.alphabet == "task" else None
        model_dir = build_model_dir(Path(tmp.name), args.hidden, args.layers, args.seed, alphabet)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = DigitPromptDataset(size=args.dataset_size, n_digits=args.n_digits, seed=args.seed)
    env = make_environment(args.env, dataset, tokenizer, kind=args.task, turns=args.turns)
    trainer = GRPOTrainer(model_dir, GRPOConfig(
        lr=args.lr, clip_eps=args.clip_eps, seed=args.seed, entropy_coef=args.entropy_coef,
        scale_rewards=not args.no_std_scaling, kl_coef=args.kl_coef))
    if args.engine == "reference":
        from rolloutdb.gpu_capture.reference_engine import ReferenceEngine

        engine = ReferenceEngine(model_dir, max_batch_size=args.groups * args.group_size,
                                 num_threads=args.threads, seed=args.seed)
    else:
        sampler = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in trainer.model.parameters())
    gen = torch.Generator().manual_seed(args.seed)
    order = random.Random(args.seed)
    curve = []
    t0 = time.perf_counter()
    gen_time = train_time = 0.0
    flat_dropped = 0
    entropy = []
    for step in range(args.steps):
        t = time.perf_counter()
        pids = [order.randrange(len(dataset)) for _ in range(args.groups)]
        if args.engine == "reference":
            groups = rollout_with_engine(engine, env, pids, args.group_size, args.max_tokens,
                                         step, args.seed)
        else:
            groups = rollout_groups(sampler, env, pids, args.group_size, args.max_tokens,
                                    tokenizer.eos_token_id, gen, trainer.step)
        gen_time += time.perf_counter() - t
        t = time.perf_counter()
        rewards = [c.reward for g in groups for c in g.completions]
        curve.append(sum(rewards) / len(rewards))  # the policy's reward: every sample
        if not args.keep_flat_groups:
            # As the controller does: a group whose rewards are all equal has zero
            # advantages (nothing to learn); drop it rather than dilute the token mean.
            groups = [g for g in groups if len({c.reward for c in g.completions}) > 1]
        flat_dropped += args.groups - len(groups)
        if groups:
            metrics = trainer.train_step(groups)
            entropy.append(metrics["entropy"])
            if args.engine == "reference":
                engine.load_weights(trainer.export_weights(), trainer.step)  # refit
            else:
                sampler.load_state_dict(trainer.export_weights())  # refit
        train_time += time.perf_counter() - t
        if args.verbose and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d} reward {curve[-1]:.3f} flat groups dropped {flat_dropped} "
                  f"t={time.perf_counter() - t0:.1f}s", file=sys.stderr)
    wall = time.perf_counter() - t0
    if args.verbose:
        for c in [g.completions[0] for g in groups]:
            print(repr(tokenizer.decode(c.prompt_ids)), "->", repr(tokenizer.decode(c.token_ids)),
                  round(c.reward, 2), file=sys.stderr)
    k = min(5, len(curve))
    result = {
        "settings": {k2: (str(v) if isinstance(v, Path) else v) for k2, v in vars(args).items()},
        "params": n_params,
        "first5": sum(curve[:k]) / k,
        "last5": sum(curve[-k:]) / k,
        "wall_s": round(wall, 1),
        "generate_s": round(gen_time, 1),
        "train_s": round(train_time, 1),
        "flat_groups_dropped": flat_dropped,
        "train_steps": trainer.step,
        "curve": [round(r, 3) for r in curve],
        "entropy_first5": sum(entropy[:5]) / max(1, len(entropy[:5])),
        "entropy_last5": sum(entropy[-5:]) / max(1, len(entropy[-5:])),
    }
    if args.engine == "reference":
        engine.close()
    if tmp is not None:
        tmp.cleanup()
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--env", default="digits", choices=["digits", "digits_multiturn"])
    p.add_argument("--task", default="copy", choices=["copy", "successor", "reverse"])
    p.add_argument("--n-digits", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups", type=int, default=8, help="groups per step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--entropy-coef", type=float, default=0.02)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--no-std-scaling", action="store_true")
    p.add_argument("--max-tokens", type=int, default=4, help="per turn")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--alphabet", default="task", choices=["default", "task"],
                   help="tokenizer alphabet: tiny_policy's default or the task's own")
    p.add_argument("--engine", default="reference", choices=["reference", "simple"],
                   help="reference: gpu_capture's engine + the controller's episode runner")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep-flat-groups", action="store_true",
                   help="train on zero-variance groups too (the controller discards them)")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = p.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print("curve:", " ".join(f"{r:.2f}" for r in result["curve"]))
        print(f"params {result['params']}  reward first5 {result['first5']:.3f} -> last5 "
              f"{result['last5']:.3f}  wall {result['wall_s']}s (generate "
              f"{result['generate_s']}s, train {result['train_s']}s); "
              f"{result['train_steps']} optimizer steps, {result['flat_groups_dropped']} flat groups dropped")


if __name__ == "__main__":
    main()
