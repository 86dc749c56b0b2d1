#!/usr/bin/env bash
# The Kimi-shaped golden families on one GPU (forty-sixth session, never run: no device could be started):
# make_golden.py kimi kimi64 in the background while the e2e suite runs against a CUDA server, then
# cuda_model_test on them (+ GoldenV3 and graph replay), batch 1. kimi.tgz comes back under $OUT: unpack it into
# tests/golden/data and add "kimi" to golden_model_test.cpp's families.
# usage (device, .devcarry carried: x/bin from pack.sh with mlaserve, cuda_model_test, server_e2e_test; lib; tok):
#   bash tools/device/kimi_goldens_run.sh
set -u
(timeout 240 python3 tools/golden/make_golden.py tests/golden/data kimi kimi64 > /tmp/gen.log 2>&1
 echo "gen rc=$?" >> /tmp/gen.log) &
GEN=$!
B=.devcarry/x/bin; for f in $B/*.xz .devcarry/tok/*.xz; do [ -f $f ] && xz -d -f $f; done; chmod +x $B/*
source tools/device/bench_env.sh
e2e_env $B
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
gtest_run e2e 170 $B/server_e2e_test '*:-*Npm*'
grep -E '^\[  SKIPPED|^\[  FAILED' /tmp/e2e.log | head -8
wait $GEN; grep -vE "^\(|^kimi" /tmp/gen.log | tail -3; date -u
(cd tests/golden/data && tar czf $OUT/kimi.tgz kimi)
gtest_run model 80 $B/cuda_model_test '*Kimi*:*GoldenV3:*GraphReplayMatchesEager'
grep -E "kimi|routing flips" /tmp/model.log | head -8
echo "bs 1: $(timeout 45 $B/mlaserve $BOB --batch-size 1 --output-len 128 2>&1 | grep -iE 'decode' | tail -1)"
date -u
tar czf $OUT/logs.tgz /tmp/*.log 2>/dev/null
