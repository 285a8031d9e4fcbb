"""GRPO train-step time with shared-prefix packing (`algorithm.shared_prefix_packing`)
next to one row per completion, side by side in one run.

    python bench/bench_shared_prefix_packing.py            # the figures in BENCHMARKS.md
    python bench/bench_shared_prefix_packing.py --quick    # two repeats, small shapes

Two shapes, each on its own freshly built policy:

- `quickstart`: examples/quickstart.yaml's groups: its tiny policy (built from the
  config, as a run builds it), groups_per_step x group_size groups of its real prompts
  (`env.start`), replies of 1..generation.max_tokens random task tokens;
- `long-prompt`: a policy of the same size with a longer context, `--long-groups` groups
  of 8 completions behind a 512-token prompt, replies of 32 tokens.

Per shape, one trainer per layout from the same weights (lr 0: every step sees the same
weights, so the repeats measure the same work), one warm-up step each, then `--repeats`
rounds that time one `train_step` of each layout, the order alternating round by round
(interleaved, so load on the shared machine hits both alike). Reported: median step time
per layout, plain / packed of the medians, the per-round ratio's median, and the tokens
each layout runs through the model per step (rows x padded row length).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from benchlib import machine_line  # noqa: E402

from rolloutdb.config import load_config  # noqa: E402
from rolloutdb.controller.job import build  # noqa: E402
from rolloutdb.controller.tasks import registry  # noqa: E402
from rolloutdb.controller.training.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from rolloutdb.controller.training.packing import pack, pack_shared_prefix  # noqa: E402
from rolloutdb.controller.protocols import Completion, TrainGroup  # noqa: E402
from rolloutdb.controller.tasks.digits import TASK_ALPHABET  # noqa: E402
from rolloutdb.gpu_capture.tiny_policy import build_tiny_policy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _groups(prompts: list[list[int]], group_size: int, reply_len, vocab: range, rng: random.Random) -> list[TrainGroup]:
    out = []
    for g, prompt in enumerate(prompts):
        comps = []
        for i in range(group_size):
            tokens = [rng.choice(vocab) for _ in range(reply_len(rng))]
            comps.append(Completion(list(prompt), tokens, [-2.5] * len(tokens), [0] * len(tokens), float(i % 3)))
        out.append(TrainGroup(g, g, comps))
    return out


def quickstart_shape(root: Path, rng: random.Random, groups: int | None) -> tuple[Path, list[TrainGroup]]:
    cfg = load_config(REPO / "examples" / "quickstart.yaml")
    policy = build.build_policy(cfg, root / "quickstart_policy")
    _, env = registry.build_task(cfg, policy)
    n = groups or cfg.algorithm.groups_per_step
    prompts = [list(env.start(p)[0]) for p in range(n)]
    vocab = range(3, len(TASK_ALPHABET) + 3)
    max_tokens = cfg.generation.max_tokens
    return policy, _groups(prompts, cfg.algorithm.group_size, lambda r: r.randint(1, max_tokens), vocab, rng)


def long_prompt_shape(root: Path, rng: random.Random, groups: int, prompt_len: int, reply_len: int,
                      group_size: int) -> tuple[Path, list[TrainGroup]]:
    cfg = load_config(REPO / "examples" / "quickstart.yaml")  # the same policy size as the quickstart's
    policy = build_tiny_policy(root / "long_policy", seed=0, hidden_size=cfg.policy.hidden_size,
                               num_layers=cfg.policy.num_layers, num_heads=cfg.policy.num_heads,
                               intermediate_size=4 * cfg.policy.hidden_size,
                               max_position_embeddings=prompt_len + reply_len + 8, alphabet=TASK_ALPHABET)
    vocab = range(3, len(TASK_ALPHABET) + 3)
    prompts = [[1] + [rng.choice(vocab) for _ in range(prompt_len - 1)] for _ in range(groups)]
    return policy, _groups(prompts, group_size, lambda r: reply_len, vocab, rng)


def measure(name: str, policy: Path, groups: list[TrainGroup], repeats: int) -> dict:
    trainers = {
        "plain": GRPOTrainer(policy, GRPOConfig(lr=0.0, entropy_coef=0.02)),
        "packed": GRPOTrainer(policy, GRPOConfig(lr=0.0, entropy_coef=0.02, shared_prefix_packing=True)),
    }
    comps = [c for g in groups for c in g.completions]
    plain_batch = pack(comps, [0.0] * len(comps))
    packed_batch = pack_shared_prefix([g.completions for g in groups], [0.0] * len(comps))
    tokens = {"plain": plain_batch.input_ids.numel(), "packed": packed_batch.input_ids.numel()}
    for tr in trainers.values():  # warm-up: allocator, kernels, optimizer state
        tr.train_step(groups)
    times: dict[str, list[float]] = {"plain": [], "packed": []}
    for r in range(repeats):
        order = ("plain", "packed") if r % 2 == 0 else ("packed", "plain")
        for layout in order:
            t0 = time.perf_counter()
            trainers[layout].train_step(groups)
            times[layout].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "shape": name,
        "groups": len(groups),
        "group_size": len(groups[0].completions),
        "prompt_tokens": len(groups[0].completions[0].prompt_ids),
        "reply_tokens_mean": sum(len(c.token_ids) for c in comps) / len(comps),
        "tokens_per_step": tokens,
        "median_s": med,
        "ratio_plain_over_packed": med["plain"] / med["packed"],
        "per_round_ratio_median": statistics.median(p / q for p, q in zip(times["plain"], times["packed"])),
        "times_s": times,
    }
    print(f"{name:12s} {len(groups)} groups x {result['group_size']}, prompt {result['prompt_tokens']}, "
          f"replies ~{result['reply_tokens_mean']:.1f}: plain {med['plain'] * 1e3:.1f} ms "
          f"({tokens['plain']} tokens), packed {med['packed'] * 1e3:.1f} ms ({tokens['packed']} tokens), "
          f"plain/packed {result['ratio_plain_over_packed']:.2f}x (per round {result['per_round_ratio_median']:.2f}x)",
          flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--long-groups", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="2 repeats, small shapes (smoke run)")
    ap.add_argument("--dir", type=Path, default=None, help="where to build the policies (a temporary dir)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.long_groups, args.prompt, args.reply = 2, 2, 64, 8
    torch.set_num_threads(args.threads)
    print(machine_line() + f", torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        results = [measure("quickstart", *quickstart_shape(root, rng, 2 if args.quick else None), args.repeats),
                   measure("long-prompt", *long_prompt_shape(root, rng, args.long_groups, args.prompt, args.reply,
                                                             args.group_size), args.repeats)]
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
