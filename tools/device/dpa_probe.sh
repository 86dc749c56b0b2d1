#!/usr/bin/env bash
# One process driving 2 GPUs with DP attention: runs eval-logits under several NCCL / backend settings with a time
# limit and --log-level trace, and prints the last trace lines of each rank when one does not finish.
# usage: tools/device/dpa_probe.sh PKG_DIR OUT_DIR
set -uo pipefail
PKG=$1; OUT=$2
export LD_LIBRARY_PATH=$PWD/$PKG/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
BIN=$PKG/bin/mlaserve
M=tests/golden/data/${FAMILY:-v2}; P=$M/reference.safetensors
LIMIT=${LIMIT:-40}
probe() {
  local name=$1; shift
  env "$@" $BIN eval-logits --device cuda --model-path $M --prompts $P --out /tmp/probe-$name.st --max-new-tokens 24 \
    --log-level trace --tp 2 --dp 2 --enable-dp-attention > $OUT/probe-$name.log 2>&1 &
  local pid=$! t=0
  while kill -0 $pid 2>/dev/null && [ $t -lt $LIMIT ]; do sleep 1; t=$((t + 1)); done
  if kill -0 $pid 2>/dev/null; then
    kill -9 $pid; wait $pid 2>/dev/null
    echo "== $name: HANG after ${LIMIT}s; last lines per rank:"
    for r in 0 1; do grep "rank $r:" $OUT/probe-$name.log | tail -3; done
    grep "cuda [01]:" $OUT/probe-$name.log | tail -2
    grep -c "forward of" $OUT/probe-$name.log
  else
    wait $pid; echo "== $name: rc=$? in ${t}s, $(grep -c 'forward of' $OUT/probe-$name.log) forwards"
    grep -iE "error|warn" $OUT/probe-$name.log | head -3
  fi
}
probe base X=1
probe p2p_direct_off NCCL_P2P_DIRECT_DISABLE=1
probe grouped_moe MLASERVE_MOE_GROUPED=1
probe p2p_off NCCL_P2P_DISABLE=1
probe lazy CUDA_MODULE_LOADING=LAZY
