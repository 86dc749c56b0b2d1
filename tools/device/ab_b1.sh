#!/usr/bin/env bash
# Batch-1..8 decode of several builds on one machine, alternating (machines vary by a few percent), plus an optional
# ncu profile of one graph-replayed batch-1 step of the first build (per-call CSV kept).
# usage: LIB=.devcarry/lib tools/device/ab_b1.sh BIN_DIR... (ROUNDS=2 BATCHES="1" NCU="BIN_DIR..."; writes
# $OUT/ab.tar.xz)
set -uo pipefail
LIB=${LIB:-.devcarry/lib}
[ -f $LIB/libicudata.so.72.xz ] && xz -d -k -f $LIB/libicudata.so.72.xz
export LD_LIBRARY_PATH=$PWD/$LIB:${LD_LIBRARY_PATH:-}
L=/tmp/ab; mkdir -p $L
BOB="bench-one-batch --device cuda --model-path tools/bench/deepseek-v2-lite --load-format dummy --input-len 128 --log-level info"
for r in $(seq ${ROUNDS:-2}); do
  for b in ${BATCHES:-1}; do
    for d in "$@"; do
      n=$(basename $(dirname $d))-b$b-r$r
      timeout -s KILL 60 $d/mlaserve $BOB --output-len 64 --batch-size $b > $L/$n.log 2>&1
      echo "== $n rc=$?: $(grep -E 'decode:' $L/$n.log | tr -s ' ')"
    done
  done
done
for d in ${NCU:-}; do  # NCU="BIN_DIR...": every kernel of a batch-${NCU_B:-1} run (warm-up, then steps of 6 tokens)
  n=$(basename $(dirname $d))
  timeout -s KILL ${NCU_LIMIT:-200} /usr/local/cuda/bin/ncu --graph-profiling node --cache-control none \
    --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name-base function \
    -k 'regex:^(?!fill_random|convert)' $d/mlaserve $BOB --batch-size ${NCU_B:-1} --output-len 6 --cuda-graph-max-bs 8 \
    > $L/ncu-$n.csv 2> $L/ncu-$n.err
  echo "== ncu $n rc=$?"
  python3 tools/device/kernel_profile.py $L/ncu-$n.csv --step embedding | head -${NCU_LINES:-24} || tail -5 $L/ncu-$n.err
done
tar -C /tmp -cJf ${OUT:-/tmp}/ab.tar.xz ab
