#!/usr/bin/env bash
# One device call for the CUDA backend (run from the repo root on the GPU machine, with .devcarry/cuda carried):
# GPU op tests, real-dims golden generation (HF), model tests + eval-logits against every golden family, kernel
# micro-benchmarks, bench-one-batch on the V2-Lite shape and the Hugging Face peer. Logs go to $OUT.
# usage: tools/device/cuda_run.sh [sections...]   (default: all of: bench ops golden model eval perf hf)
set -o pipefail
D=.devcarry/cuda
B=$D/pkg/bin
export LD_LIBRARY_PATH=$PWD/$D/pkg/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
S=$(date +%s)
t() { echo "=== [t+$(( $(date +%s) - S ))s] $*"; }
want() { [ -z "$SECTIONS" ] || [[ " $SECTIONS " == *" $1 "* ]]; }
SECTIONS="$*"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader
mkdir -p /tmp/golden && cp -r tests/golden/data/* /tmp/golden/
if want golden; then
  (timeout 240 python3 $D/tools/make_golden.py /tmp/golden real16 real128 > $OUT/golden_gen.log 2>&1
   echo "golden gen rc=$?" >> $OUT/golden_gen.log) &
  GEN=$!
fi
if want bench; then
  t kernel bench; timeout 120 $B/cuda_kernel_bench all 2>&1 | tee $OUT/kernel_bench.log
  best=$(awk '/^best_mla_variant/{print $2}' $OUT/kernel_bench.log)
  [ -n "$best" ] && export MLASERVE_MLA_DECODE_VARIANT=$best && echo "using MLA decode variant $best"
fi
if want ops; then
  t ops tests; timeout 240 $B/cuda_ops_test > $OUT/ops_test.log 2>&1; echo "ops_test rc=$?"
  grep -E "^\[  (FAILED|PASSED) |FAILED  \]|Failure|error" $OUT/ops_test.log | head -30
fi
[ -n "${GEN:-}" ] && { t waiting for golden generation; wait $GEN; tail -3 $OUT/golden_gen.log; }
if want model; then
  t model tests; MLASERVE_GOLDEN_DIR=/tmp/golden timeout 240 $B/cuda_model_test > $OUT/model_test.log 2>&1
  echo "model_test rc=$?"; grep -E "max\|dlogit|FAILED|PASSED|Failure" $OUT/model_test.log | head -40
fi
if want eval; then
  t eval-logits
  for f in v2lite v2 v3 real16 real128; do
    [ -f /tmp/golden/$f/reference.safetensors ] || continue
    echo "-- $f"
    timeout 120 $B/mlaserve eval-logits --device cuda --mem-fraction-static 0.3 --model-path /tmp/golden/$f \
      --prompts /tmp/golden/$f/reference.safetensors --out /tmp/$f.out.safetensors --max-new-tokens 24 \
      > /tmp/eval_$f.log 2>&1 || { echo "eval-logits $f failed"; tail -3 /tmp/eval_$f.log; continue; }
    python3 $D/tools/compare_logits.py /tmp/golden/$f/reference.safetensors /tmp/$f.out.safetensors --tol 0.06 --near-tie 0.1
  done 2>&1 | tee $OUT/eval.log
fi
M="$B/mlaserve bench-one-batch --model-path $D/tools/deepseek-v2-lite --load-format dummy --device cuda"
if want perf; then
  t perf
  { timeout 150 $M --batch-size 256 --input-len 1024 --output-len 16
    timeout 100 $M --batch-size 16 --input-len 1024 --output-len 1
    echo "(grouped MoE kernels forced for the prefill:)"
    MLASERVE_MOE_GROUPED=1 timeout 100 $M --batch-size 16 --input-len 1024 --output-len 1
    timeout 100 $M --batch-size 256 --input-len 128 --output-len 16; } 2>&1 | tee $OUT/perf.log | grep -vE "^\[.*info\] loading"
fi
if want hf; then
  t hf; timeout 240 python3 $D/tools/hf_bench.py $D/tools/deepseek-v2-lite --prefill 16 1024 --decode 256 128 16 2>&1 \
    | grep -v Warning | tee $OUT/hf.log
fi
t done
echo "================ summary"
grep -hE "^(device copy|mla_decode|moe T|best)" $OUT/kernel_bench.log 2>/dev/null | cut -c1-230
grep -hE "routing flips|routing forced|dummy prompt" $OUT/model_test.log 2>/dev/null
grep -hE "tests, listed|PASSED|FAILED" $OUT/ops_test.log $OUT/model_test.log 2>/dev/null | head
grep -hE "^(-- |prompt)" $OUT/eval.log 2>/dev/null | grep -E "^--|FAIL" | head -20
grep -hE "bench-one-batch:|prefill:|decode:|grouped MoE" $OUT/perf.log 2>/dev/null
grep -hE "^hf" $OUT/hf.log 2>/dev/null
