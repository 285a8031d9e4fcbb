"""A flat-step engine that can be cut and resumed, for bench/bench_recovery_scale.py: the
recovery path at hundreds of calls thousands of tokens long, on a CPU.

Like bench/flat_engine.py, a decode step sleeps `step_s` (a GPU forward: the same time
for one row or a full batch, the GIL released) and then decodes one token for every
running call; prefill is free. Unlike it, it implements `PrefixCapture`
(gpu_capture/protocol.py): `running_calls(since)`, `cut_hold_s`, `decoded_rows`,
`cut_support`, and continues a call from `GenerationRequest.prefix_ids` exactly: token
i of a call is a function of (seed, i) only, and a call's length of its seed and limits,
so a call resumed from any prefix decodes what the uninterrupted call decodes.

Locking follows gpu_capture/reference_engine.py: the step's appends and finishes happen
under the engine lock (a reader never sees half a step, and a finished call's future is
completed under the lock that removes it, so a cut finds it either running or in the
pump's uncommitted calls); the sleep does not hold it. `running_calls` takes only each
call's list references and lengths under the lock (O(calls)) and slices the tails after
releasing it: lists only grow while a call runs, so positions below the lengths taken
never change under the copy.

`decode_log`: a file this engine appends one line to per step ("S <wall time> <decoded
rows>") and per `running_calls` ("R <wall time> <decoded rows>"), unbuffered (one
write(2) each), so the lines up to a SIGKILL survive it: the benchmark reads the rows
decoded between the restored cut's engine read and the kill from it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

from rolloutdb.gpu_capture.protocol import GenerationRequest, GenerationResult, RunningCall

try:
    from rolloutdb.gpu_capture.protocol import tail_offset
    INCREMENTAL = True
except ImportError:  # code before incremental cuts (under bench/bench_ab.py): every read is whole
    INCREMENTAL = False

    def tail_offset(since, request_id, length):  # type: ignore[misc]
        return 0

# Per-token logprob by token id modulo this table: shared float objects, so a million
# saved logprobs cost list slots, not a million float objects.
_LOGPROBS = tuple(-0.25 - 0.125 * k for k in range(8))


def _mix(seed: int) -> int:
    return (seed * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF


class _Call:
    __slots__ = ("request", "future", "mix", "length", "tokens", "logprobs", "versions")

    def __init__(self, request: GenerationRequest, future: Future, mix: int, length: int):
        self.request, self.future, self.mix, self.length = request, future, mix, length
        self.tokens: list[int] = list(request.prefix_ids)
        self.versions: list[int] = list(request.prefix_versions)
        self.logprobs: list[float] = list(request.prefix_logprobs) if request.prefix_logprobs else []


class FlatCaptureEngine:
    def __init__(self, token_ids: Sequence[int], *, max_batch_size: int, step_s: float, policy_version: int = 0,
                 decode_log: str | None = None):
        if not token_ids:
            raise ValueError("token_ids must name at least one token")
        self.token_ids = list(token_ids)
        self.max_batch_size = max_batch_size
        self.step_s = step_s
        self._version = policy_version
        self.busy_s = 0.0
        self.steps = 0
        self.decoded_rows = 0
        self.cut_hold_s = 0.0
        self._lock = threading.Condition(threading.Lock())
        self._waiting: deque[_Call] = deque()
        self._active: list[_Call] = []
        self._abort_ids: set[str] = set()
        self._closed = False
        self._log_fd = os.open(decode_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) if decode_log else None
        self._worker = threading.Thread(target=self._run, name="flat-capture-engine", daemon=True)
        self._worker.start()

    # ---- GenerationEngine ------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    def token_at(self, mix: int, position: int) -> int:
        """Output token `position` of a call: a function of its seed and position only."""
        h = (mix ^ (position * 0x85EBCA77)) & 0xFFFFFFFF
        return self.token_ids[(h >> 11) % len(self.token_ids)]

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        p = request.params
        if len(request.prefix_versions) != len(request.prefix_ids):
            raise ValueError(f"request {request.request_id!r}: prefix_versions must give one version per prefix token")
        seed = p.seed or 0
        mix = _mix(seed)
        # Seeded length in [min_tokens, max_tokens]: a mix of short and long calls.
        span = max(0, p.max_tokens - max(1, p.min_tokens))
        length = max(1, p.min_tokens) + (mix >> 5) % (span + 1)
        future: Future = Future()
        call = _Call(request, future, mix, min(length, p.max_tokens))
        if len(call.logprobs) < len(call.tokens):  # no saved logprobs: recomputed, the same function of the token
            call.logprobs = [_LOGPROBS[t % len(_LOGPROBS)] for t in call.tokens]
        with self._lock:
            if self._closed:
                raise RuntimeError("engine is closed")
            rid = request.request_id
            if any(c.request.request_id == rid for c in (*self._waiting, *self._active)):
                raise ValueError(f"request id already running: {rid!r}")
            self._abort_ids.discard(rid)
            self._waiting.append(call)
            self._lock.notify()
        return future

    def load_weights(self, state_dict: Mapping[str, object], version: int) -> None:
        with self._lock:
            self._version = version

    def running_tokens(self) -> dict[str, list[int]]:
        with self._lock:
            held = [(c.request.request_id, c.tokens, len(c.tokens)) for c in (*self._active, *self._waiting)]
        return {rid: tokens[:n] for rid, tokens, n in held}

    def abort(self, request_ids: Sequence[str]) -> None:
        with self._lock:
            self._abort_ids.update(request_ids)
            self._lock.notify()

    # ---- PrefixCapture ---------------------------------------------------------------------

    def running_calls(self, since: Mapping[str, int] | None = None) -> dict[str, RunningCall]:
        """Code before incremental cuts calls this without `since` and gets whole outputs."""
        with self._lock:
            t0 = time.perf_counter()
            held = [(c.request, c.tokens, c.logprobs, c.versions, len(c.tokens)) for c in (*self._active, *self._waiting)]
            rows = self.decoded_rows
            self.cut_hold_s = time.perf_counter() - t0
        self._log("R", rows, len(held), sum(n for *_, n in held))
        calls = {}
        for request, tokens, logprobs, versions, n in held:
            rid, p = request.request_id, request.params
            start = tail_offset(since, rid, n)
            tail = (tokens[start:n], logprobs[start:n], versions[start:n], p.max_tokens, p.min_tokens, None)
            calls[rid] = RunningCall(*tail, start) if INCREMENTAL else RunningCall(*tail)
        return calls

    @property
    def sampler_identity(self) -> str:
        return "flat-bench/1/deterministic"

    def cut_support(self, request: GenerationRequest) -> str | None:
        del request
        return None

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._worker.join()
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None

    def __enter__(self) -> FlatCaptureEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the worker ------------------------------------------------------------------------

    def _log(self, kind: str, *values: int) -> None:
        if self._log_fd is not None:
            os.write(self._log_fd, f"{kind} {time.time():.6f} {' '.join(map(str, values))}\n".encode())

    def _finish(self, call: _Call, reason: str) -> None:
        """Under the lock: the call leaves the engine and its future completes together."""
        self._active.remove(call)
        if not call.future.done():
            call.future.set_result(GenerationResult(call.request.request_id, list(call.tokens), list(call.logprobs),
                                                    list(call.versions), reason))

    def _admit(self) -> None:
        if self._abort_ids:
            for call in [c for c in self._waiting if c.request.request_id in self._abort_ids]:
                self._waiting.remove(call)
                self._active.append(call)
                self._finish(call, "abort")
            for call in [c for c in self._active if c.request.request_id in self._abort_ids]:
                self._finish(call, "abort")
            self._abort_ids.clear()
        while self._waiting and len(self._active) < self.max_batch_size:
            call = self._waiting.popleft()
            self._active.append(call)
            if len(call.tokens) >= call.length:  # resumed at (or past) its end: done without decoding
                self._finish(call, "length")

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not (self._waiting or self._active or self._abort_ids):
                    self._lock.wait()
                if self._closed:
                    self._active.extend(self._waiting)
                    self._waiting.clear()
                    for call in list(self._active):
                        self._finish(call, "abort")
                    return
                self._admit()
                if not self._active:
                    continue
            t0 = time.perf_counter()
            time.sleep(self.step_s)  # the forward pass: the same time for 1 row or a full batch
            with self._lock:
                version, token_at, table = self._version, self.token_at, _LOGPROBS
                done = []
                # Calls admitted or aborted meanwhile are the next step's: this one decodes
                # what runs now (an abort arriving during the sleep lands at the next step).
                for call in self._active:
                    token = token_at(call.mix, len(call.tokens))
                    call.tokens.append(token)
                    call.logprobs.append(table[token % 8])
                    call.versions.append(version)
                    if len(call.tokens) >= call.length:
                        done.append(call)
                rows = len(self._active)
                for call in done:
                    self._finish(call, "length")
                self.steps += 1
                self.decoded_rows += rows
                total = self.decoded_rows
                self.busy_s += time.perf_counter() - t0
            self._log("S", total)
