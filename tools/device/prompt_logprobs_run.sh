#!/usr/bin/env bash
# Device check of prompt logprobs on the served V2-Lite shape (dummy weights, real tokenizer): for each server
# configuration, tools/device/prompt_logprobs_check.py compares one request's prompt logprobs (700 ids: two chunks of
# at most 512 logit rows) with the first-token distributions of requests of its prefixes.
# usage: tools/device/prompt_logprobs_run.sh PKG_DIR MODEL_WITH_TOKENIZER
set -uo pipefail
PKG=$1; TOKM=$2
source tools/device/bench_env.sh
BIN=$PKG/bin/mlaserve
for X in "default:" "no-overlap-chunk128:--disable-overlap-schedule --chunked-prefill-size 128" "no-graphs:--disable-cuda-graph"; do
  n=${X%%:*}; f=${X#*:}
  PORT=30$((RANDOM % 400 + 100))
  $BIN serve --model-path $TOKM --load-format dummy --port $PORT $f > /tmp/pl-$n.log 2>&1 &
  SPID=$! UP=0
  until python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:$PORT/health',timeout=2)" 2>/dev/null; do
    sleep 1; UP=$((UP + 1)); if [ $UP -gt 90 ] || ! kill -0 $SPID 2>/dev/null; then echo "== $n: no server: $(tail -2 /tmp/pl-$n.log)"; kill -9 $SPID; continue 2; fi
  done
  echo "== $n ($f, up in ${UP}s): $(timeout 120 python3 tools/device/prompt_logprobs_check.py $PORT --len 700 2>&1 | tail -1)"
  kill -TERM $SPID; t=0; while kill -0 $SPID 2>/dev/null && [ $t -lt 20 ]; do sleep 1; t=$((t + 1)); done; kill -9 $SPID 2>/dev/null
done
