"""The custom task's reward: reward(record, reply, token_ids) -> float.

The answer is the first integer in the reply (a regex). Exactly right scores 1.0; any
other number scores partial credit for being close (0.1 for answering with a number at
all, up to 0.5 more the closer it is), so that a group of replies from an untrained
policy already has rewards that differ and GRPO has something to push on.
"""

from __future__ import annotations

import re

ANSWER = re.compile(r"-?\d+")


def score(record: dict, reply: str, token_ids: list[int]) -> float:
    found = ANSWER.search(reply)
    if found is None:
        return 0.0
    guess, answer = int(found.group()), int(record["answer"])
    if guess == answer:
        return 1.0
    closeness = max(0.0, 1.0 - abs(guess - answer) / max(1, abs(answer)))
    return round(0.1 + 0.4 * closeness, 6)
