#!/usr/bin/env bash
# Parallel layouts on a 2-GPU machine, in one device call: equality of every layout over NCCL (against tp = 1 on
# the same GPUs and against the Hugging Face reference), two processes as two nodes against one process driving both
# GPUs, a node that never arrives, and decode throughput of --tp 2 against --tp 2 --dp 2 --enable-dp-attention.
# usage: tools/device/parallel_run.sh PKG_DIR OUT_DIR   (PKG_DIR from tools/device/pack.sh)
set -uo pipefail
PKG=$1
OUT=$2
export LD_LIBRARY_PATH=$PWD/$PKG/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
FAMILIES=${FAMILIES:-v2 v3}
BATCHES=${BATCHES:-256 1024}
OUTLEN=${OUTLEN:-64}
BIN=$PKG/bin/mlaserve
CMP="python3 tools/compare_logits.py"
nvidia-smi -L
summary=()
note() { summary+=("$1"); echo "== $1"; }
# Runs a command with a time limit; when it is still running at the limit, prints every thread's stack (gdb, when
# the machine has it) into $OUT/hang-N.txt before killing it, so a hang shows where it is.
hangs=0
guard() {
  local limit=$1; shift
  "$@" & local pid=$!
  local t=0
  while kill -0 $pid 2>/dev/null && [ $t -lt $limit ]; do sleep 1; t=$((t + 1)); done
  if kill -0 $pid 2>/dev/null; then
    hangs=$((hangs + 1))
    echo "HANG after ${limit}s: $*" > $OUT/hang-$hangs.txt
    command -v gdb >/dev/null && gdb -p $pid -batch -ex "thread apply all bt 12" >> $OUT/hang-$hangs.txt 2>&1
    kill -9 $pid; wait $pid 2>/dev/null; return 124
  fi
  wait $pid
}

for fam in $FAMILIES; do
  M=tests/golden/data/$fam
  P=$M/reference.safetensors
  guard 90 $BIN eval-logits --device cuda --model-path $M --prompts $P --out /tmp/$fam-tp1.st --max-new-tokens 24 --log-level warning
  $CMP $P /tmp/$fam-tp1.st --tol 0.1 > $OUT/$fam-tp1-vs-hf.txt; note "$fam tp1 vs HF: rc=$? $(tail -1 $OUT/$fam-tp1-vs-hf.txt)"
  for L in "tp2:--tp 2" "dpa2:--tp 2 --dp 2 --enable-dp-attention" "dp2:--dp 2"; do
    name=${L%%:*}; flags=${L#*:}
    NCCL_DEBUG=WARN guard 90 $BIN eval-logits --device cuda --model-path $M --prompts $P --out /tmp/$fam-$name.st --max-new-tokens 24 --log-level warning $flags \
      > $OUT/$fam-$name.log 2>&1 || note "$fam $name FAILED: $(tail -2 $OUT/$fam-$name.log)"
    # Against tp = 1 on the GPU: the same bf16 math, other reduction orders.
    python3 - /tmp/$fam-tp1.st /tmp/$fam-$name.st <<'PY' > $OUT/$fam-$name-vs-tp1.txt
import sys; sys.path.insert(0, "tools"); from compare_logits import read
import math
a, b = read(sys.argv[1]), read(sys.argv[2]); worst = 0; same = 0; n = 0
j = 0
while f"logits_{j}" in a:
    x, y = a[f"logits_{j}"][1], b[f"logits_{j}"][1]
    m = sum(x) / len(x); sd = math.sqrt(sum((v - m) ** 2 for v in x) / len(x))
    worst = max(worst, max(abs(p - q) for p, q in zip(x, y)) / sd)
    ga, gb = a[f"greedy_{j}"][1], b[f"greedy_{j}"][1]
    k = 0
    while k < len(ga) and ga[k] == gb[k]: k += 1
    same += k; n += len(ga); j += 1
print(f"max|dlogit|/std {worst:.2e}, greedy tokens equal before first divergence {same}/{n}")
PY
    note "$fam $name vs cuda tp1: $(cat $OUT/$fam-$name-vs-tp1.txt)"
    $CMP $P /tmp/$fam-$name.st --tol 0.1 > $OUT/$fam-$name-vs-hf.txt; note "$fam $name vs HF: rc=$? $(tail -1 $OUT/$fam-$name-vs-hf.txt)"
  done
done

# Two processes as two nodes (one GPU each) against one process driving both GPUs.
M=tests/golden/data/v2; P=$M/reference.safetensors; PORT=29$((RANDOM % 500 + 100))
CUDA_VISIBLE_DEVICES=1 timeout 100 $BIN eval-logits --device cuda --model-path $M --prompts $P --out /tmp/unused.st \
  --max-new-tokens 24 --tp 2 --nnodes 2 --node-rank 1 --dist-init-addr 127.0.0.1:$PORT > $OUT/node1.log 2>&1 &
N1=$!
CUDA_VISIBLE_DEVICES=0 timeout 100 $BIN eval-logits --device cuda --model-path $M --prompts $P --out /tmp/mn.st \
  --max-new-tokens 24 --tp 2 --nnodes 2 --node-rank 0 --dist-init-addr 127.0.0.1:$PORT > $OUT/node0.log 2>&1
rc0=$?; wait $N1; rc1=$?
note "two nodes: node0 rc=$rc0 node1 rc=$rc1"
$CMP /tmp/v2-tp2.st /tmp/mn.st --tol 1e-6 --near-tie 0 > $OUT/multinode-vs-tp2.txt; note "two nodes vs one process tp2 (tol 1e-6): rc=$? $(tail -1 $OUT/multinode-vs-tp2.txt)"
# DP attention across the two nodes too.
CUDA_VISIBLE_DEVICES=1 timeout 100 $BIN eval-logits --device cuda --model-path $M --prompts $P --out /tmp/unused.st \
  --max-new-tokens 24 --tp 2 --dp 2 --enable-dp-attention --nnodes 2 --node-rank 1 --dist-init-addr 127.0.0.1:$((PORT+1)) > $OUT/node1-dpa.log 2>&1 &
N1=$!
CUDA_VISIBLE_DEVICES=0 timeout 100 $BIN eval-logits --device cuda --model-path $M --prompts $P --out /tmp/mn-dpa.st \
  --max-new-tokens 24 --tp 2 --dp 2 --enable-dp-attention --nnodes 2 --node-rank 0 --dist-init-addr 127.0.0.1:$((PORT+1)) > $OUT/node0-dpa.log 2>&1
rc0=$?; wait $N1; rc1=$?
$CMP /tmp/v2-dpa2.st /tmp/mn-dpa.st --tol 1e-6 --near-tie 0 > $OUT/multinode-dpa.txt; note "two nodes DP attention (rc $rc0/$rc1) vs one process: rc=$? $(tail -1 $OUT/multinode-dpa.txt)"
# A node that never arrives.
timeout 60 $BIN eval-logits --device cuda --model-path $M --prompts $P --out /tmp/x.st --tp 2 --nnodes 2 --node-rank 0 \
  --dist-init-addr 127.0.0.1:$((PORT+2)) --dist-timeout 5 > $OUT/timeout.log 2>&1
note "missing node: rc=$? $(grep -o 'error:.*' $OUT/timeout.log | head -c 300)"

# Decode throughput, V2-Lite shape, dummy weights: TP 2 against DP attention over the same 2 GPUs.
for B in $BATCHES; do
  for L in "--tp 2" "--tp 2 --dp 2 --enable-dp-attention"; do
    guard 150 $BIN bench-one-batch --device cuda --model-path tools/bench/deepseek-v2-lite --load-format dummy --batch-size $B \
      --input-len 128 --output-len $OUTLEN --log-level warning $L > $OUT/bench-$B-${L// /_}.log 2>&1
    note "bench B=$B $L: $(grep -E 'prefill:|decode:' $OUT/bench-$B-${L// /_}.log | tr -s ' ' | tr '\n' ' ')"
  done
done
note "hangs: $hangs"
printf '%s\n' "${summary[@]}" > $OUT/summary.txt
echo; echo "==== summary"; cat $OUT/summary.txt
