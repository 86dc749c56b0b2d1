#!/usr/bin/env bash
# ncu profile of one graph-replayed decode step of bench-one-batch at the GPU's own clocks without cache flushes (real
# per-kernel times). usage: tools/device/ncu_step.sh PKG_DIR BATCH [SKIP COUNT]  (summary on stdout; LAYER=MARKER
# also lists one layer, see kernel_profile.py; MODEL=DIR another model than the V2-Lite shape, ARGS more options)
set -uo pipefail
PKG=$1 B=$2 SKIP=${3:-0} COUNT=${4:-20000}
export LD_LIBRARY_PATH=$PWD/$PKG/lib:${LD_LIBRARY_PATH:-}
L=/tmp/ncu; mkdir -p $L
timeout -s KILL ${NCU_LIMIT:-200} /usr/local/cuda/bin/ncu --graph-profiling node --cache-control none --clock-control none \
  --metrics gpu__time_duration.sum --csv --kernel-name-base function -k 'regex:^(?!fill_random|convert)' \
  --launch-skip $SKIP --launch-count $COUNT $PKG/bin/mlaserve bench-one-batch --device cuda \
  --model-path ${MODEL:-tools/bench/deepseek-v2-lite} ${ARGS:-} --load-format dummy --input-len 128 --output-len 6 --batch-size $B \
  --cuda-graph-max-bs 8 --log-level warning > $L/ncu-b$B.csv 2> $L/ncu-b$B.err
echo "== ncu batch $B rc=$?"
python3 tools/device/kernel_profile.py $L/ncu-b$B.csv --step embedding ${LAYER:+--layer $LAYER} || tail -3 $L/ncu-b$B.err
