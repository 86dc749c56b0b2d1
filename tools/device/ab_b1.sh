#!/usr/bin/env bash
# Batch-1..8 decode of several builds on one machine, alternating (machines vary by a few percent), plus an optional
# ncu profile (tools/device/ncu_step.sh) of the builds named in NCU, the per-call CSVs kept.
# usage: LIB=.devcarry/lib tools/device/ab_b1.sh BIN_DIR... (ROUNDS=2 BATCHES="1" NCU="BIN_DIR..."; writes
# $OUT/ab.tar.xz)
set -uo pipefail
source "$(dirname "$0")/bench_env.sh"
L=/tmp/ab; mkdir -p $L
for r in $(seq ${ROUNDS:-2}); do
  for b in ${BATCHES:-1}; do
    for d in "$@"; do
      n=$(basename $(dirname $d))-b$b-r$r
      timeout -s KILL 60 $d/mlaserve $BOB --output-len 64 --batch-size $b > $L/$n.log 2>&1
      echo "== $n rc=$?: $(grep -E 'decode:' $L/$n.log | tr -s ' ')"
    done
  done
done
for d in ${NCU:-}; do  # NCU="BIN_DIR...": ncu_step.sh on each (a batch-${NCU_B:-1} run), one layer listed
  n=$(basename $(dirname $d))
  LAYER=${LAYER:-mla_decode_ws} bash tools/device/ncu_step.sh $(dirname $d) ${NCU_B:-1} | head -${NCU_LINES:-40}
  cp /tmp/ncu/ncu-b${NCU_B:-1}.csv $L/ncu-$n.csv
done
tar -C /tmp -cJf ${OUT:-/tmp}/ab.tar.xz ab
