#!/usr/bin/env bash
# One decode step as a kernel timeline, from a probe build (cmake -DMLASERVE_CUDA=ON -DMLASERVE_PROBE=ON: every
# kernel's PDL wait is timestamped with %globaltimer for one graph step, src/backend/cuda/common.cuh). Unlike a CUPTI
# trace it does not slow short kernels (a probe build measured the same step time as a normal one).
# usage: LIB=.devcarry/lib tools/device/probe_step.sh BIN_DIR [BATCH=1] [LAYER=5]  (records kept in ${OUT:-/tmp})
set -uo pipefail
source "$(dirname "$0")/bench_env.sh"
BIN=$1; B=${2:-1}; LAYER=${3:-5}
REC=${OUT:-/tmp}/probe-b$B.txt
MLASERVE_PROBE_OUT=$REC timeout -s KILL 90 $BIN/mlaserve $BOB --output-len 64 --batch-size $B 2>&1 | grep -E 'decode:'
python3 tools/device/probe_timeline.py $REC --layer $LAYER
