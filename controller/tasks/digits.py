"""The embedded verifiable task: digit strings, scored by code, per character.

A prompt is a short string of digits followed by a colon ("3071:"); the answer is a
transformation of those digits ("copy": "3071", "successor": each digit plus one mod 10,
"4182"; "reverse": "1703"). The reward is partial credit: the fraction of the target's
characters that the reply has at the right position, with a small bonus for stopping at
the right length. Partial credit is what makes GRPO work from a random policy: a random
reply already hits some digits, so a group of replies has rewards that differ, and the
group-normalized advantage has something to push on from the first step.

Two environments implement `rolloutdb.controller.protocols.Environment`:
- `SingleTurnDigitEnv`: one prompt, one reply, one score.
- `MultiTurnDigitEnv`: after each reply the environment says how it went ("ok"/"no") and
  poses the next sub-problem, for `turns` turns; the reward is the mean over the turns.
  Its episode state is a JSON-able dict, so an episode can be exported at a cut and
  resumed with an identical final reward.

The long-tail variant (`task: digits_longtail`) is the workload on which a streaming
rollout pump pays off: the same task, but each prompt's (and, multi-turn, each
sub-problem's) target length L is drawn from a truncated discrete power law on
1..max_digits,

    P(L >= k) = (k^-alpha - (max_digits + 1)^-alpha) / (1 - (max_digits + 1)^-alpha),

the tail of P(X >= k) = k^-alpha conditioned on X <= max_digits. With the defaults
(max_digits 96, alpha 1.2) 57% of the targets are one digit long, the mean is 3.2
digits, 1.2% ask for 32 or more and 0.27% for 64 or more: reply lengths like a real
model's, most short and a few very long. Why a power law: a lockstep batch lasts as
long as its longest reply, and under a power law that reply stays far from the mean as
the batch grows. Computed from the formula (a group shares its prompt, so a batch of G
groups holds G lengths): the longest of 8 averages 12.5 digits, of 32 27.6, so a
32-group wave does useful work in about 3.2 / 27.6 = 12% of its row-steps; a geometric
tail with the same mean gives 11.3 and 28%, too mild to show what streaming buys.

A random policy cannot know L, so `LongTailSingleTurnEnv` and `LongTailMultiTurnEnv`
also implement `ReplyLimits`: each reply decodes exactly L tokens (end of sequence
masked) and may then end or add one more, (min, max) = (L, L + 1). The reply's length is
the task's, not the policy's, which is what makes the workload's tail a property of the
prompts. L is a pure function of (dataset seed, prompt index, part), like the digits.

The environments need a text codec (encode/decode); any Hugging Face tokenizer works, or
anything with the same two methods.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import random
from collections.abc import Sequence
from typing import Any, Protocol

from rolloutdb.config import TASK_KINDS
from rolloutdb.controller.protocols import Turn

DIGITS = "0123456789"
# Every character the task's prompts, answers and feedback use: a tokenizer over just
# these gives a random policy a 10-in-~20 chance of a digit instead of 10-in-~90.
TASK_ALPHABET = DIGITS + ": \nokn"
# Share of the reward for a reply whose length equals the target's (teaches stopping).
LENGTH_BONUS = 0.2


class DigitPrompts(Protocol):
    """What the digit environments read from a dataset: `DigitPromptDataset` or
    `LongTailDigitDataset`."""

    def digits(self, index: int, part: int = 0) -> str: ...

    def __getitem__(self, index: int) -> str: ...


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFCodec:
    """Adapts a Hugging Face tokenizer: no special tokens added on encode; on decode the
    reply ends at its first EOS. Other special tokens keep their text (e.g. "<s>"), so a
    policy cannot game the per-character score by padding its reply with tokens that
    decode to nothing."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if self.eos_token_id is not None and self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def as_codec(tokenizer: Any) -> TextCodec:
    """A codec for a tokenizer: HF tokenizers are wrapped, codecs pass through."""
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return HFCodec(tokenizer)
    return tokenizer


# ---------------------------------------------------------------------------- the task


def target_for(kind: str, digits: str) -> str:
    """The correct answer to a prompt of this kind."""
    if kind == "copy":
        return digits
    if kind == "successor":
        return "".join(DIGITS[(int(c) + 1) % 10] for c in digits)
    if kind == "reverse":
        return digits[::-1]
    raise ValueError(f"unknown task kind {kind!r}; choose one of {', '.join(TASK_KINDS)}")


def score_reply(reply: str, target: str) -> float:
    """Partial credit in [0, 1]: (1 - LENGTH_BONUS) x the fraction of target characters
    matched position by position, + LENGTH_BONUS if the reply (stripped of surrounding
    whitespace) has exactly the target's length."""
    text = reply.strip()
    if not target:
        raise ValueError("empty target")
    hits = sum(1 for a, b in zip(text, target) if a == b)
    exact_length = 1.0 if len(text) == len(target) else 0.0
    # Rounded so a perfect reply scores exactly 1.0 (0.8 + 0.2 is 1.0000000000000002).
    return round((1.0 - LENGTH_BONUS) * hits / len(target) + LENGTH_BONUS * exact_length, 12)


def prompt_text(digits: str) -> str:
    return f"{digits}:"


# ------------------------------------------------------------------------- the dataset


@functools.lru_cache(maxsize=1 << 16)
def _drawn_digits(seed: int, index: int, part: int, n_digits: int) -> str:
    # Every generation of a group starts its episode from the prompt, so each is asked for
    # group_size times in a row; seeding a Random from a string (a SHA-512) and drawing
    # took ~13 us of the pump's ~55 us of CPU per call (bench_group_commit's profile).
    rng = random.Random(f"digits:{seed}:{index}:{part}")
    return "".join(rng.choice(DIGITS) for _ in range(n_digits))


class DigitPromptDataset:
    """`size` prompts of `n_digits` random digits each, generated from (seed, index) so
    any index is available without materializing the others and the same parameters
    always give the same prompts. Implements `PromptDataset`."""

    def __init__(self, size: int = 4096, n_digits: int = 3, seed: int = 0):
        if size < 1 or n_digits < 1:
            raise ValueError("size and n_digits must be >= 1")
        self.size = size
        self.n_digits = n_digits
        self.seed = seed

    def __len__(self) -> int:
        return self.size

    def digits(self, index: int, part: int = 0) -> str:
        """The digits of prompt `index`; `part` > 0 gives the follow-up sub-problems the
        multi-turn environment poses (also a pure function of the index)."""
        if not 0 <= index < self.size:
            raise IndexError(f"prompt index {index} out of range 0..{self.size - 1}")
        return _drawn_digits(self.seed, index, part, self.n_digits)

    def __getitem__(self, index: int) -> str:
        return self.digits(index)

    def fingerprint(self) -> str:
        """sha256 over the parameters and every prompt: a resume against different
        prompts is refused even if someone changes how digits are drawn."""
        h = hashlib.sha256(
            json.dumps({"dataset": "digits", "size": self.size, "n_digits": self.n_digits,
                        "seed": self.seed}, sort_keys=True).encode())
        for i in range(self.size):
            h.update(self.digits(i).encode())
        return h.hexdigest()


# --------------------------------------------------------------------- the environments


class SingleTurnDigitEnv:
    """One reply per episode. State: {"prompt_id", "target", "reply", "done"}."""

    def __init__(self, dataset: DigitPrompts, tokenizer: Any, kind: str = "copy"):
        target_for(kind, "0")  # refuse an unknown kind now, not at the first episode
        self.dataset = dataset
        self.codec = as_codec(tokenizer)
        self.kind = kind
        self.max_turns = 1

    def start(self, prompt_id: int) -> tuple[list[int], dict]:
        digits = self.dataset[prompt_id]
        state = {"prompt_id": prompt_id, "target": target_for(self.kind, digits),
                 "reply": None, "done": False}
        return self.codec.encode(prompt_text(digits)), state

    def step(self, state: dict, reply_ids: Sequence[int]) -> tuple[Turn, dict]:
        if state["done"]:
            raise ValueError("episode already finished")
        reply = self.codec.decode(reply_ids)
        new = dict(state, reply=reply, done=True)
        return Turn(observation_ids=[], done=True,
                    info={"score": score_reply(reply, state["target"])}), new

    def score(self, state: dict) -> float:
        if state["reply"] is None:
            return 0.0
        return score_reply(state["reply"], state["target"])


class MultiTurnDigitEnv:
    """`turns` sub-problems in one conversation. After each reply the environment
    answers " ok\\n" or " no\\n" (right or wrong as a whole) followed by the next
    sub-problem's prompt; the policy sees the whole history. Reward: the mean per-turn
    score, unanswered turns counting zero. State (JSON-able): {"prompt_id", "turn",
    "targets", "scores", "done"}; each sub-problem is a pure function of (prompt id,
    turn), so the state need not carry the prompts themselves."""

    def __init__(self, dataset: DigitPrompts, tokenizer: Any, kind: str = "copy",
                 turns: int = 3):
        target_for(kind, "0")
        if turns < 1:
            raise ValueError("turns must be >= 1")
        self.dataset = dataset
        self.codec = as_codec(tokenizer)
        self.kind = kind
        self.max_turns = turns

    def _target(self, prompt_id: int, turn: int) -> str:
        return target_for(self.kind, self.dataset.digits(prompt_id, part=turn))

    def start(self, prompt_id: int) -> tuple[list[int], dict]:
        digits = self.dataset.digits(prompt_id, part=0)
        state = {"prompt_id": prompt_id, "turn": 0, "targets": [self._target(prompt_id, 0)],
                 "scores": [], "done": False}
        return self.codec.encode(prompt_text(digits)), state

    def step(self, state: dict, reply_ids: Sequence[int]) -> tuple[Turn, dict]:
        if state["done"]:
            raise ValueError("episode already finished")
        turn = state["turn"]
        reply = self.codec.decode(reply_ids)
        turn_score = score_reply(reply, state["targets"][turn])
        scores = [*state["scores"], turn_score]
        verdict = " ok\n" if reply.strip() == state["targets"][turn] else " no\n"
        if turn + 1 >= self.max_turns:
            new = dict(state, scores=scores, done=True)
            return Turn(observation_ids=[], done=True, info={"score": turn_score}), new
        next_digits = self.dataset.digits(state["prompt_id"], part=turn + 1)
        new = dict(state, turn=turn + 1, scores=scores, done=False,
                   targets=[*state["targets"], self._target(state["prompt_id"], turn + 1)])
        observation = self.codec.encode(verdict + prompt_text(next_digits))
        return Turn(observation_ids=observation, done=False, info={"score": turn_score}), new

    def score(self, state: dict) -> float:
        return sum(state["scores"]) / self.max_turns


# ------------------------------------------------------------------ the long-tail task

LONGTAIL_MAX_DIGITS = 96  # default longest target; docs/config.md, environment.max_digits
LONGTAIL_ALPHA = 1.2  # default tail exponent; docs/config.md, environment.tail_alpha


def longtail_survival(max_digits: int, alpha: float) -> list[float]:
    """[P(L >= k) for k = 1..max_digits] of the truncated power law (module docstring):
    1.0 first, decreasing, P(L >= max_digits) > 0."""
    if max_digits < 1 or not alpha > 0:
        raise ValueError("max_digits must be >= 1 and tail_alpha > 0")
    cut = (max_digits + 1) ** -alpha
    return [(k ** -alpha - cut) / (1.0 - cut) for k in range(1, max_digits + 1)]


class LongTailDigitDataset:
    """`size` prompts whose lengths follow the truncated power law on 1..max_digits.
    Prompt (index, part) draws u ~ U[0, 1) and then its digits from one generator seeded
    by (seed, index, part): L = the number of k with P(L >= k) > u (inverse transform
    sampling on the survival function). Implements `PromptDataset`; offers `digits` like
    `DigitPromptDataset`, so the digit environments run on it unchanged."""

    def __init__(self, size: int = 4096, max_digits: int = LONGTAIL_MAX_DIGITS, tail_alpha: float = LONGTAIL_ALPHA,
                 seed: int = 0):
        if size < 1:
            raise ValueError("size must be >= 1")
        self.size = size
        self.max_digits = max_digits
        self.tail_alpha = tail_alpha
        self.seed = seed
        # Ascending for bisect: P(L >= max_digits), ..., P(L >= 1) = 1.
        self._ascending = longtail_survival(max_digits, tail_alpha)[::-1]

    def __len__(self) -> int:
        return self.size

    def _rng(self, index: int, part: int) -> random.Random:
        if not 0 <= index < self.size:
            raise IndexError(f"prompt index {index} out of range 0..{self.size - 1}")
        return random.Random(f"digits_longtail:{self.seed}:{index}:{part}")

    def _draw_length(self, rng: random.Random) -> int:
        u = rng.random()
        # k with P(L >= k) > u: the entries of the ascending list right of u.
        return max(1, len(self._ascending) - bisect.bisect_right(self._ascending, u))

    def length(self, index: int, part: int = 0) -> int:
        """The target length L of prompt `index`, sub-problem `part`."""
        return self._draw_length(self._rng(index, part))

    def digits(self, index: int, part: int = 0) -> str:
        """The digits of prompt `index` (`part` > 0: the multi-turn follow-ups)."""
        rng = self._rng(index, part)
        n = self._draw_length(rng)
        return "".join(rng.choice(DIGITS) for _ in range(n))

    def __getitem__(self, index: int) -> str:
        return self.digits(index)

    def fingerprint(self) -> str:
        """sha256 over the parameters and every prompt (as `DigitPromptDataset`)."""
        h = hashlib.sha256(
            json.dumps({"dataset": "digits_longtail", "size": self.size, "max_digits": self.max_digits,
                        "tail_alpha": self.tail_alpha, "seed": self.seed}, sort_keys=True).encode())
        for i in range(self.size):
            h.update(self.digits(i).encode())
        return h.hexdigest()


class LongTailSingleTurnEnv(SingleTurnDigitEnv):
    """`SingleTurnDigitEnv` on long-tail prompts; each reply is L or L + 1 tokens."""

    def reply_limits(self, state: dict) -> tuple[int, int]:
        n = len(state["target"])  # every task kind keeps the digits' length
        return n, n + 1


class LongTailMultiTurnEnv(MultiTurnDigitEnv):
    """`MultiTurnDigitEnv` on long-tail prompts; each sub-problem draws its own L, and
    each reply is L or L + 1 tokens of the current sub-problem."""

    def reply_limits(self, state: dict) -> tuple[int, int]:
        n = len(state["targets"][state["turn"]])
        return n, n + 1

