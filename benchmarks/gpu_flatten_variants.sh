#!/usr/bin/env bash
# The CUDA flatten kernels' variants side by side, on a GPU machine: builds
# flatten_selftest with CMake (as `make gpu-check` does; no torch, no network
# needed) and runs `flatten_selftest --variant all`, which prints per variant
# (FlattenVariant in csrc/kernels/flatten_kernels.cuh, the production one
# first) its correctness table (wrong bytes: must be 0) and a bandwidth table
# against one device-to-device cudaMemcpy of the same bytes, then a summary of
# kernel time vs the copy (target >= 0.85). Takes well under a minute after
# the build. Run from anywhere:
#
#   bash benchmarks/gpu_flatten_variants.sh            # all variants
#   bash benchmarks/gpu_flatten_variants.sh warp-ranges
#
# Exits non-zero when the build fails or any byte is wrong.
set -euo pipefail
cd "$(dirname "$0")/.."
variant="${1:-all}"
mkdir -p build
nvidia-smi --query-gpu=name,driver_version,clocks.max.memory --format=csv,noheader 2>/dev/null || true
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release > build/gpu_flatten_variants.cmake.log 2>&1 \
  || { cat build/gpu_flatten_variants.cmake.log; exit 1; }
cmake --build build/cmake --target flatten_selftest -j 8
./build/cmake/flatten_selftest --variant "$variant"
