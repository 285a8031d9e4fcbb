"""A workload engine for bench/bench_streaming.py only: continuous batching whose decode
step costs the same whatever its rows (`--engine flat`).

Why: on the 2-core CPU the benchmarks run on, the reference engine's step cost grows
almost linearly with its rows past ~8 (measured hidden 128: 1.4 ms at 1 row, 2.3 ms at
8, 13.2 ms at 64), so a fuller batch buys little per token, and what a pump does to
occupancy hardly shows in tokens/s. A small model on a GPU is the opposite: a step is
a launch-bound forward whose time barely depends on the batch. This engine models that
case: each step sleeps `step_s` (releasing the GIL, as a GPU kernel does) and decodes
one token for every running call. Tokens come from the call's seed (digit ids), the
reply ends at min_tokens or one later (seeded), so two pumps running the same calls
decode the same tokens. Prefill is free (it rides in the step). Same counters as the
reference engine: `busy_s`, `steps`, `decoded_rows`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from concurrent.futures import Future

from rolloutdb.gpu_capture.protocol import GenerationRequest, GenerationResult


def _h(*parts: int) -> int:
    return int.from_bytes(hashlib.blake2b(",".join(map(str, parts)).encode(), digest_size=4).digest(), "little")


class FlatStepEngine:
    def __init__(self, digit_ids: list[int], *, max_batch_size: int, step_s: float):
        self.digit_ids = digit_ids
        self.max_batch_size = max_batch_size
        self.step_s = step_s
        self.policy_version = 0
        self.busy_s = 0.0
        self.steps = 0
        self.decoded_rows = 0
        self._cv = threading.Condition()
        self._waiting: deque = deque()
        self._active: list[list] = []  # [request, future, tokens, length]
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="flat-engine", daemon=True)
        self._worker.start()

    def submit(self, request: GenerationRequest) -> Future:
        p = request.params
        seed = p.seed or 0
        length = p.min_tokens + (_h(seed, -1) % 2 if p.max_tokens > p.min_tokens else 0)
        future: Future = Future()
        with self._cv:
            self._waiting.append([request, future, [], max(1, min(length, p.max_tokens))])
            self._cv.notify()
        return future

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not (self._waiting or self._active):
                    self._cv.wait()
                if self._closed:
                    return
                while self._waiting and len(self._active) < self.max_batch_size:
                    self._active.append(self._waiting.popleft())
                active = list(self._active)
            t0 = time.perf_counter()
            time.sleep(self.step_s)  # the forward pass: the same time for 1 row or a full batch
            done = []
            for call in active:
                req, _f, tokens, _n = call
                tokens.append(self.digit_ids[_h(req.params.seed or 0, len(tokens)) % len(self.digit_ids)])
                if len(tokens) >= call[3]:
                    done.append(call)
            with self._cv:
                for call in done:
                    self._active.remove(call)
            self.steps += 1
            self.decoded_rows += len(active)
            self.busy_s += time.perf_counter() - t0
            for req, future, tokens, _n in done:
                future.set_result(GenerationResult(req.request_id, list(tokens), [-1.0] * len(tokens),
                                                   [0] * len(tokens), "length"))

    def load_weights(self, state_dict, version: int) -> None:
        self.policy_version = version

    def running_tokens(self) -> dict:
        return {}

    def abort(self, request_ids) -> None:
        pass

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._worker.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
