#!/usr/bin/env bash
# Kernel timeline of graph-replayed decode steps of bench-one-batch (the GPU machine has no nsys): every kernel's
# start / end on the GPU through tools/device/kernel_trace.cpp (CUPTI, LD_PRELOAD), so the gaps and PDL overlaps
# between the kernels of a step show (ncu runs kernels one at a time).
# Tracing inflates short kernels and gaps (kernel_trace.cpp): compare kernels within one trace.
# usage: tools/device/trace_step.sh PKG_DIR BATCH  (PKG_DIR/lib holds libkt.so, built as kernel_trace.cpp says, and
# libcupti.so.13; writes /tmp/kt/trace-bBATCH.csv and prints timeline.py's summary)
set -uo pipefail
PKG=$1 B=$2
export LD_LIBRARY_PATH=$PWD/$PKG/lib:${LD_LIBRARY_PATH:-}
L=/tmp/kt; mkdir -p $L
timeout -s KILL ${KT_LIMIT:-120} env KT_OUT=$L/trace-b$B.csv LD_PRELOAD=$PWD/$PKG/lib/libkt.so $PKG/bin/mlaserve \
  bench-one-batch --device cuda --model-path tools/bench/deepseek-v2-lite --load-format dummy --input-len 128 \
  --output-len 16 --batch-size $B --cuda-graph-max-bs 8 --log-level warning > $L/b$B.log 2>&1
echo "== trace batch $B rc=$?: $(grep -E 'decode:' $L/b$B.log | tr -s ' ')"
python3 tools/device/timeline.py $L/trace-b$B.csv ${LAYER:-mla_decode_ws} || tail -5 $L/b$B.log
