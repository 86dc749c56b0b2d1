#!/usr/bin/env bash
# The one-token attention kernel over an FP8 latent cache, on the device: the op tests (one launch against the ops
# and the CPU, FP8 and bf16), the model's graph and one-token tests, the serve-flag e2e tests against a CUDA server
# (FP8 cache, n-gram drafts, priority scheduling and preemption), and batch-1 decode with an FP8 cache, an earlier
# build against this one (two rounds), plus this one with the bf16 cache.
# usage: tools/device/fp8_one_token_run.sh PKG_DIR OLD_BIN_DIR   (binaries in PKG_DIR/bin; OLD_BIN_DIR/mlaserve)
set -uo pipefail
P=$1/bin; OLD=$2
source tools/device/bench_env.sh
e2e_env $P
gtest_run ops 240 $P/cuda_ops_test '*MlaOneToken*:*MlaPrepareAttention*'
gtest_run model 240 $P/cuda_model_test '*Graph*:*OneToken*'
gtest_run e2e 300 $P/server_e2e_test 'ServeFlags.Fp8*:ServeFlags.Ngram*:ServeFlags.Priority*'
for round in 1 2; do for b in $OLD $P; do
  timeout -s KILL 100 $b/mlaserve $BOB --output-len 64 --batch-size 1 --kv-cache-dtype fp8_e4m3 > /tmp/b.log 2>&1
  echo "== b1 fp8 cache $b: $(grep -E '^  decode' /tmp/b.log)"
done; done
timeout -s KILL 100 $P/mlaserve $BOB --output-len 64 --batch-size 1 > /tmp/b.log 2>&1
echo "== b1 bf16 cache $P: $(grep -E '^  decode' /tmp/b.log)"
