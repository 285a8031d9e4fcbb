"""Throughput of the CPU reference engine against plain HF `generate` (KV cache, left
padding) on the same tiny policy, side by side in one run, and whether each continues
a call bit-exactly.

    python bench/bench_reference_engine.py [--calls 16] [--tokens 32] [--threads 1 2]

The ratio (reference / HF) is the price of batch invariance: fixed-size GEMM tiles and
per-row attention instead of one GEMM over the batch.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rolloutdb.gpu_capture import GenerationRequest, ReferenceEngine, SamplingParams, build_tiny_policy, encode_strict, load_policy


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    return [encode_strict(tokenizer, f"task {i}: {i * 7 % 13} + {i * 5 % 11} = ?\n", add_bos=True) for i in range(n)]


def time_reference(policy: Path, threads: int, calls: int, tokens: int, reps: int) -> tuple[float, bool]:
    with ReferenceEngine(policy, max_batch_size=max(calls, 1), num_threads=threads) as eng:
        prompts = prompts_for(eng.tokenizer, calls)
        reqs = [
            GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=tokens, min_tokens=tokens, top_p=0.95, seed=i))
            for i, p in enumerate(prompts)
        ]
        full = eng.generate(reqs)  # warm-up, and the reference for the exactness check
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            eng.generate(reqs)
            times.append(time.perf_counter() - start)
        k = tokens // 2
        again = eng.generate(
            [
                GenerationRequest(r.request_id, r.prompt_ids, r.params, f.token_ids[:k], f.token_versions[:k], f.logprobs[:k])
                for r, f in zip(reqs, full)
            ]
        )
        exact = all(a.token_ids == f.token_ids and a.logprobs == f.logprobs for a, f in zip(again, full))
    return statistics.median(times), exact


def time_hf(policy: Path, threads: int, calls: int, tokens: int, reps: int) -> float:
    torch.set_num_threads(threads)
    model, tokenizer = load_policy(policy)
    prompts = prompts_for(tokenizer, calls)
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, top_p=0.95,
                  pad_token_id=tokenizer.pad_token_id)
    model.generate(ids, **kwargs)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        policy = build_tiny_policy(Path(tmp) / "policy", seed=0)
        for threads in args.threads:
            for calls in args.calls:
                ours, exact = time_reference(policy, threads, calls, args.tokens, args.reps)
                theirs = time_hf(policy, threads, calls, args.tokens, args.reps)
                n = calls * args.tokens
                print(
                    f"threads={threads} {calls} calls x {args.tokens} tokens: reference {ours * 1e3:.0f} ms "
                    f"({n / ours:.0f} tok/s, resume bit-exact: {exact}) | HF generate {theirs * 1e3:.0f} ms "
                    f"({n / theirs:.0f} tok/s) | ratio {ours / theirs:.2f}"
                )


if __name__ == "__main__":
    main()
