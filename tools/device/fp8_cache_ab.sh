#!/usr/bin/env bash
# FP8 latent cache on the device, the full GPU suites and the A/B of docs/perf.md: cuda_ops_test, cuda_model_test,
# the FP8 serve flags test, then bench-one-batch decode (V2-Lite shape, dummy weights) with a bf16 and an FP8 cache:
# 128 x 4096 tokens (two prompt seeds), and batch 1 / 256 of 128-token prompts.
# usage: tools/device/fp8_cache_ab.sh [PKG_DIR]   (default .devcarry/kv; binaries in PKG_DIR/bin)
source tools/device/bench_env.sh
P=${1:-.devcarry/kv}/bin
e2e_env $P
gtest_run ops 200 $P/cuda_ops_test '*'
gtest_run model 200 $P/cuda_model_test '*'
gtest_run e2e 120 $P/server_e2e_test 'ServeFlags.Fp8*'
for kv in auto fp8_e4m3; do for seed in 1 2; do
  timeout -s KILL 100 $P/mlaserve bench-one-batch --device cuda --model-path tools/bench/deepseek-v2-lite --load-format dummy --input-len 4096 --output-len 32 --batch-size 128 --kv-cache-dtype $kv --input-seed $seed > /tmp/b.log 2>&1
  echo "== 128x4096 kv $kv seed $seed: $(grep -E '^  decode' /tmp/b.log)"
done; done
for kv in auto fp8_e4m3; do for bs in 1 256; do
  timeout -s KILL 100 $P/mlaserve $BOB --output-len 64 --batch-size $bs --kv-cache-dtype $kv > /tmp/b.log 2>&1
  echo "== b$bs x128 kv $kv: $(grep -E '^  decode' /tmp/b.log)"
done; done
