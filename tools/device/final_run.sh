#!/usr/bin/env bash
# The device proofs of graphs + parallel layouts in one bounded call (each step has its own limit and prints its
# result at once): GPU tests, eval-logits with graphs on / off in tp 1, tp 2 and DP attention 2/2 (and two
# processes as two nodes), bench-one-batch, and serve + bench-serving for --tp 2 against DP attention, with the GPU
# idle time between steps (MLASERVE_GPU_IDLE_STATS=1, logged by each backend at exit).
# Sections (all by default; set the others to 0 to skip): TESTS (GPU tests), EVAL (eval-logits, two nodes), BOB
# (bench-one-batch), OVERLAP (servers with overlap on vs off give the same greedy ids, per layout), SERVE (bench-serving
# + idle statistics). ONLY_SERVE=1 is SERVE alone. LAYOUTS: the OVERLAP layouts, space-separated names among tp1 tp2 dpa2
# (default all three; LAYOUTS=tp1 on one GPU). ROUTING (with two GPUs or more): DP attention's load balancing methods
# on SGLang's generated-shared-prefix workload (tools/bench/dp_routing.sh).
# usage: tools/device/final_run.sh PKG_DIR MODEL_WITH_TOKENIZER
#   PKG_DIR: tools/device/pack.sh DIR build-cuda/src/mlaserve build-cuda/tests/gpu/cuda_{ops,model,parallel}_test
#   (strip the binaries and xz libicudata to stay under the 64 MiB carry limit); MODEL_WITH_TOKENIZER: the V2-Lite
#   config.json (vocab_size 129280) with DeepSeek-V3's tokenizer.json / tokenizer_config.json from tests/npm.
set -uo pipefail
PKG=$1; TOKM=$2
[ -f $PKG/lib/libicudata.so.72.xz ] && xz -d -k -f $PKG/lib/libicudata.so.72.xz  # kept compressed for the carry limit
export LD_LIBRARY_PATH=$PWD/$PKG/lib:${LD_LIBRARY_PATH:-} NCCL_NVLS_ENABLE=0 MLASERVE_GOLDEN_DIR=$PWD/tests/golden/data
BIN=$PKG/bin/mlaserve
L=/tmp/final; mkdir -p $L
CMP="python3 tools/compare_logits.py"
lim() { local t=$1; shift; timeout -s KILL $t "$@"; }
echo "== gpus: $(nvidia-smi -L | wc -l)"
if [ "${ONLY_SERVE:-0}" = 1 ]; then TESTS=0 EVAL=0 BOB=0 OVERLAP=0 ROUTING=0; fi
if [ "${TESTS:-1}" = 1 ]; then
lim 150 $PKG/bin/cuda_ops_test --gtest_filter=-*V2LiteShape* > $L/ops.log 2>&1; echo "== ops rc=$? $(grep -cE '^\[       OK' $L/ops.log) ok; $(grep -E 'FAILED  \]' $L/ops.log | tr '\n' ' ')"
[ -x $PKG/bin/cuda_parallel_test ] && { lim 60 $PKG/bin/cuda_parallel_test > $L/par.log 2>&1; echo "== parallel (forced routing) rc=$? max|dlogit|/std $(grep -o 'std [0-9.e+-]* (routing forced)' $L/par.log | awk '{print $2}' | tr '\n' ' ') $(grep -E 'FAILED  \]' $L/par.log | tr '\n' ' ')"; }
lim 40 $PKG/bin/cuda_model_test --gtest_filter='*Graph*:*GoldenV2:*Idle*' > $L/model.log 2>&1; echo "== model rc=$? $(grep -E 'graph vs eager|FAILED  \]' $L/model.log | awk '{print $NF}' | tr '\n' ' ')"
grep -E 'routing forced' $L/par.log
fi
if [ "${EVAL:-1}" = 1 ]; then
M=tests/golden/data/v2; P=$M/reference.safetensors
EV="eval-logits --device cuda --model-path $M --prompts $P --max-new-tokens 24 --cuda-graph-max-bs 16 --log-level warning"
for X in "tp1:" "tp2:--tp 2" "dpa2:--tp 2 --dp 2 --enable-dp-attention"; do
  n=${X%%:*}; f=${X#*:}
  lim 40 $BIN $EV --out /tmp/$n-on.st $f > $L/$n-on.log 2>&1 || echo "== $n on FAILED $(tail -1 $L/$n-on.log)"
  lim 40 $BIN $EV --out /tmp/$n-off.st $f --disable-cuda-graph > $L/$n-off.log 2>&1 || echo "== $n off FAILED $(tail -1 $L/$n-off.log)"
  echo "== $n graphs on vs off (exact): $($CMP /tmp/$n-off.st /tmp/$n-on.st --tol 1e-6 --near-tie 0 2>&1 | grep -c ok)/5 prompts ok: $($CMP /tmp/$n-off.st /tmp/$n-on.st --tol 1e-6 --near-tie 0 2>&1 | grep -v ' ok' | tr '\n' '|')"
  [ $n != tp1 ] && echo "== $n vs tp1: $($CMP /tmp/tp1-off.st /tmp/$n-off.st --tol 0.1 2>&1 | tr '\n' '|')"
done
PORT=29$((RANDOM % 400 + 100))
CUDA_VISIBLE_DEVICES=1 lim 40 $BIN $EV --out /tmp/u.st --tp 2 --dp 2 --enable-dp-attention --nnodes 2 --node-rank 1 --dist-init-addr 127.0.0.1:$PORT > $L/n1.log 2>&1 &
CUDA_VISIBLE_DEVICES=0 lim 40 $BIN $EV --out /tmp/mn.st --tp 2 --dp 2 --enable-dp-attention --nnodes 2 --node-rank 0 --dist-init-addr 127.0.0.1:$PORT > $L/n0.log 2>&1; r0=$?; wait; 
echo "== two nodes DPA (rc $r0) vs one process: $($CMP /tmp/dpa2-on.st /tmp/mn.st --tol 1e-6 --near-tie 0 2>&1 | grep -c ok)/5 ok"
fi
if [ "${BOB:-1}" = 1 ]; then
BOB="bench-one-batch --device cuda --model-path tools/bench/deepseek-v2-lite --load-format dummy --input-len 128 --output-len 48 --cuda-graph-max-bs 1024 --log-level info"
for X in "1:1:" "1:256:" "2:256:--tp 2" "2:256:--tp 2 --dp 2 --enable-dp-attention" "2:1024:--tp 2" "2:1024:--tp 2 --dp 2 --enable-dp-attention"; do
  g=${X%%:*}; r=${X#*:}; b=${r%%:*}; f=${r#*:}; dev=0; [ $g = 2 ] && dev=0,1
  CUDA_VISIBLE_DEVICES=$dev MLASERVE_GPU_IDLE_STATS=1 lim 60 $BIN $BOB --batch-size $b $f > $L/bob.log 2>&1
  echo "== bob B=$b $f rc=$?: $(grep -E 'decode:' $L/bob.log | tr -s ' ') idle: $(grep -o 'idle between steps.*' $L/bob.log | head -1)"
done
fi
start_server() {  # log name, serve flags...: sets PORT and SPID, or returns 1
  local name=$1; shift
  PORT=30$((RANDOM % 400 + 100))
  MLASERVE_ENGINE_STATS=1 MLASERVE_GPU_IDLE_STATS=1 $BIN serve --model-path $TOKM --load-format dummy --port $PORT --disable-radix-cache "$@" > $L/serve-$name.log 2>&1 &
  SPID=$! UP=0
  until python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:$PORT/health',timeout=2)" 2>/dev/null; do
    sleep 1; UP=$((UP + 1)); if [ $UP -gt 60 ] || ! kill -0 $SPID 2>/dev/null; then echo "== $name: no server: $(tail -2 $L/serve-$name.log)"; kill -9 $SPID; return 1; fi
  done
}
stop_server() {
  local t=0; kill -TERM $SPID; while kill -0 $SPID 2>/dev/null && [ $t -lt 20 ]; do sleep 1; t=$((t + 1)); done; kill -9 $SPID 2>/dev/null
}
steps() { python3 -c "import urllib.request;print(' '.join(l for l in urllib.request.urlopen('http://127.0.0.1:$PORT/metrics').read().decode().splitlines() if 'steps_total' in l and not l.startswith('#')))"; }
if [ "${OVERLAP:-1}" = 1 ]; then
for X in "tp1:" "tp2:--tp 2" "dpa2:--tp 2 --dp 2 --enable-dp-attention"; do
  n=${X%%:*}; f=${X#*:}
  [[ " ${LAYOUTS:-tp1 tp2 dpa2} " == *" $n "* ]] || continue
  for mode in on off; do
    extra=""; [ $mode = off ] && extra="--disable-overlap-schedule"
    start_server ov-$n-$mode $f $extra --cuda-graph-max-bs 16 || continue
    lim 60 python3 tools/device/greedy_ids.py $PORT --n 6 --new 32 > /tmp/ov-$n-$mode.json 2> $L/ov-$n-$mode.err
    lim 60 python3 tools/device/greedy_ids.py $PORT --n 6 --new 32 --concurrent > /tmp/ovc-$n-$mode.json 2>> $L/ov-$n-$mode.err
    echo "== overlap $mode $n: $(steps)"
    lim 60 python3 tools/device/greedy_ids.py $PORT --n 6 --new 32 --penalties > /tmp/ovp-$n-$mode.json 2>> $L/ov-$n-$mode.err
    echo "== overlap $mode $n, after the penalised requests: $(steps)"
    lim 60 python3 tools/device/greedy_ids.py $PORT --n 6 --new 32 --top-logprobs > /tmp/ovt-$n-$mode.json 2>> $L/ov-$n-$mode.err
    lim 60 python3 tools/device/greedy_ids.py $PORT --n 6 --new 32 --top-logprobs --concurrent > /tmp/ovtc-$n-$mode.json 2>> $L/ov-$n-$mode.err
    echo "== overlap $mode $n, concurrent, half asking top logprobs: best alternative = the token in $(python3 tools/device/greedy_ids.py --check-top /tmp/ovtc-$n-$mode.json)"
    lim 60 python3 tools/device/greedy_ids.py $PORT --n 6 --new 32 --bias --concurrent > /tmp/ovb-$n-$mode.json 2>> $L/ov-$n-$mode.err
    echo "== overlap $mode $n, concurrent, half with logit_bias + min_new_tokens: expected tokens in $(python3 tools/device/greedy_ids.py --check-bias /tmp/ovb-$n-$mode.json)"
    stop_server
  done
  echo "== $n overlap on vs off, sequential greedy ids: $(cmp -s /tmp/ov-$n-on.json /tmp/ov-$n-off.json && echo IDENTICAL || echo DIFFERENT) ($(wc -c < /tmp/ov-$n-on.json) bytes); concurrent: $(cmp -s /tmp/ovc-$n-on.json /tmp/ovc-$n-off.json && echo identical || echo different); penalised (sequential): $(cmp -s /tmp/ovp-$n-on.json /tmp/ovp-$n-off.json && echo IDENTICAL || echo DIFFERENT), differ from plain greedy: $(cmp -s /tmp/ovp-$n-on.json /tmp/ov-$n-on.json && echo no || echo yes); with top logprobs: $(cmp -s /tmp/ovt-$n-on.json /tmp/ovt-$n-off.json && echo IDENTICAL || echo DIFFERENT) ($(wc -c < /tmp/ovt-$n-on.json) bytes); biased (concurrent): $(cmp -s /tmp/ovb-$n-on.json /tmp/ovb-$n-off.json && echo IDENTICAL || echo DIFFERENT)"
done
fi
serve_bench() {  # name, serve flags..., -- bench flags...
  local name=$1; shift; local s=() b=()
  while [ "$1" != -- ]; do s+=("$1"); shift; done; shift; b=("$@")
  local port=30$((RANDOM % 400 + 100))
  MLASERVE_ENGINE_STATS=1 MLASERVE_GPU_IDLE_STATS=1 $BIN serve --model-path $TOKM --load-format dummy --port $port --disable-radix-cache "${s[@]}" > $L/serve-$name.log 2>&1 &
  local pid=$! t=0
  until python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:$port/health',timeout=2)" 2>/dev/null; do
    sleep 1; t=$((t + 1)); if [ $t -gt 60 ] || ! kill -0 $pid 2>/dev/null; then echo "== $name: no server: $(tail -2 $L/serve-$name.log)"; kill -9 $pid; return; fi
  done
  lim 75 $BIN bench-serving --backend ${BACKEND:-sglang} --port $port --dataset-name random --random-range-ratio 1 "${b[@]}" > $L/bench-$name.log 2>&1
  echo "== $name (up in ${t}s) bench rc=$?: $(grep -iE 'throughput|Successful' $L/bench-$name.log | tr -s ' ' | tr '\n' '|')"
  PORT=$port; echo "== $name $(steps)"
  kill -TERM $pid; t=0; while kill -0 $pid 2>/dev/null && [ $t -lt 20 ]; do sleep 1; t=$((t + 1)); done; kill -9 $pid 2>/dev/null
  echo "== $name idle: $(grep -o 'GPU idle between steps.*' $L/serve-$name.log | tr '\n' '|')"
  echo "== $name engine: $(grep -o 'engine thread.*' $L/serve-$name.log)"
}
if [ "${ROUTING:-1}" = 1 ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  SERVE_FLAGS="--device cuda" GSP_FLAGS="--gsp-num-groups 32 --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048
    --gsp-question-len 128 --gsp-output-len 128 --max-concurrency 128" lim 420 tools/bench/dp_routing.sh $BIN $TOKM \
    $TOKM 31$((RANDOM % 400 + 100)) round_robin cache_aware > $L/routing.log 2>&1
  echo "== routing rc=$?: $(grep -E '==|Total token|Mean TTFT|cache_hit' $L/routing.log | tr -s ' ' | tr '\n' '|')"
fi
[ "${SERVE:-1}" = 1 ] || exit 0
# The same 1024 requests in flight in both layouts (--max-running-requests is per DP group).
serve_bench tp2 --tp 2 --max-running-requests 1024 --cuda-graph-max-bs 1024 -- --random-input 1 --random-output 512 --num-prompts 1024
serve_bench dpa2 --tp 2 --dp 2 --enable-dp-attention --max-running-requests 512 --cuda-graph-max-bs 512 -- --random-input 1 --random-output 512 --num-prompts 1024
# The same through the OpenAI completions stream (incremental chunks: less JSON per token than the native stream's
# cumulative text and ids).
BACKEND=sglang-oai serve_bench tp2-oai --tp 2 --max-running-requests 1024 --cuda-graph-max-bs 1024 -- --random-input 1 --random-output 512 --num-prompts 1024
BACKEND=sglang-oai serve_bench dpa2-oai --tp 2 --dp 2 --enable-dp-attention --max-running-requests 512 --cuda-graph-max-bs 512 -- --random-input 1 --random-output 512 --num-prompts 1024
CUDA_VISIBLE_DEVICES=0 serve_bench tp1-b256 --max-running-requests 256 -- --random-input 128 --random-output 128 --num-prompts 768
