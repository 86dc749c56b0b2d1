#!/usr/bin/env bash
# Decode attention of 128 heads over pages of 16 rows as a server allocates them (docs/perf.md, forty-fifth session):
# one server per setting of the V2-dims 4-layer model (tools/bench/deepseek-v2-4l, dummy weights, vocabulary widened
# to the DeepSeek-V3 tokenizer's for random ids), bench-serving with long outputs so that most pages are taken
# while decoding: MLASERVE_MLA_PAGE_RUNS=0 (a TMA box per page), the default (one box per tile over consecutive
# pages), and --page-size 64.
# usage (device, .devcarry carried: x/bin with mlaserve, lib, tok): bash tools/device/page_runs_run.sh
set -u
B=.devcarry/x/bin
source tools/device/bench_env.sh
M=/tmp/v2-4l
mkdir -p $M
python3 -c "import json; c = json.load(open('tools/bench/deepseek-v2-4l/config.json')); c['vocab_size'] = 129280; \
json.dump(c, open('$M/config.json', 'w'))"
IN=${IN:-2048} OUTLEN=${OUTLEN:-1024} N=${N:-128}
for setting in "MLASERVE_MLA_PAGE_RUNS=0|" "MLASERVE_MLA_PAGE_RUNS=1|" "MLASERVE_MLA_PAGE_RUNS=1|--page-size 64"; do
  var=${setting%|*} extra=${setting#*|}
  PORT=32$((RANDOM % 400 + 100))
  env $var $B/mlaserve serve --model-path $M --load-format dummy --skip-tokenizer-init --port $PORT \
    --cuda-graph-max-bs $N $extra > /tmp/s.log 2>&1 &
  SPID=$!
  serve_up $PORT $SPID /tmp/s.log || continue
  timeout 200 $B/mlaserve bench-serving --backend sglang --host 127.0.0.1 --port $PORT --dataset-name random-ids \
    --tokenizer .devcarry/tok --random-input $IN --random-output $OUTLEN --random-range-ratio 1 --num-prompts $N \
    --max-concurrency $N > /tmp/b.log 2>&1
  rc=$?
  got=$(grep -iE 'output token throughput|median tpot|successful' /tmp/b.log | tr -s ' ' | tr '\n' '|')
  echo "== [$var $extra] rc=$rc: $got"
  kill -INT $SPID; wait $SPID 2>/dev/null
done
