#!/usr/bin/env bash
# One request at a time through the server (V2-Lite shape, dummy weights), with the one-launch attention of one
# decode token (the default) and without: median TPOT / ITL and output tok/s of bench-serving.
# usage: tools/device/serve_b1.sh BIN_DIR MODEL_WITH_TOKENIZER (e.g. .devcarry/fin/bin .devcarry/v2lite-tok)
source tools/device/bench_env.sh
B=$1/mlaserve; M=$2
for e in "-" "MLASERVE_MLA_ONE_TOKEN=0"; do
  vars=; [ "$e" != "-" ] && vars=$e
  PORT=30$((RANDOM % 400 + 100))
  env $vars $B serve --model-path $M --load-format dummy --port $PORT --disable-radix-cache > /tmp/s.log 2>&1 &
  SPID=$!
  for i in $(seq 90); do python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:$PORT/health',timeout=2)" 2>/dev/null && break; sleep 1; done
  timeout 120 $B bench-serving --backend sglang --host 127.0.0.1 --port $PORT --dataset-name random-ids --random-input 128 --random-output 512 --random-range-ratio 1 --num-prompts 4 --max-concurrency 1 --warmup-requests 1 > /tmp/b.log 2>&1
  echo "== [$e] rc=$? $(grep -iE 'median tpot|median itl|output token throughput' /tmp/b.log | tr -s ' ' | tr '\n' '|')"
  kill $SPID; wait $SPID 2>/dev/null
done
