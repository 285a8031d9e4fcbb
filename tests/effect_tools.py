"""Toy tools with an effect outside the episode, for tests/test_agent_server_fencing.py:
an agent server loads one with `--tool tests/effect_tools.py:record_effect`. Not a test
module (no `test_` prefix): pytest does not collect it.

`record_effect` appends every play of a turn (its idempotency key and attempt) to the
file `$ROLLOUTDB_TEST_PLAYS`, and performs the turn's effect at most once: it appends the
key to `$ROLLOUTDB_TEST_EFFECTS` only when that file does not hold it yet, the way a tool
author deduplicates an external effect by the key (docs/agent_server.md).
"""

from __future__ import annotations

import os
from pathlib import Path


def record_effect(ctx, reply_ids: list[int]) -> None:
    with open(os.environ["ROLLOUTDB_TEST_PLAYS"], "a") as f:
        f.write(f"{ctx.idempotency_key} {ctx.attempt}\n")
    effects = Path(os.environ["ROLLOUTDB_TEST_EFFECTS"])
    done = effects.read_text().split() if effects.exists() else []
    if ctx.idempotency_key not in done:
        with open(effects, "a") as f:
            f.write(f"{ctx.idempotency_key}\n")
