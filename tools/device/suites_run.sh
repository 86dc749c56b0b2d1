#!/usr/bin/env bash
# The GPU suites on one GPU in one call: cuda_ops_test (without the 29 s V2-Lite MoE case), cuda_model_test, the e2e
# suites against CUDA servers (no npm clients: no node there; fuzz at 300 requests per connection), bench-one-batch
# at batch 1 and 256, one prompt of 4K and of 32K tokens prefilled (prefill_run.sh); with CHECK_SEED, random configs.
# Logs under $OUT.
# usage (device, .devcarry carried: x/bin from pack.sh with mlaserve and the four test binaries, lib, tok):
#   bash tools/device/suites_run.sh
set -u
B=.devcarry/x/bin
for f in $B/*.xz .devcarry/tok/*.xz; do [ -f "$f" ] && xz -d -f "$f"; done
chmod +x $B/*
source tools/device/bench_env.sh
e2e_env $B
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
date -u
gtest_run ops 300 $B/cuda_ops_test '-*V2LiteShape*'
gtest_run model 90 $B/cuda_model_test '*'
gtest_run e2e 240 $B/server_e2e_test '*:-*Npm*'
grep -E '^\[  SKIPPED|^\[  FAILED' /tmp/e2e.log | head -12
MLASERVE_FUZZ_REQUESTS=300 gtest_run fuzz 120 $B/fuzz_e2e_test '*'
date -u
for bs in 1 256; do
  timeout 90 $B/mlaserve $BOB --batch-size $bs --output-len 128 2>&1 | grep -iE "decode|tok/s" | tail -2
done
LENS="4096 32768" BIN=$B bash tools/device/prefill_run.sh  # one long prompt's prefill (docs/perf.md, 41st session)
# CHECK_SEED=S: also 12 random configs of seed S against Hugging Face, routing forced (check_models_run.sh, ~1.5 min).
[ -n "${CHECK_SEED:-}" ] && bash tools/device/check_models_run.sh $B 12 "$CHECK_SEED"
date -u
cp /tmp/*.log $OUT/ 2>/dev/null
