#!/usr/bin/env bash
# The one test command: configure, build and run every test that needs no GPU.
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
