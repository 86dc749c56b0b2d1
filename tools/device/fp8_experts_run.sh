#!/usr/bin/env bash
# Device check of FP8 experts kept quantized: the GPU tests (the dequant kernel against the CPU reference, moe_experts
# on FP8 experts against their dequantized bf16, the v3-fp8 golden family kept vs dequantized at load and against
# Hugging Face), then the v3-fp8 family served with graphs and overlap, --fp8-experts on vs off:
# the same greedy ids (sequential requests, so both servers run the same steps).
# usage: tools/device/fp8_experts_run.sh PKG_DIR
set -uo pipefail
PKG=$1
source tools/device/bench_env.sh
export MLASERVE_GOLDEN_DIR=$PWD/tests/golden/data
gtest_run ops 200 $PKG/bin/cuda_ops_test '*Fp8*:CudaOps.MoeExpertsSmall'
gtest_run model 200 $PKG/bin/cuda_model_test '*Fp8*:*GoldenV2:*GoldenV3'
grep -E "v3-fp8|weights:" /tmp/model.log | head -12
for mode in kept dequantized; do
  PORT=30$((RANDOM % 400 + 100))
  f8=on; [ $mode = dequantized ] && f8=off
  $PKG/bin/mlaserve serve --model-path tests/golden/data/v3-fp8 --skip-tokenizer-init --port $PORT --cuda-graph-max-bs 8 --fp8-experts $f8 > /tmp/serve-$mode.log 2>&1 &
  SPID=$!
  serve_up $PORT $SPID /tmp/serve-$mode.log
  timeout 120 python3 tools/device/served_ids.py $PORT 24 1 7 40 130 > /tmp/ids-$mode.json 2>&1
  echo "== served $mode: $(grep -o 'loaded checkpoint weights: [0-9.]* GiB' /tmp/serve-$mode.log) $(head -c 120 /tmp/ids-$mode.json)"
  kill -TERM $SPID; sleep 2; kill -9 $SPID 2>/dev/null
done
echo "== served greedy ids kept vs dequantized: $(cmp -s /tmp/ids-kept.json /tmp/ids-dequantized.json && echo IDENTICAL || echo DIFFERENT)"
