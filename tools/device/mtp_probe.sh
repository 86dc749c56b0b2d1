#!/usr/bin/env bash
# Where a step checking an MTP draft spends its time: mtp_run.sh's served batch-1 decode (V2-Lite shape plus an MTP
# layer, dummy weights) with the engine thread's phases and the GPU's idle time between steps logged at shutdown
# (MLASERVE_ENGINE_STATS=1, MLASERVE_GPU_IDLE_STATS=1): no drafts, EAGLE, EAGLE without overlap scheduling.
# usage: tools/device/mtp_probe.sh   (binaries in .devcarry/mtp/bin, the tokenizer in .devcarry/tok)
set -uo pipefail
source tools/device/bench_env.sh
P=.devcarry/mtp/bin; M=/tmp/v2lite-mtp; mkdir -p $M
python3 -c "import json; c = json.load(open('tools/bench/deepseek-v2-lite/config.json')); \
c['num_nextn_predict_layers'] = 1; c['vocab_size'] = 129280; json.dump(c, open('$M/config.json', 'w'))"
for spec in "" "--speculative-algorithm EAGLE" "--speculative-algorithm EAGLE --disable-overlap-schedule"; do
  PORT=31$((RANDOM % 400 + 100))
  MLASERVE_ENGINE_STATS=1 MLASERVE_GPU_IDLE_STATS=1 $P/mlaserve serve --model-path $M --load-format dummy \
    --skip-tokenizer-init --port $PORT --disable-radix-cache $spec > /tmp/s.log 2>&1 &
  SPID=$!
  serve_up $PORT $SPID /tmp/s.log || continue
  timeout 150 $P/mlaserve bench-serving --backend sglang --host 127.0.0.1 --port $PORT --dataset-name random-ids \
    --tokenizer .devcarry/tok --random-input 128 --random-output 512 --random-range-ratio 1 --num-prompts 4 \
    --max-concurrency 1 --warmup-requests 1 > /tmp/b.log 2>&1
  echo "== [${spec:-no drafts}] rc=$? $(grep -iE 'median tpot' /tmp/b.log | tr -s ' ' | tr '\n' '|')"
  kill -INT $SPID; wait $SPID 2>/dev/null
  grep -iE "idle|phase|engine thread|schedule|per step" /tmp/s.log | tail -6
done
