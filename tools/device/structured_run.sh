#!/usr/bin/env bash
# Device check of constrained decoding: the GPU sampler's masks against the CPU sampler (cuda_ops_test), then the
# V2-Lite shape (dummy weights, the real tokenizer) served with graphs and overlap scheduling on and off:
# structured_check.py's regex / mixed / json_schema requests; the sequential greedy outputs of the two servers compared
# (concurrent ones may differ: other batch shapes).
# usage: tools/device/structured_run.sh PKG_DIR MODEL_WITH_TOKENIZER
set -uo pipefail
PKG=$1 M=$2
source tools/device/bench_env.sh
timeout -s KILL 200 $PKG/bin/cuda_ops_test --gtest_filter='*Sample*' > /tmp/ops.log 2>&1
echo "== ops rc=$? $(grep -cE '^\[       OK' /tmp/ops.log) ok; $(grep -E 'FAILED  \]|Failure' /tmp/ops.log | head -5 | tr '\n' ' ')"
for mode in overlap no-overlap; do
  PORT=30$((RANDOM % 400 + 100)); extra=; [ $mode = no-overlap ] && extra=--disable-overlap-schedule
  $PKG/bin/mlaserve serve --model-path $M --load-format dummy --port $PORT --cuda-graph-max-bs 8 $extra \
    > /tmp/serve-$mode.log 2>&1 &
  SPID=$!
  for i in $(seq 120); do python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:$PORT/health',timeout=2)" 2>/dev/null && break; sleep 1; done
  timeout 200 python3 tools/device/structured_check.py $PORT > /tmp/sc-$mode.json 2> /tmp/sc-$mode.err
  echo "== $mode rc=$?: $(head -c 1500 /tmp/sc-$mode.json) $(tail -3 /tmp/sc-$mode.err)"
  kill -TERM $SPID; wait $SPID 2>/dev/null
done
python3 - <<'PY'
import json
a, b = (json.load(open(f"/tmp/sc-{m}.json")) for m in ("overlap", "no-overlap"))
greedy = lambda o: [r["text"] for r in o["regex"] if r["seed"] == 0] + [o["chat"][0]["content"]]  # sequential
print("== regex whole matches:", sum(r["match"] for o in (a, b) for r in o["regex"]), "of", 2 * len(a["regex"]),
      "| mixed ok:", a["mixed_ok"], b["mixed_ok"], "| greedy outputs overlap == no-overlap:", greedy(a) == greedy(b))
PY
