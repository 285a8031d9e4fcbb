"""Payload encoding: fixed little-endian dtypes in BLOBs. Never pickle.

A reader in any language can decode a sample with ``numpy.frombuffer(blob, "<i4")``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(tokens, dtype=TOKEN_DTYPE).tobytes()


def decode_tokens(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype=TOKEN_DTYPE)


def encode_logprobs(values: Sequence[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=LOGPROB_DTYPE).tobytes()


def decode_logprobs(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype=LOGPROB_DTYPE)


def encode_version_counts(runs: Sequence[tuple[int, int]]) -> str:
    """Tokens per policy version as JSON runs ``[[version, count], ...]``."""
    return json.dumps([[int(v), int(n)] for v, n in runs], separators=(",", ":"))


def decode_version_counts(text: str) -> list[tuple[int, int]]:
    return [(int(v), int(n)) for v, n in json.loads(text)]


def version_runs(token_versions: Sequence[int]) -> list[tuple[int, int]]:
    """Collapse a per-token version list into runs: [3,3,4] -> [(3, 2), (4, 1)]."""
    runs: list[tuple[int, int]] = []
    for v in token_versions:
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1] + 1)
        else:
            runs.append((int(v), 1))
    return runs
