#!/usr/bin/env bash
# Greedy tokens with and without n-gram speculative decoding on the GPU (V2-Lite shape, dummy weights, ids only):
# tools/device/spec_check.py compares them request by request (first difference, the top-2 margin there).
# usage: tools/device/spec_check.sh BIN_DIR [MODEL_DIR]
source tools/device/bench_env.sh
B=$1/mlaserve; M=${2:-tools/bench/deepseek-v2-lite}
start() {  # PORT FLAGS...
  local port=$1; shift
  $B serve --model-path $M --load-format dummy --device cuda --skip-tokenizer-init --port $port --disable-radix-cache \
    --mem-fraction-static 0.4 "$@" > /tmp/spec_server_$port.log 2>&1 &
  for i in $(seq 120); do
    python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:$port/health',timeout=2)" 2>/dev/null && return
    sleep 1
  done
}
start 31201; P1=$!
start 31202 --speculative-algorithm NGRAM --speculative-num-draft-tokens 4; P2=$!
for allowed in 1000,1001,1002 -; do
  echo "== allowed $allowed: drafts against none"
  timeout 200 python3 tools/device/spec_check.py 31201 31202 4 128 $allowed || tail -5 /tmp/spec_server_31202.log
  echo "== allowed $allowed, no drafts: alone against in a batch of 4"
  timeout 200 python3 tools/device/spec_check.py 31201 31201 4 128 $allowed || tail -5 /tmp/spec_server_31201.log
done
kill $P1 $P2; wait
