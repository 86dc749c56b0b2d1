#!/usr/bin/env bash
# Small-batch decode on one GPU: wall time per step at batch 1, 2, 4, 8 with graphs on (and off at batch 1), with the
# small-batch kernels and PDL on / off, plus an ncu profile of one graph-replayed batch-1 step at the GPU's own
# clocks without cache flushes (real per-kernel times; the gaps between kernels are the step's wall time minus their
# sum). usage: tools/device/b1_profile.sh PKG_DIR  (NCU=1 adds the profile; writes $OUT/b1.tar.xz)
set -uo pipefail
PKG=$1
LIB=${LIB:-$PKG/lib} source "$(dirname "$0")/bench_env.sh"
BIN=$PKG/bin/mlaserve
L=/tmp/b1; mkdir -p $L
run() {  # name, env..., -- flags
  local name=$1; shift; local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" MLASERVE_GPU_IDLE_STATS=1 timeout -s KILL 60 $BIN $BOB --output-len 64 "$@" > $L/bob-$name.log 2>&1
  echo "== $name rc=$?: $(grep -E 'decode:' $L/bob-$name.log | tr -s ' ') idle: $(grep -o 'idle between steps [0-9.]* ms of [0-9.]* ms ([0-9.]*%)' $L/bob-$name.log | head -1)"
}
for b in ${BATCHES:-1 2 4 8}; do
  run b$b-new -- --batch-size $b
  [ $b = 1 ] && run b$b-nopdl MLASERVE_PDL=0 -- --batch-size $b
  run b$b-old MLASERVE_SMALL_BATCH=0 MLASERVE_PDL=0 -- --batch-size $b
done
run b1-eager -- --batch-size 1 --disable-cuda-graph
if [ "${NCU:-0}" = 1 ]; then  # one graph-replayed batch-1 step (tools/device/ncu_step.sh), its CSV kept
  bash tools/device/ncu_step.sh $PKG 1 && cp /tmp/ncu/ncu-b1.csv $L/ncu.csv
fi
tar -C /tmp -cJf ${OUT:-/tmp}/b1.tar.xz b1
