"""Payload encoding: fixed little-endian dtypes in BLOBs. Never pickle.

A reader in any language can decode a sample with ``numpy.frombuffer(blob, "<i4")``.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import Sequence

import numpy as np

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")


# Lists go through struct, arrays through numpy: packing a 2048-long Python list with
# struct takes 15 µs against 31-37 µs for np.asarray (the pump encodes every finished
# call's sample and, at turn level, every saved episode's whole transcript). Anything
# struct refuses (a value out of range) goes to numpy, whose error is the one raised.


def _pack(values: Sequence | np.ndarray, code: str, dtype: np.dtype) -> bytes:
    if isinstance(values, np.ndarray):
        return values.astype(dtype, copy=False).tobytes()
    try:
        return struct.pack(f"<{len(values)}{code}", *values)
    except (struct.error, OverflowError, TypeError):
        return np.asarray(values, dtype=dtype).tobytes()


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    return _pack(tokens, "i", TOKEN_DTYPE)


def decode_tokens(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype=TOKEN_DTYPE)


def encode_logprobs(values: Sequence[float] | np.ndarray) -> bytes:
    return _pack(values, "f", LOGPROB_DTYPE)


def decode_logprobs(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype=LOGPROB_DTYPE)


def encode_version_counts(runs: Sequence[tuple[int, int]]) -> str:
    """Tokens per policy version as JSON runs ``[[version, count], ...]``.

    Formatted directly (the text json.dumps with separators (",", ":") gives): json.dumps
    took 8 µs of a finished call's 20 µs of encoding, this takes 1 µs."""
    return "[" + ",".join([f"[{int(v)},{int(n)}]" for v, n in runs]) + "]"


def decode_version_counts(text: str) -> list[tuple[int, int]]:
    return [(int(v), int(n)) for v, n in json.loads(text)]


def version_runs(token_versions: Sequence[int]) -> list[tuple[int, int]]:
    """Collapse a per-token version list into runs: [3,3,4] -> [(3, 2), (4, 1)].

    groupby, not a Python loop over the tokens: turn-level recovery runs this on every
    saved episode's whole transcript in the commit batch (2048 tokens in runs of 24 and
    8: 43 µs against 200 µs for the loop; numpy is slower still below ~1k tokens, its
    conversion from a list dominating)."""
    if isinstance(token_versions, np.ndarray):  # groupby over numpy scalars: 8x slower
        if not token_versions.size:
            return []
        edges = np.concatenate(([0], np.flatnonzero(token_versions[1:] != token_versions[:-1]) + 1,
                                [token_versions.size]))
        return list(zip(token_versions[edges[:-1]].tolist(), np.diff(edges).tolist()))
    return [(int(v), len(list(run))) for v, run in itertools.groupby(token_versions)]
