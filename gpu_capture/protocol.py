"""The generation-engine seam. The controller talks to any engine (the CPU reference
engine on torch, vLLM) only through `GenerationEngine`.

Calls stream: `submit(request)` hands the engine one call and returns at once with a
`concurrent.futures.Future` that completes when that call finishes (or is aborted). The
engine batches internally and continuously: a submitted call joins the running batch at
the next decode step and leaves it when it finishes, so one slow call never holds the
others. Why a submit-and-future seam rather than `async def generate`:

* the controller is threads (see controller/job/controller.py: the engine and the trainer are
  blocking torch code), and a future is the thread-side form of a coroutine: a pump waits
  on many with `concurrent.futures.wait(..., FIRST_COMPLETED)` and a timeout (its commit
  window), with no event loop of its own;
* vLLM's `AsyncLLM.generate(prompt, params, request_id)` is an async generator that an
  engine adapter drives on its own loop; `asyncio.run_coroutine_threadsafe(...)` returns
  exactly a `concurrent.futures.Future`, so the vLLM backend implements `submit` in a few
  lines, and `abort(request_ids)` maps onto `AsyncLLM.abort`;
* a future carries an exception as well as a result: a broken call fails its own future,
  not the pump.

`generate_all(engine, requests)` is the blocking convenience: submit every request, wait
for all.

Prefix recovery needs two things from an engine beyond generating: to report the tokens
each running call has decoded since a given offset, consistent with its output step
(`PrefixCapture.running_calls`), and to continue a call from such a prefix exactly as if
it had never stopped (`GenerationRequest.prefix_ids`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rolloutdb import sampling_limits as limits


class WorkerLost(RuntimeError):
    """A remote piece of work (a model call, an environment step) failed because the
    worker process running it is gone, not because of the work: the pool behind it
    replaces the worker, so the controller abandons the attempt with reason `error` and
    starts it again. Any other exception from such a future is the work's own error and
    fails the run. One base for every kind of worker, so the rollout pump has one rule."""


class EngineWorkerLost(WorkerLost):
    """A call's future fails with this when the worker process that ran it is gone (a
    Ray engine worker killed or crashed): the call did not finish and never will, but the
    engine lives on (the pool replaces the worker)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings. `seed` makes a call reproducible on its own, whatever
    else is in the batch; `stop` strings end the call when they appear in its text."""

    max_tokens: int
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass(frozen=True)
class GenerationRequest:
    """One model call. `prefix_ids` are output tokens an earlier attempt of this same
    call already decoded (saved at a cut); the engine continues after them, and counts
    them as output for limits, penalties and stop strings."""

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    prefix_ids: Sequence[int] = ()
    prefix_versions: Sequence[int] = ()  # policy version of each prefix token
    # Logprob of each prefix token as reported when it was decoded; empty means the
    # engine recomputes them under its current weights.
    prefix_logprobs: Sequence[float] = ()
    # The sampler that decoded the prefix (`PrefixCapture.sampler_identity`, saved with
    # its chunks); None: unknown or more than one. Only an engine of the same identity
    # may report the continuation bitwise (`sampler_change`).
    prefix_sampler: str | None = None


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]  # the whole output, prefix included
    logprobs: list[float]  # log-probability of each output token under its policy
    token_versions: list[int]  # policy version that produced each output token
    finish_reason: str  # "stop" (stop string or EOS), "length", or "abort"
    text: str = ""
    extra: dict = field(default_factory=dict)


@runtime_checkable
class GenerationEngine(Protocol):
    """What the controller needs from an inference engine."""

    @property
    def policy_version(self) -> int:
        """Version of the weights the engine generates with now."""
        ...

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Start one call and return at once. The future completes with the call's
        result when it finishes (finish_reason "abort" when aborted or when the engine
        closes) and fails with the engine's error if its step broke. A request id must
        be unique among the calls in progress; a bad request raises ValueError here,
        before anything is queued."""
        ...

    def load_weights(self, state_dict: Mapping[str, object], version: int) -> None:
        """Refit: install new policy weights; tokens decoded from now on carry
        `version`. Calls in progress continue under the new weights."""
        ...

    def running_tokens(self) -> dict[str, list[int]]:
        """request id -> output tokens decoded so far, for every call in progress, read
        atomically with respect to the engine's output step."""
        ...

    def abort(self, request_ids: Sequence[str]) -> None:
        """End these calls at their next step with finish_reason "abort"."""
        ...


@dataclass(frozen=True)
class RunningCall:
    """A call in progress as a prefix cut sees it: its output from position `start` on
    (prefix included: position 0 is the first output token), with the logprob and the
    policy version of each token. `start` is 0 for the whole output, or the offset the
    reader asked for (`running_calls(since=...)`): the tokens before it were reported
    by an earlier read and never change (a call's output only grows). `logprobs` is
    shorter than `token_ids` only for a resumed call still waiting for its prefill
    without saved prefix logprobs (the engine recomputes them then)."""

    token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    max_tokens: int  # the limits the call was submitted with
    min_tokens: int
    # The engine's `cut_support` verdict on the call: None, or why a cut of it could not
    # be continued exactly (the snapshot then saves no prefix of it and traces why).
    cut_refused: str | None = None
    start: int = 0
    # What decoded every token of the call (`GenerationEngine.sampler_identity`), saved
    # with its chunks; None when more than one did (a prefix decoded by another sampler
    # and continued here) or it is unknown: such a call never continues bitwise.
    sampler: str | None = None

    @property
    def end(self) -> int:
        """How many output tokens the call had at the read: `start` + the tokens here."""
        return self.start + len(self.token_ids)


def sampler_change(request: GenerationRequest, identity: str) -> str | None:
    """None when `request` has no prefix or its prefix was decoded by the sampler
    `identity` names; otherwise why a continuation of it on this engine cannot be
    bitwise-exact (the uninterrupted call's draws came from another sampler, or from
    one nobody recorded), as the fallback reason an engine asked for bitwise gives.
    A continuation is still distribution-exact: any engine samples from the policy. The
    one rule every engine applies (reference_engine.py, vllm_engine.py, ray_workers.py)."""
    if not request.prefix_ids or request.prefix_sampler == identity:
        return None
    was = request.prefix_sampler or "an unrecorded sampler (saved before revision v1_10_a, or by more than one)"
    return f"engine_changed_not_bitwise: the prefix was decoded by {was}, this engine is {identity}"


def tail_offset(since: Mapping[str, int] | None, request_id: str, length: int) -> int:
    """Where an engine's answer to `running_calls(since)` starts for a call of `length`
    output tokens: the offset asked for, or 0 (the whole output) when none was asked or
    it lies past the call's end (an offset of another call of the same id, a call that
    was restarted). Shared by the engines, so they answer the same way."""
    offset = since.get(request_id, 0) if since else 0
    return offset if 0 <= offset <= length else 0


@runtime_checkable
class PrefixCapture(Protocol):
    """Beside `GenerationEngine`: an engine whose running calls can be cut and resumed
    (prefix-level recovery). `submit` takes `GenerationRequest.prefix_*` and continues
    the call from them exactly."""

    @property
    def decoded_rows(self) -> int:
        """Tokens decoded since the engine started: a snapshot that sees the same count
        and the same store state has nothing new to save."""
        ...

    @property
    def cut_hold_s(self) -> float:
        """How long the last `running_calls` held the output step (not counting its own
        wait for the step in progress)."""
        ...

    def running_calls(self, since: Mapping[str, int] | None = None) -> dict[str, RunningCall]:
        """request id -> the call's output so far, for every call in progress, as of one
        point between two output steps. `since` (request id -> offset) asks for a
        call's tokens from that offset on only (`RunningCall.start`); a call it does not
        name, or whose offset lies past its end (`tail_offset`), is answered whole, so
        `running_calls()` is everything (restore paths, tests).

        Cost: the output step waits only for what is O(calls) (each call's length and a
        reference to its append-only lists, or the positions past the offset); copying
        the tokens is O(tokens since the offsets) and may happen after the step goes on.
        A prefix cut asks with the offsets its snapshots already saved, so its cost is
        the tokens decoded since the last published cut, not since the call began."""
        ...

    @property
    def sampler_identity(self) -> str:
        """What decodes here, as `engine/version/scheme` (e.g. `vllm/0.32.0/v1-per-request-generator`):
        saved with every chunk of a call's prefix (`RunningCall.sampler`), so that a
        continuation on another engine, version or sampling scheme is never reported
        bitwise-exact (`sampler_change`)."""
        ...

    def cut_support(self, request: GenerationRequest) -> str | None:
        """Whether this call, cut at any point, can be continued exactly: None if so,
        else why not, in a few words for the trace (e.g. "seeded sampling on vLLM 0.32").
        Asked once per call, when it is submitted. The verdict is a function of the
        call's SamplingParams only, and of whether the call is seeded, not of the seed's
        value (nor of its prompt, prefix or id): an engine pool may answer from a cache
        keyed so (`RayEnginePool.cut_support`, which would otherwise ask a remote worker
        at every submit; the seed differs in every call of a run, `call_seed`).
        `running_calls` reports the verdict as `RunningCall.cut_refused`; the controller
        saves no prefix of a refused call: after a stop it restarts its turn (the turn
        path), and the trace's `call_fallback` says why."""
        ...


def generate_all(engine: GenerationEngine, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Submit every request, then wait for all: one result per request, in order. The
    requests are checked (distinct ids) before any is submitted."""
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids in one batch must be distinct")
    futures = [engine.submit(r) for r in requests]
    return [f.result() for f in futures]


def check_request(request: GenerationRequest, vocab_size: int, max_model_len: int) -> None:
    """Refuse a request no engine can run, before anything is queued: one ValueError
    naming every problem (shared by every engine, so they refuse the same requests)."""
    p = request.params
    prefix, prompt = list(request.prefix_ids), list(request.prompt_ids)
    problems = []
    if not prompt:
        problems.append("prompt_ids is empty")
    if any(not 0 <= t < vocab_size for t in prompt + prefix):
        problems.append(f"token ids must be in [0, {vocab_size})")
    # The config's and the policy endpoint's bounds: rolloutdb/sampling_limits.py.
    problems += [f"{name} {problem}" for name, problem in limits.sampling_problems(
        temperature=p.temperature, top_p=p.top_p, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, max_tokens=p.max_tokens, min_tokens=p.min_tokens)]
    if any(not s for s in p.stop):
        problems.append("stop strings must be non-empty")
    if len(prompt) + len(prefix) > max_model_len:
        problems.append(f"prompt + prefix is longer than max_model_len {max_model_len}")
    if len(request.prefix_versions) != len(prefix):
        problems.append("prefix_versions must give one version per prefix token")
    if request.prefix_logprobs and len(request.prefix_logprobs) != len(prefix):
        problems.append("prefix_logprobs must be empty or give one logprob per prefix token")
    if problems:
        raise ValueError(f"request {request.request_id!r}: " + "; ".join(problems))
