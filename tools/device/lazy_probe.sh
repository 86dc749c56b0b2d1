#!/usr/bin/env bash
# One process driving 2 GPUs: DP attention and TP under lazy / eager CUDA module loading, with graphs on and off.
# Prints each result as it comes (a hang is killed at its limit and reported with the last trace lines).
# usage: tools/device/lazy_probe.sh PKG_DIR OUT_DIR
set -uo pipefail
PKG=$1; OUT=$2
export LD_LIBRARY_PATH=$PWD/$PKG/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
BIN=$PKG/bin/mlaserve
M=tests/golden/data/v2; P=$M/reference.safetensors
run() {  # name limit env... -- args...
  local name=$1 limit=$2; shift 2
  local envs=(); while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" $BIN "$@" > $OUT/$name.log 2>&1 &
  local pid=$! t=0
  while kill -0 $pid 2>/dev/null && [ $t -lt $limit ]; do sleep 1; t=$((t + 1)); done
  if kill -0 $pid 2>/dev/null; then
    kill -9 $pid; wait $pid 2>/dev/null
    echo "== $name: HANG after ${limit}s: $(grep -E 'rank [01]:|graphs:' $OUT/$name.log | tail -4 | cut -c26- | tr '\n' '|')"
  else
    wait $pid; echo "== $name: rc=$? ${t}s $(grep -E 'graphs:|decode:|error' $OUT/$name.log | cut -c1-200 | tr '\n' '|')"
  fi
}
DPA="--tp 2 --dp 2 --enable-dp-attention"
EV="eval-logits --device cuda --model-path $M --prompts $P --max-new-tokens 24 --cuda-graph-max-bs 16"
BOB="bench-one-batch --device cuda --model-path tools/bench/deepseek-v2-lite --load-format dummy --input-len 128 --output-len 32"
run dpa-lazy-nograph 40 CUDA_MODULE_LOADING=LAZY -- $EV --out /tmp/a.st $DPA --disable-cuda-graph --log-level trace
run dpa-lazy-graph 40 CUDA_MODULE_LOADING=LAZY -- $EV --out /tmp/b.st $DPA --log-level trace
python3 tools/compare_logits.py /tmp/a.st /tmp/b.st --tol 1e-6 2>&1 | tail -2
run tp2-eager-bob 60 X=1 -- $BOB --tp 2 --batch-size 256 --cuda-graph-max-bs 256 --log-level trace
run tp2-lazy-bob 60 CUDA_MODULE_LOADING=LAZY -- $BOB --tp 2 --batch-size 256 --cuda-graph-max-bs 256 --log-level trace
run dpa-lazy-bob 60 CUDA_MODULE_LOADING=LAZY -- $BOB $DPA --batch-size 256 --cuda-graph-max-bs 256 --log-level trace
