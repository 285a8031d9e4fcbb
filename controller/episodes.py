"""Running episodes: the policy and the environment take turns.

All episodes of a wave advance in lockstep, one engine batch per turn, so the engine
sees the largest batches it can. The environment keeps its state between turns in a
JSON-able dict (what a turn-level cut would export).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from rolloutdb.controller.protocols import Environment
from rolloutdb.gpu_capture.protocol import GenerationEngine, GenerationRequest, SamplingParams

ENV_TOKEN_VERSION = -1  # version tag of tokens the environment (not the policy) wrote


def call_seed(*parts: int) -> int:
    """A stable 31-bit seed from integers (run seed, epoch, prompt, generation, turn).
    The attempt is left out on purpose: a redone call samples what the first did."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@dataclass
class EpisodeSpec:
    key: str  # unique request-id stem, e.g. "g12.3-a0"
    prompt_id: int
    seed: int


@dataclass
class EpisodeResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def policy_tokens(self) -> int:
        return sum(self.loss_mask)


def run_episodes(
    engine: GenerationEngine,
    env: Environment,
    specs: Sequence[EpisodeSpec],
    params: SamplingParams,
) -> list[EpisodeResult]:
    """Play every episode to the end and score it."""
    results: list[EpisodeResult] = []
    states: list[dict] = []
    contexts: list[list[int]] = []
    for spec in specs:
        prompt, state = env.start(spec.prompt_id)
        results.append(EpisodeResult(prompt_ids=list(prompt)))
        states.append(state)
        contexts.append(list(prompt))
    active = list(range(len(specs)))
    for turn in range(env.max_turns):
        if not active:
            break
        requests = [
            GenerationRequest(
                request_id=f"{specs[i].key}-t{turn}",
                prompt_ids=contexts[i],
                params=_with_seed(params, call_seed(specs[i].seed, turn)),
            )
            for i in active
        ]
        outputs = engine.generate(requests)
        still_active = []
        for i, out in zip(active, outputs):
            r = results[i]
            r.token_ids += out.token_ids
            r.logprobs += out.logprobs
            r.token_versions += out.token_versions
            r.loss_mask += [1] * len(out.token_ids)
            r.finish_reasons.append(out.finish_reason)
            r.turns = turn + 1
            reply, states[i] = env.step(states[i], out.token_ids)
            if reply.done or turn + 1 == env.max_turns:
                continue
            obs = list(reply.observation_ids)
            r.token_ids += obs
            r.logprobs += [0.0] * len(obs)
            r.token_versions += [ENV_TOKEN_VERSION] * len(obs)
            r.loss_mask += [0] * len(obs)
            contexts[i] = contexts[i] + list(out.token_ids) + obs
            still_active.append(i)
        active = still_active
    for r, state in zip(results, states):
        r.reward = float(env.score(state))
    return results


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)
