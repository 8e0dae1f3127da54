"""The CUDA kernel files compile standalone with nvcc, no torch header, no GPU.

CI machines have a CUDA toolkit but no GPU and a CPU torch, so the extension's
CUDA part is never built there; this catches breakage of the .cu files. Skipped
when nvcc is not on PATH (nor in /usr/local/cuda/bin)."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("source", ["csrc/kernels/flatten_kernels.cu", "csrc/kernels/flatten_selftest.cu"])
def test_kernel_file_compiles_standalone(source, tmp_path):
    cmd = [NVCC, "-std=c++17", "-O1", "-arch=sm_90", "-I", os.path.join(ROOT, "csrc"),
           "-c", os.path.join(ROOT, source), "-o", str(tmp_path / "k.o")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    with open(os.path.join(ROOT, source)) as f:
        assert "torch" not in "".join(line for line in f if line.startswith("#include")), "a torch header crept in"
