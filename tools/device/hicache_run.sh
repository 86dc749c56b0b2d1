#!/usr/bin/env bash
# The hierarchical cache on the GPU: time to first token of a long prompt run again after others pushed it out of the
# device's pool (tools/device/hicache_bench.py), served with the host tier and without (V2-Lite shape, dummy weights,
# token ids through /generate).
# usage: tools/device/hicache_run.sh BIN_DIR [PROMPT_TOKENS] [POOL_TOKENS]
source tools/device/bench_env.sh
B=$1/mlaserve; N=${2:-16000}; POOL=${3:-40000}
for flags in "--enable-hierarchical-cache" ""; do
  PORT=30$((RANDOM % 400 + 100))
  $B serve --model-path tools/bench/deepseek-v2-lite --load-format dummy --skip-tokenizer-init --port $PORT \
    --max-total-tokens $POOL $flags > /tmp/hs.log 2>&1 &
  SPID=$!
  serve_up $PORT $SPID /tmp/hs.log || continue
  echo "== [${flags:-no host tier}] $(grep -E 'host tier' /tmp/hs.log | sed 's/.*info\] //')"
  timeout 300 python3 tools/device/hicache_bench.py $PORT $N 2 3
  python3 -c "import json,urllib.request;u='http://127.0.0.1:$PORT/get_server_info'
s=json.load(urllib.request.urlopen(u))['internal_states'][0]
print({k: v for k, v in s.items() if 'host' in k or 'cached' in k})"
  kill $SPID; wait $SPID 2>/dev/null
done
