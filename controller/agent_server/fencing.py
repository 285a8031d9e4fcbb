"""Side effects fenced: every turn's idempotency key, the fencing rule, and the tools an
agent server calls with them (docs/agent_server.md#tools-with-effects-outside-the-episode).

A turn that was running at a stop is played again after a resume. A tool whose effect
lies outside the episode (a file written, a request sent) would then act twice; the
turn's idempotency key `<episode>/t<turn>` is the same for every attempt of an episode,
so a tool that records the keys it acted on acts at most once per turn.

The fencing rule: a server remembers per episode the newest attempt it has registered
(`POST /episodes`, `POST /agents/install`); a `POST /episodes` of an older attempt is
refused with 409, and a running episode of an older attempt stops before its next turn
(and before the tool of the turn it is in). `POST /reset` forgets the map: a resumed
controller resets its servers first, then registers attempts newer than any before its
stop (attempts only grow within a job).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutdb.controller.agent_server.wire import HttpError, bad, want, want_int

_ATTEMPT_SUFFIX = re.compile(r"(.+)-a(0|[1-9][0-9]*)")
MAX_ATTEMPT = 2**31 - 1


@dataclass(frozen=True)
class TurnContext:
    """What a tool learns about the turn it acts in. `idempotency_key` is the same for
    every attempt that plays this turn of this episode: key an external effect by it.
    `attempt` is the fencing token: a larger one has replaced a smaller one."""

    episode: str
    attempt: int
    turn: int
    key: str  # the attempt's episode key, e.g. "12.3-a1"

    @property
    def idempotency_key(self) -> str:
        return turn_key(self.episode, self.turn)


# A tool: called once per turn the agent plays, after the policy's reply and before the
# environment steps on it, with that reply's token ids.
Tool = Callable[[TurnContext, list[int]], None]


def turn_key(episode: str, turn: int) -> str:
    """The idempotency key of a turn: no attempt in it, so a replay carries the same."""
    return f"{episode}/t{turn}"


def identity_of(key: str) -> tuple[str, int]:
    """`(episode, attempt)` a key names: `12.3-a1` -> ("12.3", 1); a key without the
    `-a<N>` suffix is its own episode, attempt 0."""
    m = _ATTEMPT_SUFFIX.fullmatch(key)
    return (m.group(1), int(m.group(2))) if m else (key, 0)


def identity(key: str) -> dict[str, Any]:
    """The `episode` and `attempt` fields a client sends with `POST /episodes`."""
    episode, attempt = identity_of(key)
    return {"episode": episode, "attempt": attempt}


def requested_identity(body: Mapping[str, Any], key: str) -> tuple[str, int]:
    """`episode` and `attempt` of a `POST /episodes` body; an old controller sends
    neither and they come from the key. Fields that contradict the key are refused."""
    derived = identity_of(key)
    episode = want(body, "episode", str, derived[0])
    attempt = want_int(body, "attempt", 0, MAX_ATTEMPT, derived[1])
    if (episode, attempt) != derived:
        raise bad(f"fields 'episode' {episode[:40]!r} and 'attempt' {attempt} contradict key {key!r} "
                  f"(it names episode {derived[0]!r}, attempt {derived[1]}); send the key's own")
    return episode, attempt


class StaleAttempt(HttpError):
    """The fencing rule refused an attempt (409)."""


class Fence:
    """The newest attempt registered per episode."""

    def __init__(self) -> None:
        self.newest: dict[str, int] = {}

    def check(self, episode: str, attempt: int) -> None:
        """Refuse (409) an attempt older than the newest registered for its episode."""
        newest = self.newest.get(episode, -1)
        if attempt < newest:
            raise StaleAttempt(409, f"stale attempt {attempt} of episode {episode}: attempt {newest} has been "
                                    "seen; a newer attempt replaced it (docs/agent_server.md#fencing)")

    def register(self, episode: str, attempt: int) -> None:
        self.newest[episode] = max(attempt, self.newest.get(episode, -1))

    def forget(self) -> None:
        self.newest.clear()


def load_tool(spec: str) -> Tool:
    """`--tool FILE:FUNCTION`: the function named in a Python file."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name.isidentifier():
        raise ValueError(f"--tool {spec!r}: give FILE:FUNCTION (a Python file ending in .py and a function in it)")
    module_spec = importlib.util.spec_from_file_location(f"rolloutdb_tool_{Path(path).stem}", path)
    if module_spec is None or module_spec.loader is None or not Path(path).is_file():
        raise ValueError(f"--tool {spec!r}: no Python file {path}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    tool = getattr(module, name, None)
    if not callable(tool):
        raise ValueError(f"--tool {spec!r}: {path} has no function {name}")
    return tool
