"""Writes prompts.jsonl: 200 arithmetic word problems whose answer is one integer.

    python examples/custom_task/make_prompts.py        # rewrites prompts.jsonl beside it

Deterministic (a fixed seed), so the committed file is what this script writes; a test
checks that. Each record: {"id", "prompt", "answer", "kind"}. The prompts use only
ASCII letters, digits and ".?:" so the tiny CPU policy's tokenizer spells every one,
and stay under 100 characters so a prompt and a short reply fit its 256-token context.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ann", "Ben", "Cleo", "Dev", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jo"]
ITEMS = ["apple", "pen", "card", "shell", "coin", "book", "cup", "kite"]
COUNT = 200
SEED = 17


def problem(rng: random.Random) -> tuple[str, int, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(["add", "subtract", "multiply", "divide"])
    if kind == "add":
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        return f"{name} has {a} {item}s and gets {b} more. How many {item}s now? Answer:", a + b, kind
    if kind == "subtract":
        a = rng.randint(5, 60)
        b = rng.randint(1, a - 1)
        return f"{name} had {a} {item}s and gave away {b}. How many are left? Answer:", a - b, kind
    if kind == "multiply":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"{name} packs {a} boxes of {b} {item}s. How many {item}s in all? Answer:", a * b, kind
    each, friends = rng.randint(2, 9), rng.randint(2, 6)
    return (f"{name} shares {each * friends} {item}s equally among {friends} friends. How many each? Answer:",
            each, kind)


def records(count: int = COUNT, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt, answer, kind = problem(rng)
        out.append({"id": i, "prompt": prompt, "answer": answer, "kind": kind})
    return out


def render(count: int = COUNT, seed: int = SEED) -> str:
    return "".join(json.dumps(r) + "\n" for r in records(count, seed))


if __name__ == "__main__":
    out = Path(__file__).resolve().parent / "prompts.jsonl"
    out.write_text(render(), encoding="utf-8")
    print(f"wrote {COUNT} problems to {out}")
