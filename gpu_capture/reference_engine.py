"""The CPU reference generation engine: real incremental decoding with a KV cache,
continuous batching, and calls that resume bit-exactly from a saved prefix.

One worker thread runs steps; a step holds the engine lock from the forward pass to the
last appended token, so `running_tokens`, `load_weights` and `abort` always see (and act)
between steps: a cut never sees half a step, and a refit never mixes two weight versions
inside one token. Callers of `generate` only enqueue and wait, so several controller
threads can share one engine and their calls are batched together.

Semantics (each is what the uninterrupted call would do, so a resumed call matches it):
* Output = prefix + new tokens. `max_tokens`, `min_tokens`, penalties and stop strings
  count the whole output, prefix included.
* `min_tokens`: the first `min_tokens` output tokens never end the call (EOS is masked
  and stop strings are not searched while fewer have been produced), as in vLLM.
* Stop strings are searched in the decoded text of the whole output; the call ends at
  the first occurrence that ends in the newest token's characters. `text` is truncated
  right after the stop string (the stop string is included); `token_ids` keep every
  decoded token (the last one completes the stop string). `extra["stop_reason"]` is the
  stop string, "eos", or None.
* EOS: the EOS token is kept as the last output token (it was sampled and has a
  logprob) and left out of `text`; finish_reason "stop". A stop wins over "length" when
  both happen on the same token.
* Sampling, seeds and reported logprobs: see `sampling.py`. Calls without a seed get one
  derived from the engine seed and the request id.
* `token_versions[i]` is the policy version of the weights that computed token i;
  prefix tokens keep `prefix_versions`. Prefix logprobs come from
  `GenerationRequest.prefix_logprobs`; when absent they are recomputed from the prefill
  under the current weights (bit-identical to the originals when those weights produced
  the prefix, thanks to the batch-invariant forward).
* A call whose prompt + output reaches the model length finishes with "length".
* Refit (`load_weights`) between two steps drops the K/V cache of the running calls; the
  next step re-prefills their prompt + output under the new weights. A call running
  across a refit therefore decodes exactly what the same call cut at the refit and
  resumed on the new weights decodes, and a later cut of it resumes exactly too. (vLLM
  keeps the stale K/V across an in-flight weight update, so there the tokens after a
  refit depend on the old weights through the cache; the versions are tagged the same.)
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .invariant_forward import InvariantDecoder
from .model_dirs import eos_token_ids, refit_tensors, tie_groups
from .protocol import GenerationRequest, GenerationResult, RunningCall, check_request, sampler_change, tail_offset
from .sampling import RowChoice, choose_tokens, find_stop, position_uniform, request_seed, token_logprobs
from .tiny_policy import load_policy


@dataclass(eq=False)
class _Call:
    request: GenerationRequest
    seed: int
    future: Future = field(default_factory=Future)
    tokens: list[int] = field(default_factory=list)  # the output so far, prefix included
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    counts: torch.Tensor | None = None  # token occurrences in the output (penalties only)
    text: str = ""  # decoded output so far (kept only when the call has stop strings)
    slot: int = -1
    cut_refused: str | None = None  # cut_support's verdict, asked once at submit
    sampler: str | None = None  # RunningCall.sampler: this engine's identity, or None (a foreign prefix)
    fallback: str | None = None  # why a prefix given was not continued (the call restarted)
    cached: int = 0  # how many tokens of prompt + output have K/V in the cache

    @property
    def sequence_length(self) -> int:
        return len(self.request.prompt_ids) + len(self.tokens)

    def sequence_tail(self) -> list[int]:
        """Tokens of prompt + output not yet in the cache, in order."""
        prompt = self.request.prompt_ids
        start = self.cached
        head = list(prompt[start:]) if start < len(prompt) else []
        return head + self.tokens[max(0, start - len(prompt)) :]


# The sampling scheme's identity (`PrefixCapture.sampler_identity`): bump the number when
# what a seed and a position draw changes (sampling.position_uniform, choose_tokens), so
# that a prefix saved before is never continued as bitwise.
SAMPLER_IDENTITY = "reference/1/seed-position"


class ReferenceEngine:
    """GenerationEngine on torch (CPU). See the module docstring for the semantics.

    `model` is a policy directory (see tiny_policy.py) or a (model, tokenizer) pair; the
    engine keeps its own copy of the weights, so training the passed model in place does
    not change what the engine generates until `load_weights` is called.
    `max_batch_size` calls decode at once (KV-cache slots); more wait in a queue.
    `num_threads` is set with torch.set_num_threads in the engine's worker thread (an
    OpenMP setting of that thread: the caller's own count is left alone); None keeps the
    constructing thread's count. Outputs were measured identical for 1 and 2 threads.
    `seed` seeds calls that set none (see sampling.request_seed). `max_prefill_rows`
    bounds the prompt rows admitted in one step (one call is always admitted).
    `linear_mode`: "auto" (probe, see invariant_forward), "tiled" or "reduce"."""

    def __init__(
        self,
        model: str | Path | tuple,
        *,
        max_batch_size: int = 32,
        device: str = "cpu",
        num_threads: int | None = None,
        seed: int = 0,
        policy_version: int = 0,
        max_model_len: int | None = None,
        max_prefill_rows: int = 256,
        linear_mode: str = "auto",
        prefix_exactness: str = "distribution",
    ) -> None:
        if isinstance(model, (str, Path)):
            hf_model, tokenizer = load_policy(model)
        else:
            hf_model, tokenizer = model
            hf_model = copy.deepcopy(hf_model)
        self.model = hf_model.to(device=device, dtype=torch.float32).eval()
        self.tokenizer = tokenizer
        generation_config = getattr(hf_model, "generation_config", None)
        self.eos_token_ids = eos_token_ids(hf_model.config.eos_token_id,
                                           getattr(generation_config, "eos_token_id", None))
        # The first EOS id: what a caller that needs one id (a test planting EOS) uses.
        self.eos_token_id = min(self.eos_token_ids) if self.eos_token_ids else None
        self.vocab_size = hf_model.config.vocab_size
        self.max_model_len = min(max_model_len or 10**9, hf_model.config.max_position_embeddings)
        self.max_batch_size = max_batch_size
        self.max_prefill_rows = max_prefill_rows
        self.num_threads = num_threads or torch.get_num_threads()
        self.seed = seed
        # "bitwise": a call whose prefix another sampler decoded restarts from scratch
        # (`sampler_change`); "distribution": it continues, reported distribution-exact.
        self.prefix_exactness = prefix_exactness
        self.device = torch.device(device)
        self._version = policy_version
        self._parameters = dict(self.model.named_parameters())  # a tied tensor once
        self._ties = tie_groups(self.model)
        self._forward = InvariantDecoder(
            self.model, num_slots=max_batch_size, max_len=self.max_model_len, linear_mode=linear_mode, device=device
        )
        self._free_slots = list(range(max_batch_size - 1, -1, -1))
        self._waiting: deque[_Call] = deque()
        self._active: list[_Call] = []
        self._abort_ids: set[str] = set()
        self._closed = False
        # The engine lock: held for a whole step and by every outside operation. Outside
        # callers announce themselves in _waiters so the worker yields between steps
        # instead of re-taking the lock forever (threading.Lock is not fair).
        self._cv = threading.Condition(threading.Lock())
        self._waiters = 0
        self._waiters_lock = threading.Lock()
        self.steps = 0  # forward passes run so far
        # Seconds the worker spent inside steps, and the calls each step decoded summed
        # over steps: the benchmarks' engine idle fraction and batch occupancy.
        self.busy_s = 0.0
        self.decoded_rows = 0
        self.cut_hold_s = 0.0  # how long the last running_calls() held the engine lock
        # Called by the worker after each step, outside the lock, with the step count:
        # lets tests (and tracing) act at an exact point between two steps.
        self.step_callback = None
        self._worker = threading.Thread(target=self._run, name="reference-engine", daemon=True)
        self._worker.start()

    # ---- GenerationEngine ---------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Queue one call; it joins the running batch at the next step (see the module
        docstring). Returns its future at once."""
        call = self._new_call(request)  # validated before anything is queued
        with self._exclusive():
            if self._closed:
                raise RuntimeError("engine is closed")
            rid = request.request_id
            if any(c.request.request_id == rid for c in (*self._waiting, *self._active)):
                raise ValueError(f"request id already running: {rid!r}")
            self._abort_ids.discard(rid)  # an abort never targets a future call
            self._waiting.append(call)
        return call.future

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Blocking convenience: submit every call (all checked first), wait for all."""
        calls = [self._new_call(r) for r in requests]  # validate everything before enqueuing
        ids = [c.request.request_id for c in calls]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids in one generate() call must be distinct")
        with self._exclusive():
            if self._closed:
                raise RuntimeError("engine is closed")
            running = {c.request.request_id for c in (*self._waiting, *self._active)}
            clash = running.intersection(ids)
            if clash:
                raise ValueError(f"request ids already running: {sorted(clash)}")
            self._abort_ids.difference_update(ids)
            self._waiting.extend(calls)
        return [c.future.result() for c in calls]

    def load_weights(self, state_dict: Mapping[str, object], version: int) -> None:
        """Install a full state dict (the HF parameter names) between two steps; tokens
        decoded afterwards carry `version`; a tied tensor may come under any of its names
        (`model_dirs.refit_tensors`). Checked before anything is changed."""
        shapes = {name: tuple(p.shape) for name, p in self._parameters.items()}
        tensors = refit_tensors(state_dict, shapes, self._ties)
        with self._exclusive(), torch.no_grad():
            for name, tensor in tensors.items():
                self._parameters[name].copy_(tensor)
            self._version = version
            for call in self._active:
                call.cached = 0  # re-prefill: no stale K/V from the old weights (see above)

    def running_tokens(self) -> dict[str, list[int]]:
        """Output so far (prefix included) of every call not yet finished, queued calls
        too; read under the engine lock, so never in the middle of a step."""
        with self._exclusive():
            return {c.request.request_id: list(c.tokens) for c in (*self._active, *self._waiting)}

    def running_calls(self, since: Mapping[str, int] | None = None) -> dict[str, RunningCall]:
        """What a prefix cut saves (`PrefixCapture`): tokens, logprobs and versions of
        every call not yet finished, from the offset `since` names on (`tail_offset`).

        Under the engine lock only what is O(calls) is taken: each call's three lists
        (references, not copies) and their lengths. The copy of each tail happens after
        the lock is released, while the next step runs: that is sound because a call's
        lists only grow while it runs (`_append`), and whatever shortens or rewrites one
        binds a new list instead of changing the old one (`_finish_reason_before_decoding`,
        the prefill's recomputed logprobs in `_step`), so positions below the lengths
        taken never change under the copy. Appending from the worker meanwhile is safe
        under the GIL (a slice is one C operation). So `cut_hold_s` (how long the next
        step waited) is independent of how many tokens the calls have decoded
        (bench/bench_prefix_cut.py measures both)."""
        with self._exclusive():
            t0 = time.perf_counter()
            held = [(c.request, c.cut_refused, c.sampler, c.tokens, c.logprobs, c.versions, len(c.tokens),
                     len(c.logprobs)) for c in (*self._active, *self._waiting)]
            self.cut_hold_s = time.perf_counter() - t0
        calls = {}
        for request, refused, sampler, tokens, logprobs, versions, n, n_logprobs in held:
            rid, p = request.request_id, request.params
            start = tail_offset(since, rid, n)
            calls[rid] = RunningCall(tokens[start:n], logprobs[start:min(n, n_logprobs)], versions[start:n],
                                     p.max_tokens, p.min_tokens, refused, start, sampler)
        return calls

    @property
    def sampler_identity(self) -> str:
        return SAMPLER_IDENTITY

    def cut_support(self, request: GenerationRequest) -> str | None:
        """Every call can be cut and continued exactly here (`PrefixCapture`): greedy and
        seeded sampling, stop strings, penalties, min_tokens (see the module docstring)."""
        del request
        return None

    def abort(self, request_ids: Sequence[str]) -> None:
        """Finish these calls (running or queued) at the start of the next step with
        finish_reason "abort" and the tokens they have; unknown ids are ignored."""
        with self._exclusive():
            self._abort_ids.update(request_ids)

    # ---- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Abort every call in progress and stop the worker thread."""
        with self._exclusive():
            self._closed = True
        self._worker.join()

    def __enter__(self) -> ReferenceEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- request intake -----------------------------------------------------------------

    def _new_call(self, request: GenerationRequest) -> _Call:
        p = request.params
        check_request(request, self.vocab_size, self.max_model_len)
        prefix = list(request.prefix_ids)
        prefix_logprobs = list(getattr(request, "prefix_logprobs", ()))
        versions = list(request.prefix_versions)
        changed = sampler_change(request, SAMPLER_IDENTITY)
        fallback = changed if self.prefix_exactness == "bitwise" else None
        if fallback:  # restarted from scratch: every token is then decoded here
            prefix, prefix_logprobs, versions = [], [], []
        seed = p.seed if p.seed is not None else request_seed(self.seed, request.request_id)
        call = _Call(request=request, seed=seed, tokens=prefix, logprobs=prefix_logprobs,
                     cut_refused=self.cut_support(request),
                     sampler=None if changed and not fallback else SAMPLER_IDENTITY, fallback=fallback)
        call.versions = versions
        if p.presence_penalty or p.frequency_penalty:
            call.counts = torch.bincount(torch.tensor(prefix, dtype=torch.long), minlength=self.vocab_size).float()
        if p.stop:
            call.text = self.tokenizer.decode(prefix, skip_special_tokens=True)
        return call

    # ---- the worker ---------------------------------------------------------------------

    @contextmanager
    def _exclusive(self):
        with self._waiters_lock:
            self._waiters += 1
        try:
            self._cv.acquire()
        finally:
            with self._waiters_lock:
                self._waiters -= 1
        try:
            yield
        finally:
            self._cv.notify_all()
            self._cv.release()

    def _run(self) -> None:
        reported = 0
        while True:
            callback = self.step_callback
            if callback is not None and self.steps != reported:
                reported = self.steps
                callback(reported)
            with self._cv:
                while not self._closed and (self._waiters or not (self._waiting or self._active)):
                    self._cv.wait()
                if self._closed:
                    for call in (*self._active, *self._waiting):
                        self._finish(call, "abort")
                    return
                try:
                    if torch.get_num_threads() != self.num_threads:
                        torch.set_num_threads(self.num_threads)
                    started = time.perf_counter()
                    self._step()
                    self.busy_s += time.perf_counter() - started
                except Exception as error:  # a broken step fails its calls, not the process
                    for call in (*self._active, *self._waiting):
                        self._release(call)
                        if not call.future.done():
                            call.future.set_exception(error)
                    self._active.clear()
                    self._waiting.clear()

    def _step(self) -> None:
        """One engine step: aborts, admissions, one forward over every row, one token per
        running call, finishes. Runs with the engine lock held."""
        if self._abort_ids:
            for call in [c for c in (*self._active, *self._waiting) if c.request.request_id in self._abort_ids]:
                self._finish(call, "abort")
            self._abort_ids.clear()
        admitted = self._admit()
        if not self._active:
            return
        self.steps += 1
        tokens, slots, positions, logit_rows, next_rows = [], [], [], [], []
        prefix_rows: dict[int, int] = {}  # call index -> first logits row of its prefix logprobs
        for i, call in enumerate(self._active):
            tail = call.sequence_tail()
            first = len(tokens)
            tokens += tail
            slots += [call.slot] * len(tail)
            positions += range(call.cached, call.cached + len(tail))
            call.cached += len(tail)
            if call in admitted and len(call.logprobs) < len(call.tokens):
                # Rows that predicted each prefix token: the last prompt row onwards.
                prefix_rows[i] = len(logit_rows)
                start = first + len(call.request.prompt_ids) - 1
                logit_rows += range(start, start + len(call.tokens))
            next_rows.append(len(logit_rows))
            logit_rows.append(len(tokens) - 1)
        logits = self._forward.forward(
            torch.tensor(tokens, device=self.device),
            torch.tensor(slots, device=self.device),
            torch.tensor(positions, device=self.device),
            torch.tensor(logit_rows, device=self.device),
        ).cpu()
        for i, start in prefix_rows.items():
            call = self._active[i]
            rows = logits[start : start + len(call.tokens)]
            call.logprobs = token_logprobs(rows, call.tokens, call.request.params.temperature)
        choices = [self._choice(call) for call in self._active]
        picked, logprobs = choose_tokens(logits[next_rows], choices)
        self.decoded_rows += len(picked)
        for call, token, logprob in zip(list(self._active), picked, logprobs):
            self._append(call, token, logprob)

    def _admit(self) -> list[_Call]:
        admitted: list[_Call] = []
        rows = 0
        while self._waiting and self._free_slots:
            call = self._waiting[0]
            if self._finish_reason_before_decoding(call):  # finished it, without decoding
                continue
            need = call.sequence_length
            if admitted and rows + need > self.max_prefill_rows:
                break
            self._waiting.popleft()
            call.slot = self._free_slots.pop()
            call.cached = 0
            self._active.append(call)
            admitted.append(call)
            rows += need
        return admitted

    def _finish_reason_before_decoding(self, call: _Call) -> str | None:
        """A resumed call may already be complete: its prefix ends where the uninterrupted
        call ended (EOS or a stop string past min_tokens, max_tokens, the model length).
        It then finishes without decoding, with that call's output, text and reasons."""
        end = self._end_inside_prefix(call)
        if end is None:
            return None
        reason, n, stop_reason, text = end
        # Nothing past the end was the call's. New lists, not `del`: a cut may be copying
        # the old ones outside the engine lock (`running_calls`).
        call.tokens, call.logprobs, call.versions = call.tokens[:n], call.logprobs[:n], call.versions[:n]
        self._finish(call, reason, stop_reason=stop_reason, text=text)
        return reason

    def _end_inside_prefix(self, call: _Call) -> tuple[str, int, str | None, str | None] | None:
        """(finish reason, output length, stop reason, text) of the uninterrupted call if
        it ended within the prefix: `_append`'s checks replayed token by token. The
        replay decodes once per token only when a stop string occurs in the prefix's
        text at all; otherwise it is one pass over the ids."""
        p, tokens = call.request.params, call.tokens
        search = bool(p.stop) and any(s in call.text for s in p.stop)
        text = ""
        for n in range(1, len(tokens) + 1):
            may_end = n > p.min_tokens
            if may_end and tokens[n - 1] in self.eos_token_ids:
                return "stop", n, "eos", None
            if search:
                previous, text = text, self.tokenizer.decode(tokens[:n], skip_special_tokens=True)
                hit = find_stop(previous, text, p.stop) if may_end else None
                if hit:
                    return "stop", n, hit[1], text[: hit[0]]
            if n >= p.max_tokens or len(call.request.prompt_ids) + n >= self.max_model_len:
                return "length", n, None, None
        if call.sequence_length >= self.max_model_len:
            return "length", len(tokens), None, None
        return None

    def _choice(self, call: _Call) -> RowChoice:
        p = call.request.params
        position = len(call.tokens)
        return RowChoice(
            temperature=p.temperature,
            top_p=p.top_p,
            uniform=position_uniform(call.seed, position),
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            counts=call.counts,
            banned=tuple(sorted(self.eos_token_ids)) if position < p.min_tokens else (),
        )

    def _append(self, call: _Call, token: int, logprob: float) -> None:
        p = call.request.params
        call.tokens.append(token)
        call.logprobs.append(logprob)
        call.versions.append(self._version)
        if call.counts is not None:
            call.counts[token] += 1
        may_end = len(call.tokens) > p.min_tokens
        if may_end and token in self.eos_token_ids:
            self._finish(call, "stop", stop_reason="eos")
            return
        if p.stop:
            previous, call.text = call.text, self.tokenizer.decode(call.tokens, skip_special_tokens=True)
            hit = find_stop(previous, call.text, p.stop) if may_end else None
            if hit:
                self._finish(call, "stop", stop_reason=hit[1], text=call.text[: hit[0]])
                return
        if len(call.tokens) >= p.max_tokens or call.sequence_length >= self.max_model_len:
            self._finish(call, "length")

    def _release(self, call: _Call) -> None:
        if call in self._active:
            self._active.remove(call)
        if call in self._waiting:
            self._waiting.remove(call)
        if call.slot >= 0:
            self._free_slots.append(call.slot)
            call.slot = -1

    def _finish(self, call: _Call, reason: str, *, stop_reason: str | None = None, text: str | None = None) -> None:
        self._release(call)
        if text is None:
            text = self.tokenizer.decode(call.tokens, skip_special_tokens=True)
        result = GenerationResult(
            request_id=call.request.request_id,
            token_ids=list(call.tokens),
            logprobs=list(call.logprobs),
            token_versions=list(call.versions),
            finish_reason=reason,
            text=text,
            extra=_continuation(call, stop_reason),
        )
        if not call.future.done():
            call.future.set_result(result)


def _continuation(call: _Call, stop_reason: str | None = None) -> dict:
    """What a result says of its prefix: how many tokens it had, and how the call went on
    from them. Seeded draws are a function of (seed, position), so a continuation by this
    sampler is the uninterrupted call (bitwise); one from a prefix another sampler decoded
    is a sample of the policy only (distribution), or restarted when bitwise was asked."""
    extra: dict = {"stop_reason": stop_reason, "num_prefix_tokens": 0 if call.fallback else len(call.request.prefix_ids),
                   "sampler": call.sampler}  # RunningCall.sampler of the finished call (a cut may save it whole)
    if call.fallback:
        extra["prefix_fallback"] = call.fallback
    elif call.request.prefix_ids:
        extra["prefix_exactness"] = "bitwise" if call.sampler is not None else "distribution"
    else:
        extra["prefix_exactness"] = None
    return extra
