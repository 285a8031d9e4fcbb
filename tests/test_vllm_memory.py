"""vLLM starts on a machine that is doing something else (issue 29, item 7).

vLLM 0.32's CPU backend reserves `gpu_memory_utilization` (0.92) of the node's memory and
refuses to start when less is free; the engine passes an explicit KV-cache size
(`generation.vllm.kv_cache_mib`) so it needs the weights and that cache only. The vLLM
tests start the engine with most of the memory held (and touched) by another process,
and a KV cache that cannot fit stops a run with one line naming the key. The one-line
report of a start failure is tested here without vLLM too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_vllm_engine import policy_dir, vllm_env  # noqa: F401 - fixtures: vLLM's environment, the tiny policy

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
LEFT_FREE = 3 * GiB  # what the hog leaves: more than vLLM + the tiny policy take, far less than 0.92 of the node

# Holds `n` bytes, every page written (np.ones: resident, not just reserved), until stdin closes.
HOG = "import sys, numpy as np; a = np.ones(int(sys.argv[1]), dtype=np.uint8); print('ready', flush=True); sys.stdin.read()"


def test_an_engine_start_failure_is_one_line_with_vllms_own_innermost_cause():
    from rolloutdb.gpu_capture.vllm_engine import start_failure

    try:
        try:
            raise ValueError("Available memory on node 0 (1.00/23.00 GiB) on kv cache allocation is less\n"
                             "than requested memory for kv (4.00 GiB).")
        except ValueError as inner:
            raise RuntimeError("Engine core initialization failed.") from inner
    except RuntimeError as e:
        line = start_failure(e)
    assert "\n" not in line
    assert line.startswith("generation.backend vllm: the engine did not start: ValueError: Available memory")


def test_a_start_failure_in_vllms_engine_core_process_is_reported_with_the_cause_its_log_holds(tmp_path):
    from rolloutdb.gpu_capture.vllm_engine import start_failure

    log = tmp_path / "vllm.log"
    log.write_text("(EngineCore pid=8955) ERROR [core.py:1510] EngineCore failed to start.\n"
                   "Traceback (most recent call last):\n  File \"cpu_worker.py\", line 84, in __init__\n"
                   "ValueError: Available memory on node 0 (2.93/22.99 GiB) on startup is less than desired CPU "
                   "memory utilization (0.92, 21.15 GiB).\n")
    error = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    assert start_failure(error, log) == (
        "generation.backend vllm: the engine did not start: ValueError: Available memory on node 0 (2.93/22.99 GiB) "
        f"on startup is less than desired CPU memory utilization (0.92, 21.15 GiB). (vLLM's log: {log})")
    log.write_text("nothing raised\n")
    assert "RuntimeError: Engine core initialization failed" in start_failure(error, log)


def test_weights_and_kv_cache_past_the_free_memory_are_refused_naming_the_key():
    from rolloutdb.gpu_capture.vllm_engine import memory_problem

    assert memory_problem(GiB, GiB, 3 * GiB) is None
    problem = memory_problem(GiB, 4 * GiB, 3 * GiB)
    assert problem.startswith("generation.vllm.kv_cache_mib: vLLM needs 4096 MiB of KV cache and 1024 MiB")
    assert memory_problem(GiB, 4 * GiB, None) is None  # not Linux: vLLM checks itself


def _available() -> int:
    from rolloutdb.gpu_capture.vllm_engine import available_memory_bytes

    available = available_memory_bytes()
    assert available is not None
    return available


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_the_engine_starts_and_decodes_with_most_of_the_memory_held_by_another_process(vllm_env, policy_dir):
    from rolloutdb.gpu_capture import GenerationRequest, SamplingParams, generate_all
    from rolloutdb.gpu_capture.vllm_engine import VLLMEngine

    hog_bytes = _available() - LEFT_FREE
    if hog_bytes < GiB:
        pytest.skip(f"only {_available() // 2**20} MiB free: nothing to take")
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(hog_bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    try:
        assert hog.stdout.readline().strip() == "ready"
        # vLLM's default would want 0.92 of the node: far more than is free now.
        assert _available() < 0.5 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        with VLLMEngine(policy_dir, max_batch_size=4, work_dir=vllm_env / "engine") as engine:
            request = GenerationRequest("m", [1, 5, 9], SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0))
            (result,) = generate_all(engine, [request])
        assert len(result.token_ids) == 8
    finally:
        hog.stdin.close()
        hog.wait(timeout=60)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_kv_cache_that_cannot_fit_stops_the_run_with_one_line_naming_the_key(vllm_env):
    too_big_mib = _available() // 2**20 + 1024
    run_dir = vllm_env / "run"
    done = subprocess.run(
        [str(Path(sys.executable).with_name("rolloutdb")), "train", "--config", str(REPO / "examples/quickstart.yaml"),
         "generation.backend=vllm", f"generation.vllm.kv_cache_mib={too_big_mib}", "algorithm.total_steps=1",
         "--run-dir", str(run_dir)], cwd=vllm_env, capture_output=True, text=True, timeout=600,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: generation.vllm.kv_cache_mib: vLLM needs {too_big_mib} MiB of KV cache"), \
        done.stderr[-2000:]
    assert "defect in rolloutdb" not in done.stderr
