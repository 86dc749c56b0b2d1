#!/usr/bin/env bash
# N-gram speculative decoding on the GPU: one request at a time through the server (V2-Lite shape, dummy weights,
# ids only), without drafts and with 4 / 8 draft tokens, on outputs that loop (3 allowed tokens) and on free
# outputs; tools/device/spec_bench.py prints tok/s, the accept length and a digest of the outputs (equal across runs).
# usage: tools/device/spec_run.sh BIN_DIR [MODEL_DIR]
source tools/device/bench_env.sh
B=$1/mlaserve; M=${2:-tools/bench/deepseek-v2-lite}
for flags in "" "--speculative-algorithm NGRAM --speculative-num-draft-tokens 4" \
             "--speculative-algorithm NGRAM --speculative-num-draft-tokens 8"; do
  PORT=31$((RANDOM % 400 + 100))
  $B serve --model-path $M --load-format dummy --device cuda --skip-tokenizer-init --port $PORT \
    --disable-radix-cache $flags > /tmp/spec_server.log 2>&1 &
  SPID=$!
  for i in $(seq 120); do
    python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:$PORT/health',timeout=2)" 2>/dev/null && break
    sleep 1
  done
  echo "== [${flags:-no drafts}]"
  for allowed in 1000,1001,1002 -; do
    timeout 300 python3 tools/device/spec_bench.py $PORT 4 256 $allowed || tail -5 /tmp/spec_server.log
  done
  kill $SPID; wait $SPID 2>/dev/null
done
