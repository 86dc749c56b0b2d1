#!/usr/bin/env bash
# ncu --set full of a few launches of the kernels named like REGEX inside bench-one-batch's graph-replayed decode
# steps (GPU's own clocks, no cache flushes): throughput, occupancy, stall reasons. The report's details page is
# written to $OUT/ncu-NAME.txt and its headline lines printed.
# usage: tools/device/ncu_kernel.sh PKG_DIR NAME REGEX [BATCH SKIP COUNT]  (MODEL=DIR, ARGS=more options)
set -uo pipefail
PKG=$1 NAME=$2 RE=$3 B=${4:-1} SKIP=${5:-60} COUNT=${6:-2}
export LD_LIBRARY_PATH=$PWD/$PKG/lib:${LD_LIBRARY_PATH:-}
R=${OUT:-/tmp}/ncu-$NAME.txt
timeout -s KILL ${NCU_LIMIT:-240} /usr/local/cuda/bin/ncu --set full --graph-profiling node --cache-control none \
  --clock-control none --kernel-name-base function -k "regex:$RE" --launch-skip $SKIP --launch-count $COUNT \
  --print-details all $PKG/bin/mlaserve bench-one-batch --device cuda --model-path ${MODEL:-tools/bench/deepseek-v2-lite} \
  ${ARGS:-} --load-format dummy --input-len 128 --output-len 8 --batch-size $B --cuda-graph-max-bs 8 \
  --log-level warning > $R 2>&1
echo "== ncu $NAME rc=$?"
grep -E '^  [a-z_]+kernel|Duration|DRAM Throughput|^    Memory Throughput|L2 Hit Rate|Achieved Occupancy|Registers Per|Theoretical Occ|Block Limit Reg|Issue Slots Busy|Warp Cycles Per Issued|L1/TEX Hit|Mem Busy|Max Bandwidth' $R | head -60
