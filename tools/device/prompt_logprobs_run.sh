#!/usr/bin/env bash
# Device check of prompt logprobs: the golden family v2 served (ids only) against Hugging Face's logits at every
# prompt position (tools/device/prompt_logprobs_golden.py), and on the served V2-Lite shape (dummy weights, real
# tokenizer) one request's prompt logprobs (700 ids: two chunks of at most 512 logit rows) against the first-token
# distributions of requests of its prefixes (tools/device/prompt_logprobs_check.py); each in three configurations.
# usage: tools/device/prompt_logprobs_run.sh PKG_DIR MODEL_WITH_TOKENIZER
set -uo pipefail
PKG=$1; TOKM=$2
source tools/device/bench_env.sh
BIN=$PKG/bin/mlaserve
# The engine's own logits at every prompt position (offline: all five prompts in one prefill batch).
$BIN eval-logits --device cuda --model-path tests/golden/data/v2 --prompts tests/golden/data/v2/reference.safetensors \
  --max-new-tokens 0 --out /tmp/pl-eval.st --log-level warning || echo "== eval-logits failed"
for X in "default:" "no-overlap-chunk128:--disable-overlap-schedule --chunked-prefill-size 128" "no-graphs:--disable-cuda-graph"; do
  n=${X%%:*}; f=${X#*:}
  for M in golden dummy; do
  PORT=30$((RANDOM % 400 + 100))
  if [ $M = golden ]; then
    $BIN serve --model-path tests/golden/data/v2 --skip-tokenizer-init --port $PORT $f > /tmp/pl-$n.log 2>&1 &
  else
    $BIN serve --model-path $TOKM --load-format dummy --port $PORT $f > /tmp/pl-$n.log 2>&1 &
  fi
  SPID=$! UP=0
  until python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:$PORT/health',timeout=2)" 2>/dev/null; do
    sleep 1; UP=$((UP + 1)); if [ $UP -gt 90 ] || ! kill -0 $SPID 2>/dev/null; then echo "== $n: no server: $(tail -2 /tmp/pl-$n.log)"; kill -9 $SPID; continue 2; fi
  done
  if [ $M = golden ]; then
    echo "== $n golden v2 vs HF:"; timeout 120 python3 tools/device/prompt_logprobs_golden.py $PORT tests/golden/data/v2/reference.safetensors 2>&1 | tail -5
    echo "== $n golden v2 vs eval-logits on this GPU:"; timeout 120 python3 tools/device/prompt_logprobs_golden.py $PORT tests/golden/data/v2/reference.safetensors /tmp/pl-eval.st 2>&1 | tail -5
  else
    echo "== $n dummy V2-Lite ($f, up in ${UP}s): $(timeout 120 python3 tools/device/prompt_logprobs_check.py $PORT --len 700 2>&1 | tail -1)"
  fi
  kill -TERM $SPID; t=0; while kill -0 $SPID 2>/dev/null && [ $t -lt 20 ]; do sleep 1; t=$((t + 1)); done; kill -9 $SPID 2>/dev/null
  done
done
