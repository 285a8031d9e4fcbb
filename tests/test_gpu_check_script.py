"""scripts/gpu_vllm_check.sh refuses a machine without a CUDA GPU before it installs
anything (issue 29 item 6: "it refuses clearly without a GPU"). The GPU half of the script
runs only on a CUDA machine (docs/vllm.md); this checks the refusal, which every machine
without one gets."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_check_refuses_a_machine_without_nvidia_smi_in_one_line_and_creates_nothing(tmp_path):
    # A PATH with bash's own tools and no nvidia-smi: a machine without an NVIDIA driver.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "mkdir", "python3", "tee"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    if shutil.which("nvidia-smi", path=str(bin_dir)):
        pytest.skip("nvidia-smi on the stripped PATH")
    venv, out = tmp_path / "venv", tmp_path / "out"
    done = subprocess.run(["bash", str(REPO / "scripts/gpu_vllm_check.sh"), str(venv), str(out)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PATH": str(bin_dir)})
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU here (nvidia-smi not found)" in lines[0], done.stderr
    assert "run this on a machine with an NVIDIA GPU" in lines[0]
    assert not venv.exists() and not out.exists()  # nothing installed, nothing written
