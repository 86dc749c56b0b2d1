#!/usr/bin/env bash
# FP8 block checkpoints of config_fuzz.py's random tiny configs (block sizes 16-128 per config, partial edge blocks)
# against Hugging Face on the GPU machine: first with the reference made from the torch-dequantized weights
# (DeepSeek's block reading, make_fp8_golden.py --dequantized-reference), then from transformers' FineGrainedFP8
# loader; mlaserve on the CPU and the GPU, experts kept FP8 and dequantized. One line per config and run.
# usage: tools/device/fp8_fuzz_run.sh BIN_DIR [N] [SECONDS_EACH]   (BIN_DIR holds mlaserve; bench_env.sh sourced)
set -u
B=$1
N=${2:-24}
T=${3:-240}
R=$PWD
export FUZZ_FP8=block FUZZ_VARIANTS="--fp8-experts on;--fp8-experts off"
for ref in dequantized hf; do
  echo "== reference: $ref"
  if [ "$ref" = dequantized ]; then export FUZZ_FP8_REF=dequantized; else unset FUZZ_FP8_REF; fi
  FUZZ_SECONDS=$T timeout $((T + 120)) python3 -u "$R/tools/device/config_fuzz.py" "$R/$B/mlaserve" "/tmp/fz-$ref" \
    "$N" 1 cuda,cpu 2>&1 | grep -E "^fuzz|^configs" | cut -c1-400
done
