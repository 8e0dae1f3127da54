"""The CUDA kernel files compile standalone with nvcc, no torch header, no GPU.

CI machines have a CUDA toolkit but no GPU and a CPU torch, so the extension's
CUDA part is never built there; this catches breakage of the .cu files, and
runs the part of the self-test that needs no GPU. Skipped when nvcc is not on
PATH (nor in /usr/local/cuda/bin)."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")


SOURCES = ["csrc/kernels/flatten_kernels.cu", "csrc/kernels/flatten_selftest.cu"]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.timeout(300)
def test_kernels_build_standalone_and_pass_host_emulation(tmp_path):
    """Both .cu files compile and link with nvcc alone, and the self-test's
    --host mode (no GPU: the wide piece copy of [Note: load width by
    alignment] emulated lane by lane on the CPU, every alignment modulo 16)
    finds no wrong byte."""
    exe = str(tmp_path / "flatten_selftest")
    cmd = [NVCC, "-std=c++17", "-O1", "-arch=sm_90", "-I", os.path.join(ROOT, "csrc"),
           *(os.path.join(ROOT, s) for s in SOURCES), "-o", exe]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=260)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    ran = subprocess.run([exe, "--host"], capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0 and " 0 wrong bytes" in ran.stdout, f"{ran.stdout}\n{ran.stderr}"
    for source in SOURCES:
        with open(os.path.join(ROOT, source)) as f:
            assert "torch" not in "".join(line for line in f if line.startswith("#include")), (
                f"a torch header crept into {source}")
