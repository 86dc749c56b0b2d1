#!/usr/bin/env bash
# The one test command: configure, build and run every test that needs no GPU; where nvcc exists, also build the
# CUDA variant (sm_90a) so a change that breaks it fails here, and run its GPU tests when a GPU is present.
# MLASERVE_BUILD_DIR (default build) picks the build folder; extra arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${MLASERVE_BUILD_DIR:-build}
jobs=${MLASERVE_JOBS:-$(nproc)}
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs" -LE gpu "$@"

nvcc=$(command -v nvcc || true)
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
if [ -n "$nvcc" ] && [ "${MLASERVE_SKIP_CUDA:-0}" != 1 ]; then
  cuda_build=${MLASERVE_CUDA_BUILD_DIR:-build-cuda}
  if [ ! -f "$cuda_build/CMakeCache.txt" ]; then
    cmake -S . -B "$cuda_build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DMLASERVE_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc"
  fi
  cmake --build "$cuda_build" -j "$jobs"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    ctest --test-dir "$cuda_build" --output-on-failure -L gpu
  else
    echo "test.sh: CUDA build compiled; no GPU here, GPU tests not run"
  fi
fi
