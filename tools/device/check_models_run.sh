#!/usr/bin/env bash
# Random tiny DeepSeek configs against Hugging Face on the GPU, judged with the CPU's routing forced: for each seed,
# tools/device/config_fuzz.py makes N random bf16 checkpoints with their references (its own lines compare the GPU's
# free-running routing: near-tied experts flip now and then), then `cuda_model_test --gtest_filter=*GoldenCheckModels`
# checks every one of them (prefill logits with routing forced; decode steps fed the reference's tokens, alone and
# together, with routing forced: logits and picks) and `*GraphReplayMatchesEagerCheckModels` replays their decode
# steps (and steps checking drafts) through CUDA graphs against the eager steps (FP8 experts kept and dequantized).
# With FP8=1 the checkpoints are also made FP8 (block sizes 16-128) and checked against Hugging Face on the
# torch-dequantized weights (FUZZ_FP8_REF=dequantized: transformers' FP8 loader reads partial edge blocks otherwise
# than DeepSeek's weight_dequant, docs/perf.md, thirty-eighth session).
# Logs under $OUT; prints per seed the worst decode and prefill errors (of the logits' std).
# usage (device, .devcarry carried: BIN_DIR with mlaserve and cuda_model_test, lib):
#   [FP8=1] bash tools/device/check_models_run.sh BIN_DIR N SEED...
set -u
B=$1 N=$2; shift 2
source tools/device/bench_env.sh
export MLASERVE_GOLDEN_DIR=$PWD/tests/golden/data
OUT=${OUT:-/tmp}
for seed in "$@"; do
  root=/tmp/check$seed suffix=""
  if [ "${FP8:-0}" = 1 ]; then
    export FUZZ_FP8=block FUZZ_FP8_REF=dequantized
    suffix=-fp8
  fi
  timeout 300 python3 tools/device/config_fuzz.py "$B/mlaserve" "$root" "$N" "$seed" cuda > "$OUT/fuzz$seed.log" 2>&1
  grep -E "^configs" "$OUT/fuzz$seed.log"
  models=$(for d in "$root"/fuzz*$suffix; do [ -f "$d/reference.safetensors" ] && echo -n "$d,"; done | sed 's/,$//')
  MLASERVE_CHECK_MODELS=$models timeout 300 "$B/cuda_model_test" \
    --gtest_filter='*GoldenCheckModels:*GraphReplayMatchesEagerCheckModels' > "$OUT/check$seed.log" 2>&1
  echo "seed $seed: rc=$? over $(echo "$models" | tr ',' '\n' | grep -c .) checkpoints"
  grep -E "Failure" -A3 "$OUT/check$seed.log" | head -12
  echo "  worst decode step (teacher forced): $(grep -E 'fed the' "$OUT/check$seed.log" | awk '{print $(NF-7)}' |
    sort -g | tail -1) worst prefill position: $(grep -E 'routing forced [0-9]' "$OUT/check$seed.log" |
    awk '{print $(NF-13)}' | sort -g | tail -1)"
  echo "  graph steps replayed: $(grep -c 'graph vs eager' "$OUT/check$seed.log"), tests:" \
    "$(grep -E '^\[  (PASSED|FAILED)' "$OUT/check$seed.log" | tr '\n' ' ')"
done
