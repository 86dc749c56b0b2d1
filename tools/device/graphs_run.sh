#!/usr/bin/env bash
# CUDA graphs and parallel layouts on a 2-GPU machine, in one device call:
#  A. eval-logits with graphs on and off for tp 1, tp 2 and DP attention 2/2 (same layout on/off must agree; every
#     layout against tp 1), and two processes as two nodes against one process, with DP attention;
#  B. bench-one-batch decode, --tp 2 against --tp 2 --dp 2 --enable-dp-attention (graphs on);
#  C. serve + bench-serving --random-input 1 --random-output 512 for both layouts (the ratio), with the GPU
#     idle time between steps (MLASERVE_GPU_IDLE_STATS) from the servers' exit logs;
#  D. one GPU, batch-256 serving, GPU idle between steps.
# usage: tools/device/graphs_run.sh PKG_DIR MODEL_WITH_TOKENIZER OUT_DIR
set -uo pipefail
PKG=$1; TOKM=$2; OUT=$3
export LD_LIBRARY_PATH=$PWD/$PKG/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
BIN=$PKG/bin/mlaserve
CMP="python3 tools/compare_logits.py"
NP=${NUM_PROMPTS:-1024}
summary=()
note() { summary+=("$1"); echo "== $1"; }

M=tests/golden/data/v2; P=$M/reference.safetensors
for L in "tp1:" "tp2:--tp 2" "dpa2:--tp 2 --dp 2 --enable-dp-attention"; do
  name=${L%%:*}; flags=${L#*:}
  for G in on off; do
    g=""; [ $G = off ] && g="--disable-cuda-graph"
    timeout 90 $BIN eval-logits --device cuda --model-path $M --prompts $P --out /tmp/$name-$G.st --max-new-tokens 24 \
      --cuda-graph-max-bs 16 --log-level warning $flags $g > $OUT/ev-$name-$G.log 2>&1 || note "$name graphs $G FAILED rc=$?: $(tail -2 $OUT/ev-$name-$G.log)"
  done
  $CMP /tmp/$name-off.st /tmp/$name-on.st --tol 1e-6 --near-tie 0 > $OUT/cmp-$name-graphs.txt 2>&1
  note "$name graphs on vs off: rc=$? $(tail -1 $OUT/cmp-$name-graphs.txt)"
  [ $name != tp1 ] && { $CMP /tmp/tp1-off.st /tmp/$name-on.st --tol 0.1 > $OUT/cmp-$name-tp1.txt 2>&1; note "$name vs tp1: rc=$? $(tail -1 $OUT/cmp-$name-tp1.txt)"; }
done
PORT=29$((RANDOM % 400 + 100))
CUDA_VISIBLE_DEVICES=1 timeout 90 $BIN eval-logits --device cuda --model-path $M --prompts $P --out /tmp/unused.st --max-new-tokens 24 \
  --cuda-graph-max-bs 16 --tp 2 --dp 2 --enable-dp-attention --nnodes 2 --node-rank 1 --dist-init-addr 127.0.0.1:$PORT > $OUT/node1.log 2>&1 &
N1=$!
CUDA_VISIBLE_DEVICES=0 timeout 90 $BIN eval-logits --device cuda --model-path $M --prompts $P --out /tmp/mn.st --max-new-tokens 24 \
  --cuda-graph-max-bs 16 --tp 2 --dp 2 --enable-dp-attention --nnodes 2 --node-rank 0 --dist-init-addr 127.0.0.1:$PORT > $OUT/node0.log 2>&1
rc0=$?; wait $N1; rc1=$?
$CMP /tmp/dpa2-on.st /tmp/mn.st --tol 1e-6 --near-tie 0 > $OUT/cmp-multinode.txt 2>&1
note "two nodes DP attention (rc $rc0/$rc1) vs one process: rc=$? $(tail -1 $OUT/cmp-multinode.txt)"

for B in 256 1024; do
  for L in "--tp 2" "--tp 2 --dp 2 --enable-dp-attention"; do
    timeout 150 $BIN bench-one-batch --device cuda --model-path tools/bench/deepseek-v2-lite --load-format dummy --batch-size $B \
      --input-len 128 --output-len 64 --cuda-graph-max-bs 1024 --log-level warning $L > $OUT/bob-$B-${L// /_}.log 2>&1
    note "bench-one-batch B=$B $L: $(grep -E 'decode:' $OUT/bob-$B-${L// /_}.log | tr -s ' ')"
  done
done

serve_bench() {  # name, env/flags..., then bench flags after --
  local name=$1; shift
  local sflags=() bflags=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do sflags+=("$1"); shift; done
  shift; bflags=("$@")
  local port=30$((RANDOM % 400 + 100))
  MLASERVE_GPU_IDLE_STATS=1 $BIN serve --model-path $TOKM --load-format dummy --port $port --disable-radix-cache \
    --cuda-graph-max-bs 1024 --log-level info "${sflags[@]}" > $OUT/serve-$name.log 2>&1 &
  local pid=$! t=0
  until python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:$port/health',timeout=2)" 2>/dev/null; do
    sleep 1; t=$((t + 1)); if [ $t -gt 120 ] || ! kill -0 $pid 2>/dev/null; then note "$name: server did not start: $(tail -3 $OUT/serve-$name.log)"; kill $pid 2>/dev/null; return; fi
  done
  timeout 240 $BIN bench-serving --backend sglang --port $port --dataset-name random --random-range-ratio 1 \
    "${bflags[@]}" > $OUT/bench-$name.log 2>&1
  note "$name bench-serving rc=$?: $(grep -iE 'output token throughput|request throughput|total token' $OUT/bench-$name.log | tr -s ' ' | tr '\n' ' ')"
  kill -TERM $pid; t=0; while kill -0 $pid 2>/dev/null && [ $t -lt 30 ]; do sleep 1; t=$((t + 1)); done; kill -9 $pid 2>/dev/null
  note "$name idle: $(grep -o 'GPU idle between steps.*' $OUT/serve-$name.log | tr '\n' ' ')"
}
serve_bench tp2 --tp 2 -- --random-input 1 --random-output 512 --num-prompts $NP
serve_bench dpa2 --tp 2 --dp 2 --enable-dp-attention -- --random-input 1 --random-output 512 --num-prompts $NP
CUDA_VISIBLE_DEVICES=0 serve_bench tp1-b256 --max-running-requests 256 -- --random-input 128 --random-output 256 --num-prompts 512

printf '%s\n' "${summary[@]}" > $OUT/summary.txt
echo; echo "==== summary"; cat $OUT/summary.txt
