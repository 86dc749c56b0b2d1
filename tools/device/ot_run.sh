#!/usr/bin/env bash
# The one-launch attention of one decode token (cuda::mla_one_token) on the GPU: its op and model tests (the real16
# golden family made here with HF), the whole ops suite, then decode at batch 1-2 with it on (the default) and off
# (MLASERVE_MLA_ONE_TOKEN=0), and one sequence decoding across its 1024-key bound (input 1000: the graph of the other
# side is recorded mid-run) and past it (input 2000).
# usage: tools/device/ot_run.sh BIN_DIR (mlaserve, cuda_ops_test, cuda_model_test; LIB as in bench_env.sh)
set -u
source "$(dirname "$0")/bench_env.sh"
P=$1
L=/tmp/ot; mkdir -p $L
# The real-dims golden family (16 heads, DeepSeek's MLA dims) is made here with HF, beside the ops tests.
export MLASERVE_GOLDEN_DIR=$PWD/tests/golden/data
(timeout 240 python3 tools/golden/make_golden.py $MLASERVE_GOLDEN_DIR real16 > $L/golden.log 2>&1
 echo "golden rc=$?" >> $L/golden.log) &
GEN=$!
timeout 120 $P/cuda_ops_test --gtest_filter='*MlaOneToken*:*MlaPrepareAttention*:*RopeAndLatent*' > $L/ops1.log 2>&1
echo "== one-token ops rc=$?"
grep -E "prepare\+attention|OK \]|FAILED|Failure|Expected|Which is" $L/ops1.log | head -40
timeout 150 $P/cuda_ops_test --gtest_filter=-*V2LiteShape* > $L/ops.log 2>&1
echo "== ops rc=$? $(grep -c '^\[       OK' $L/ops.log) ok $(grep 'FAILED  \]' $L/ops.log | tr '\n' ' ')"
wait $GEN; tail -1 $L/golden.log
timeout 120 $P/cuda_model_test --gtest_filter='*Graph*:*GoldenV2:*Idle*:*OneToken*' > $L/model.log 2>&1
echo "== model rc=$? $(grep -c '^\[       OK' $L/model.log) ok $(grep 'FAILED  \]' $L/model.log | tr '\n' ' ')"
grep -E "one-token decode|a step per token|graph vs eager" $L/model.log | head -30
grep -E "one-token attention|16 heads:" $L/ops1.log
timeout 60 $P/mlaserve $BOB --output-len 8 --batch-size 1 2>&1 | grep -E "one-token" | head -4
ROUNDS=2 BATCHES="1 2" bash "$(dirname "$0")/env_ab.sh" $P "-" "MLASERVE_MLA_ONE_TOKEN=0"
for il in 1000 2000; do
  for e in "-" "MLASERVE_MLA_ONE_TOKEN=0"; do
    vars=; [ "$e" != "-" ] && vars=$e
    env $vars timeout 60 $P/mlaserve ${BOB/--input-len 128/--input-len $il} --output-len 64 --batch-size 1 > $L/l.log 2>&1
    echo "== input $il [$e] rc=$?: $(grep -E 'decode:' $L/l.log | tr -s ' ')"
  done
done
