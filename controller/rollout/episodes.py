"""One episode of one attempt: the policy and the environment take turns.

An `Episode` is a small state machine the streaming rollout pump drives: `request()` is
the model call for its next turn, `absorb(result)` takes that call's output, steps the
environment and appends its observation. Episodes never wait for each other: each one
has at most one call in flight, and the pump starts the next turn as soon as the
previous one is absorbed.

Everything an episode holds between turns is what turn-level recovery saves after a
finished turn (`progress()`): the environment's JSON-able state, the tokens after the
prompt (the policy's replies and the environment's observations), their logprobs and the
policy version of each (`ENV_TOKEN_VERSION` for the environment's: the loss mask is
"version != ENV_TOKEN_VERSION", the rule the train pump applies to samples), and the turn
index. `Episode.resumed(...)` rebuilds an episode from such a save, so its remaining turns
run exactly as they would have: each call's seed is a function of the episode's seed and
the turn (`call_seed`), never of the attempt or of the process.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from rolloutdb.controller.protocols import Environment
from rolloutdb.gpu_capture.protocol import GenerationEngine, GenerationRequest, GenerationResult, SamplingParams

ENV_TOKEN_VERSION = -1  # version tag of tokens the environment (not the policy) wrote


def call_seed(*parts: int) -> int:
    """A stable 31-bit seed from integers (run seed, epoch, prompt, generation, turn).
    The attempt is left out on purpose: a redone call samples what the first did."""
    digest = hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@functools.lru_cache(maxsize=64)
def _sets_reply_limits(env_type: type) -> bool:
    """Whether an environment class implements `ReplyLimits`. A runtime Protocol check
    walks the protocol's attributes (about 20 us, measured by bench_group_commit.py):
    once per class, not once per call."""
    return callable(getattr(env_type, "reply_limits", None))


@dataclass
class Episode:
    """One attempt's episode. `key` is unique among the episodes in flight (it stems the
    request ids); `seed` is the episode's (see `call_seed`)."""

    key: str
    prompt_ids: list[int]
    state: dict
    seed: int
    max_turns: int
    turn: int = 0  # turns finished; the index of the next call's turn
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    done: bool = False
    reward: float = 0.0

    @classmethod
    def start(cls, env: Environment, prompt_id: int, *, key: str, seed: int) -> Episode:
        prompt, state = env.start(prompt_id)
        return cls(key=key, prompt_ids=list(prompt), state=state, seed=seed, max_turns=env.max_turns)

    @classmethod
    def resumed(cls, env: Environment, prompt_id: int, *, key: str, seed: int, turn: int, state: dict,
                token_ids: Sequence[int], logprobs: Sequence[float], token_versions: Sequence[int]) -> Episode:
        """Continue a saved episode after its `turn` finished turns. The prompt comes from
        `env.start` again (deterministic for a prompt id, as the train pump assumes); the
        fresh state it returns is dropped for the saved one."""
        if not (len(token_ids) == len(logprobs) == len(token_versions)):
            raise ValueError(f"episode {key}: saved tokens, logprobs and versions differ in length")
        prompt, _fresh = env.start(prompt_id)
        return cls(key=key, prompt_ids=list(prompt), state=dict(state), seed=seed, max_turns=env.max_turns,
                   turn=turn, token_ids=list(token_ids), logprobs=list(logprobs),
                   token_versions=list(token_versions))

    @property
    def policy_tokens(self) -> int:
        return sum(1 for v in self.token_versions if v != ENV_TOKEN_VERSION)

    @property
    def loss_mask(self) -> list[int]:
        return [0 if v == ENV_TOKEN_VERSION else 1 for v in self.token_versions]

    def request(self, env: Environment, params: SamplingParams) -> GenerationRequest:
        """The model call of the next turn: the conversation so far as the prompt."""
        if self.done:
            raise RuntimeError(f"episode {self.key} is done; it has no next turn")
        seed = call_seed(self.seed, self.turn)
        if _sets_reply_limits(type(env)):
            low, high = env.reply_limits(self.state)  # type: ignore[attr-defined]
            high = min(int(high), params.max_tokens)
            params = replace(params, max_tokens=high, min_tokens=min(int(low), high), seed=seed)
        else:
            params = replace(params, seed=seed)
        return GenerationRequest(request_id=f"{self.key}-t{self.turn}", prompt_ids=self.prompt_ids + self.token_ids,
                                 params=params)

    def absorb(self, env: Environment, out: GenerationResult) -> None:
        """Take the finished call of the current turn: append the reply, step the
        environment, append its observation unless the episode ended; score it when it
        ends (done, or its last turn). The two halves (`take_reply`, then `apply` of the
        environment's `step_environment`) are what the rollout pump runs with the step
        in between on an environment worker (controller/rollout/env_steps.py)."""
        self.take_reply(out)
        self.apply(step_environment(env, self.state, out.token_ids, last=self.last_turn))

    def take_reply(self, out: GenerationResult) -> None:
        """Append the current turn's reply (its environment step follows)."""
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.token_versions += out.token_versions
        self.finish_reasons.append(out.finish_reason)

    @property
    def last_turn(self) -> bool:
        """Whether the turn in progress is the episode's last allowed one (its step scores)."""
        return self.turn + 1 >= self.max_turns

    def apply(self, step: StepOutcome) -> None:
        """The environment's answer to the reply taken: the new state, then either the
        end (with its reward) or the observation the next turn starts after."""
        self.state = step.state
        self.turn += 1
        if step.reward is not None:
            self.done = True
            self.reward = step.reward
            return
        obs = list(step.observation_ids)
        self.token_ids += obs
        self.logprobs += [0.0] * len(obs)
        self.token_versions += [ENV_TOKEN_VERSION] * len(obs)


@dataclass(frozen=True)
class StepOutcome:
    """One environment step as plain data (what an environment worker sends back):
    the new JSON-able state, the observation, and the reward when the step ended the
    episode (None while it goes on)."""

    state: dict
    observation_ids: list[int]
    reward: float | None

    def to_json(self) -> dict:
        return {"state": self.state, "observation_ids": self.observation_ids, "reward": self.reward}

    @classmethod
    def from_json(cls, data: dict) -> StepOutcome:
        reward = data["reward"]
        return cls(dict(data["state"]), [int(t) for t in data["observation_ids"]],
                   None if reward is None else float(reward))


def step_environment(env: Environment, state: dict, reply_ids: Sequence[int], *, last: bool) -> StepOutcome:
    """Step `env` on a reply and, when that ends the episode (the environment says done,
    or `last`: the episode's last allowed turn), score it: in the driver or on an
    environment worker, the same rule."""
    reply, new_state = env.step(state, list(reply_ids))
    if reply.done or last:
        return StepOutcome(new_state, [], float(env.score(new_state)))
    return StepOutcome(new_state, [int(t) for t in reply.observation_ids], None)


def play_episodes(engine: GenerationEngine, env: Environment, episodes: Sequence[Episode], params: SamplingParams) -> None:
    """Play episodes to the end outside the pump (benchmarks, a trainer's own loop): every
    episode streams on its own, its next turn submitted as soon as its last one is
    absorbed. The rollout pump runs the same steps interleaved with its commits."""
    from concurrent.futures import FIRST_COMPLETED, wait

    running = {engine.submit(e.request(env, params)): e for e in episodes if not e.done}
    while running:
        done, _ = wait(list(running), return_when=FIRST_COMPLETED)
        for future in done:
            episode = running.pop(future)
            episode.absorb(env, future.result())
            if not episode.done:
                running[engine.submit(episode.request(env, params))] = episode
