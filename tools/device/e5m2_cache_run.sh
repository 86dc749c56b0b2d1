#!/usr/bin/env bash
# The E5M2 latent cache on the device: the full GPU suites (E4M3 and E5M2 cases), the FP8-cache, n-gram and priority
# serve-flag e2e tests against a CUDA server, then bench-one-batch decode (V2-Lite shape, dummy weights) over a bf16,
# an E4M3 and an E5M2 cache: batch 1 and 256 of 128-token prompts, and 128 x 4096 tokens.
# usage: tools/device/e5m2_cache_run.sh PKG_DIR [tests|bench]   (binaries in PKG_DIR/bin; default both)
set -uo pipefail
source tools/device/bench_env.sh
P=$1/bin
e2e_env $P
if [ "${2:-tests}" = tests ]; then
  gtest_run ops 240 $P/cuda_ops_test '*'
  gtest_run model 240 $P/cuda_model_test '*'
  gtest_run e2e 300 $P/server_e2e_test 'ServeFlags.Fp8*:ServeFlags.Ngram*:ServeFlags.Priority*'
  [ -z "${2:-}" ] || exit 0
fi
for bs in 1 256; do for kv in auto fp8_e4m3 fp8_e5m2; do
  timeout -s KILL 100 $P/mlaserve $BOB --output-len 64 --batch-size $bs --kv-cache-dtype $kv > /tmp/b.log 2>&1
  echo "== b$bs x128 kv $kv: $(grep -E '^  decode' /tmp/b.log)"
done; done
for kv in auto fp8_e4m3 fp8_e5m2; do
  timeout -s KILL 100 $P/mlaserve bench-one-batch --device cuda --model-path tools/bench/deepseek-v2-lite \
    --load-format dummy --input-len 4096 --output-len 32 --batch-size 128 --kv-cache-dtype $kv > /tmp/b.log 2>&1
  echo "== 128x4096 kv $kv: $(grep -E '^  decode' /tmp/b.log)"
done
