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
export MLASERVE_GOLDEN_DIR=$PWD/tests/golden/data MLASERVE_E2E_BINARY=$PWD/$P/mlaserve MLASERVE_E2E_ROOT=$PWD \
  MLASERVE_E2E_TOKENIZER=$PWD/.devcarry/tok MLASERVE_E2E_DEVICE=cuda
if [ "${TESTS:-1}" = 1 ]; then
timeout -s KILL 300 $P/cuda_model_test --gtest_filter='*Graph*' > /tmp/model.log 2>&1
echo "== model rc=$? $(grep -cE '^\[       OK' /tmp/model.log) ok $(grep -E 'FAILED  \]' /tmp/model.log | tr '\n' ' ')"
grep -E "drafts step" /tmp/model.log
timeout -s KILL 300 $P/server_e2e_test --gtest_filter='ServeFlags.Ngram*:ServeFlags.Fp8*' > /tmp/e2e.log 2>&1
echo "== e2e rc=$? $(grep -cE '^\[       OK' /tmp/e2e.log) ok $(grep -E 'FAILED  \]|Failure' /tmp/e2e.log | head -3 | tr '\n' ' ')"
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
