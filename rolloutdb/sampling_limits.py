"""The sampling parameters' bounds: one definition for the config (`rolloutdb/config.py`
`GenerationSection`), the policy endpoint (`controller/agent_server/wire.py`
`sampling_params`) and every engine (`gpu_capture/protocol.py` `check_request`), so the
three refuse the same values with the same words. Pure Python: the config imports it
without torch.

Each bound is where an engine's float32 arithmetic stays finite (`gpu_capture/sampling.py`):

* temperature: the logits are divided by it. A positive temperature below
  `MIN_TEMPERATURE` overflows them (1e-40 is a float32 subnormal: every logit became
  +-inf, softmax NaN, every token id 0 with logprob NaN, and the run trained on NaN to
  the end). 0 is greedy; vLLM clamps (0, 0.01) up to 0.01 for the same reason, so both
  engines see only 0 or [0.01, 100].
* penalties: subtracted from the logits once per occurrence; OpenAI's and vLLM's [-2, 2]
  times at most `MAX_TOKENS` occurrences stays far inside float32 (1e308 made them inf).
* top_p in (0, 1]; max_tokens 1..`MAX_TOKENS`; min_tokens 0..max_tokens; seed an int64.
"""

from __future__ import annotations

import math

MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0
MAX_TOKENS = 1_000_000
MAX_SEED = 2**63 - 1


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# Each check returns None or a phrase that starts with the value and ends with what to
# use; the caller puts the parameter's name in front the way its surface names it
# ("generation.temperature: ...", "field 'temperature': ...").


def temperature_problem(t: float) -> str | None:
    if not _finite(t) or t < 0 or t > MAX_TEMPERATURE:
        return f"{t!r} is outside [0, {MAX_TEMPERATURE:g}]; use 0 for greedy decoding, else up to {MAX_TEMPERATURE:g}"
    if 0 < t < MIN_TEMPERATURE:
        return (f"{t!r} is between 0 and {MIN_TEMPERATURE}: the logits divided by it can overflow float32 and make "
                f"every token NaN; use 0 for greedy decoding or at least {MIN_TEMPERATURE}")
    return None


def top_p_problem(p: float) -> str | None:
    if not _finite(p) or not 0 < p <= 1:
        return f"{p!r} is outside (0, 1]; use 1 to sample from the whole distribution"
    return None


def penalty_problem(value: float) -> str | None:
    if not _finite(value) or abs(value) > MAX_PENALTY:
        return (f"{value!r} is outside [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (the OpenAI / vLLM range: beyond it the "
                "logits leave float32); use 0 for no penalty")
    return None


def sampling_problems(*, temperature: float, top_p: float, presence_penalty: float, frequency_penalty: float,
                      max_tokens: int, min_tokens: int) -> list[tuple[str, str]]:
    """(parameter, problem) for every bound the values break."""
    found = [("temperature", temperature_problem(temperature)), ("top_p", top_p_problem(top_p)),
             ("presence_penalty", penalty_problem(presence_penalty)),
             ("frequency_penalty", penalty_problem(frequency_penalty))]
    if not 1 <= max_tokens <= MAX_TOKENS:
        found.append(("max_tokens", f"{max_tokens!r} is outside [1, {MAX_TOKENS}]"))
    elif not 0 <= min_tokens <= max_tokens:
        found.append(("min_tokens", f"{min_tokens!r} is outside [0, max_tokens {max_tokens}]"))
    return [(name, problem) for name, problem in found if problem]
