"""The built-in `digits` task (kind `copy`, several turns) for the minimal server, in the
standard library: the same prompts, observations and reward the controller's own
`MultiTurnDigitEnv` gives (docs/config.md, `environment.task`), so a run trains on the
conversation the server played.

Prompt `p`, turn `t`: `n_digits` digits drawn by `random.Random(f"digits:{seed}:{p}:{t}")`,
written `"<digits>:"`; the reply is scored per character (0.8 x the share of positions
right + 0.2 when its length is right); the observation after a reply is `" ok\\n"` or
`" no\\n"` and the next turn's prompt; the reward is the mean turn score.

The token ids come from the run's policy tokenizer (`RUN_DIR/policy/tokenizer.json`, read
when the first episode starts: the controller writes it at its start). It must be the
byte-level tokenizer without merges that `rolloutdb train` builds for the digit tasks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DIGITS = "0123456789"
LENGTH_BONUS = 0.2


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte-level map: printable bytes stand for themselves, the rest move to 256+."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


class Tokenizer:
    def __init__(self, policy_dir: Path):
        data = json.loads((policy_dir / "tokenizer.json").read_text())
        if data["model"].get("merges"):
            raise ValueError(f"{policy_dir}/tokenizer.json has merges; this server encodes byte by byte only")
        self.ids = dict(data["model"]["vocab"])
        for added in data.get("added_tokens", []):
            self.ids[added["content"]] = added["id"]
        self.text = {i: t for t, i in self.ids.items()}
        eos = json.loads((policy_dir / "tokenizer_config.json").read_text()).get("eos_token")
        self.eos = self.ids.get(eos if isinstance(eos, str) else "<eos>")
        self.to_symbol = byte_symbols()
        self.to_byte = {s: b for b, s in self.to_symbol.items()}

    def encode(self, text: str) -> list[int]:
        return [self.ids[self.to_symbol[b]] for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        if self.eos in ids:
            ids = ids[: ids.index(self.eos)]
        out = bytearray()
        for i in ids:
            token = self.text.get(i, "")
            if all(ch in self.to_byte for ch in token):
                out += bytes(self.to_byte[ch] for ch in token)
            else:
                out += token.encode()  # a special token keeps its text ("<pad>")
        return out.decode(errors="replace")


def score_reply(reply: str, target: str) -> float:
    text = reply.strip()
    hits = sum(1 for a, b in zip(text, target) if a == b)
    return round((1.0 - LENGTH_BONUS) * hits / len(target) + LENGTH_BONUS * (len(text) == len(target)), 12)


class DigitsCopyTask:
    def __init__(self, policy_dir: Path, *, turns: int, n_digits: int, seed: int):
        self.policy_dir, self.turns, self.n_digits, self.seed = policy_dir, turns, n_digits, seed
        self._tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.policy_dir)
        return self._tokenizer

    def digits(self, prompt_id: int, turn: int) -> str:
        rng = random.Random(f"digits:{self.seed}:{prompt_id}:{turn}")
        return "".join(rng.choice(DIGITS) for _ in range(self.n_digits))

    def new_state(self, prompt_id: int) -> dict:
        return {"scores": []}

    def valid_state(self, state: dict) -> bool:
        return isinstance(state.get("scores"), list)

    def prompt(self, prompt_id: int) -> list[int]:
        return self.tokenizer.encode(self.digits(prompt_id, 0) + ":")

    def tool(self, state: dict, prompt_id: int, turn: int, reply: list[int]) -> list[int]:
        text, target = self.tokenizer.decode(reply), self.digits(prompt_id, turn)
        state["scores"].append(score_reply(text, target))
        verdict = " ok\n" if text.strip() == target else " no\n"
        return self.tokenizer.encode(verdict + self.digits(prompt_id, turn + 1) + ":")

    def reward(self, state: dict) -> float:
        return sum(state["scores"]) / self.turns
