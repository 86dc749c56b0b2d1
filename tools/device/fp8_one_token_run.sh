#!/usr/bin/env bash
# The one-token attention kernel over an FP8 latent cache, on the device: the op tests (one launch against the ops
# and the CPU, FP8 and bf16), the model's graph and one-token tests, the serve-flag e2e tests against a CUDA server
# (FP8 cache, n-gram drafts, priority scheduling and preemption), and batch-1 decode with an FP8 cache, an earlier
# build against this one (two rounds), plus this one with the bf16 cache.
# usage: tools/device/fp8_one_token_run.sh PKG_DIR OLD_BIN_DIR   (binaries in PKG_DIR/bin; OLD_BIN_DIR/mlaserve)
set -uo pipefail
P=$1/bin; OLD=$2
source tools/device/bench_env.sh
export MLASERVE_GOLDEN_DIR=$PWD/tests/golden/data MLASERVE_E2E_BINARY=$PWD/$P/mlaserve MLASERVE_E2E_ROOT=$PWD \
  MLASERVE_E2E_TOKENIZER=$PWD/.devcarry/tok MLASERVE_E2E_DEVICE=cuda
timeout -s KILL 240 $P/cuda_ops_test --gtest_filter='*MlaOneToken*:*MlaPrepareAttention*' > /tmp/ops.log 2>&1
echo "== ops rc=$? $(grep -cE '^\[       OK' /tmp/ops.log) ok $(grep -E 'FAILED  \]|Failure' /tmp/ops.log | head -4 | tr '\n' ' ')"
timeout -s KILL 240 $P/cuda_model_test --gtest_filter='*Graph*:*OneToken*' > /tmp/model.log 2>&1
echo "== model rc=$? $(grep -cE '^\[       OK' /tmp/model.log) ok $(grep -E 'FAILED  \]' /tmp/model.log | tr '\n' ' ')"
timeout -s KILL 300 $P/server_e2e_test --gtest_filter='ServeFlags.Fp8*:ServeFlags.Ngram*:ServeFlags.Priority*' \
  > /tmp/e2e.log 2>&1
echo "== e2e rc=$? $(grep -cE '^\[       OK' /tmp/e2e.log) ok $(grep -E 'FAILED  \]|Failure' /tmp/e2e.log | head -3 | tr '\n' ' ')"
for round in 1 2; do for b in $OLD $P; do
  timeout -s KILL 100 $b/mlaserve $BOB --output-len 64 --batch-size 1 --kv-cache-dtype fp8_e4m3 > /tmp/b.log 2>&1
  echo "== b1 fp8 cache $b: $(grep -E '^  decode' /tmp/b.log)"
done; done
timeout -s KILL 100 $P/mlaserve $BOB --output-len 64 --batch-size 1 > /tmp/b.log 2>&1
echo "== b1 bf16 cache $P: $(grep -E '^  decode' /tmp/b.log)"
