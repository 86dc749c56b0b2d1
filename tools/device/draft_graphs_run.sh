#!/usr/bin/env bash
# Steps checking n-gram drafts through CUDA graphs, on the device: the model's graph tests (the drafts case among
# them: graph replay against the eager forward), the served e2e tests of speculative decoding and the FP8 cache
# against a CUDA server, then tools/device/spec_run.sh with an earlier build and this one (ms per output token on
# looping and free outputs, without drafts and with 4 / 8), and batch 1 / 256 decode without drafts.
# usage: [TESTS=0] [DECODE=0] tools/device/draft_graphs_run.sh PKG_DIR [OLD_BIN_DIR]
#   (binaries in PKG_DIR/bin; OLD_BIN_DIR holds an earlier mlaserve; TESTS=0 / DECODE=0 skip the tests / batch decode)
set -uo pipefail
P=$1/bin; OLD=${2:-}
source tools/device/bench_env.sh
e2e_env $P
if [ "${TESTS:-1}" = 1 ]; then
  gtest_run model 300 $P/cuda_model_test '*Graph*'
  grep -E "drafts step" /tmp/model.log
  gtest_run e2e 300 $P/server_e2e_test 'ServeFlags.Ngram*:ServeFlags.Fp8*'
fi
export MLASERVE_GPU_IDLE_STATS=1  # the servers log their graph and eager steps at exit (the last: 8 drafts)
for b in $OLD $P; do  # (no OLD: this build alone)
  echo "=== spec_run $b"
  bash tools/device/spec_run.sh $b
  grep -oE "[0-9]+ graph steps with .* eager steps" /tmp/spec_server.log | tail -1
done
unset MLASERVE_GPU_IDLE_STATS
[ "${DECODE:-1}" = 1 ] && for bs in 1 256; do
  timeout -s KILL 100 $P/mlaserve $BOB --output-len 64 --batch-size $bs > /tmp/b.log 2>&1
  echo "== b$bs: $(grep -E '^  decode' /tmp/b.log)"
done
