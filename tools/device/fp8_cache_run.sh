#!/usr/bin/env bash
# Device check of the FP8 latent cache (--kv-cache-dtype fp8_e4m3): the GPU op tests (writes and every attention
# path against the CPU reference on the same codes), graphs vs eager with an FP8 cache, the decode kernel's stream
# rate (cuda_kernel_bench mla 7: bf16, mla 9: FP8), V2-Lite (dummy weights) served with graphs + overlap on and off
# over an FP8 cache (the same greedy ids expected), and bench-one-batch decode at long context, bf16 vs FP8 cache.
# usage: tools/device/fp8_cache_run.sh PKG_DIR [quick]
set -uo pipefail
PKG=$1
source tools/device/bench_env.sh
export MLASERVE_GOLDEN_DIR=$PWD/tests/golden/data
gtest_run ops 240 $PKG/bin/cuda_ops_test '*Mla*:*RopeAndLatent*'
grep -E "fp8 cache" /tmp/ops.log | sort | uniq | head -40
gtest_run model 200 $PKG/bin/cuda_model_test '*Graph*'
grep -E "fp8 cache" /tmp/model.log | head -10
for v in 7 9; do timeout -s KILL 60 $PKG/bin/cuda_kernel_bench mla $v 2>&1 | head -3; done
[ "${2:-}" = quick ] && exit 0
for mode in graphs eager; do
  PORT=30$((RANDOM % 400 + 100))
  extra=""; [ $mode = eager ] && extra="--disable-cuda-graph --disable-overlap-schedule"
  $PKG/bin/mlaserve serve --model-path tools/bench/deepseek-v2-lite --load-format dummy --skip-tokenizer-init \
    --port $PORT --kv-cache-dtype fp8_e4m3 $extra > /tmp/serve-$mode.log 2>&1 &
  SPID=$!
  serve_up $PORT $SPID /tmp/serve-$mode.log
  timeout 120 python3 tools/device/served_ids.py $PORT 32 1 7 40 130 700 > /tmp/ids-$mode.json 2>&1
  echo "== served fp8 cache, $mode: $(grep -o 'KV cache per rank: [0-9]* tokens' /tmp/serve-$mode.log | head -1) $(head -c 100 /tmp/ids-$mode.json)"
  kill -TERM $SPID; sleep 2; kill -9 $SPID 2>/dev/null
done
echo "== served greedy ids graphs+overlap vs eager: $(cmp -s /tmp/ids-graphs.json /tmp/ids-eager.json && echo IDENTICAL || echo DIFFERENT)"
for kv in auto fp8_e4m3; do
  timeout -s KILL 200 $PKG/bin/mlaserve bench-one-batch --device cuda --model-path tools/bench/deepseek-v2-lite \
    --load-format dummy --input-len 4096 --output-len 32 --batch-size 128 --kv-cache-dtype $kv --log-level info \
    > /tmp/bob-$kv.log 2>&1
  echo "== bench-one-batch 128 x 4096, kv $kv: $(grep -iE 'KV cache|decode' /tmp/bob-$kv.log | tail -3 | tr '\n' ' ')"
done
