#!/usr/bin/env bash
# Expert distribution recording on the GPU (thirty-second session): the count kernel against the CPU reference, the
# recorder through a CUDA server (graphs, three requests batched into a padded graph), bench-one-batch's counts of
# padded graph steps, and decode at batch 1 / 64 with the recorder off and on.
# usage (device, after the carry): bash tools/device/expert_record_run.sh [BIN_DIR]
set -u
B=${1:-.devcarry/x/bin}
for f in $B/*.xz .devcarry/tok/*.xz; do [ -f "$f" ] && xz -d -f "$f"; done
chmod +x $B/*
source tools/device/bench_env.sh
e2e_env $B
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
gtest_run ops 180 $B/cuda_ops_test 'CudaOps.CountExperts:CudaOps.MoeRoute*:CudaOps.MoeGate*'
gtest_run e2e 400 $B/server_e2e_test 'ServeFlags.ExpertDistributionRecord:ServeFlags.UpdateWeightsFromDisk'
gtest_run model 400 $B/cuda_model_test \
  'CudaModel.Graph*:CudaModel.ReloadedWeights*:CudaModel.OneTokenGraph*:CudaModel.GoldenV3'
for bs in 1 64; do
  for rec in "" "--expert-distribution-recorder-mode stat"; do
    echo "== batch $bs recorder '$rec'"
    $B/mlaserve $BOB --batch-size $bs --output-len 256 $rec 2>&1 | grep -E "decode:|experts:"
  done
done
echo "== batch 3 (graphs of 4: a padding row) with the recorder"
$B/mlaserve $BOB --batch-size 3 --output-len 64 --expert-distribution-recorder-mode stat 2>&1 |
  grep -E "decode:|experts:"
grep -E "Failure|Expected|Which is|actual" /tmp/e2e.log /tmp/ops.log /tmp/model.log | head -20
