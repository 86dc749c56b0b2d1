#!/usr/bin/env bash
# What constrained decoding costs a busy server: bench-serving (sglang backend, random ids, greedy, EOS ignored)
# against one server (V2-Lite shape, dummy weights, the real tokenizer), without a constraint and with
# sampling_params.regex "[a-z ]*" on every request (it never ends, so every request runs its full output).
# usage: tools/device/structured_bench.sh PKG_DIR MODEL_WITH_TOKENIZER
set -uo pipefail
PKG=$1 M=$2
source tools/device/bench_env.sh
PORT=30$((RANDOM % 400 + 100))
$PKG/bin/mlaserve serve --model-path $M --load-format dummy --port $PORT > /tmp/serve.log 2>&1 &
SPID=$!
for i in $(seq 120); do python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:$PORT/health',timeout=2)" 2>/dev/null && break; sleep 1; done
for extra in '{}' '{"sampling_params": {"regex": "[a-z ]*"}}'; do
  timeout 200 $PKG/bin/mlaserve bench-serving --backend sglang --host 127.0.0.1 --port $PORT --dataset-name random-ids \
    --random-input 128 --random-output 256 --random-range-ratio 1 --num-prompts 128 --max-concurrency ${CONC:-64} \
    --extra-request-body "$extra" > /tmp/b.log 2>&1
  echo "== $extra rc=$?: $(grep -iE 'output token throughput|median tpot|successful' /tmp/b.log | tr -s ' ' | tr '\n' '|')"
done
kill -TERM $SPID; wait $SPID 2>/dev/null
