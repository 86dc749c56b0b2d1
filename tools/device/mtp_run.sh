#!/usr/bin/env bash
# MTP drafts (speculative decoding with the checkpoint's MTP layer) on the device: the GPU model tests (the MTP layer
# against Hugging Face parts, eager and after a graph replay), the speculative-decoding and server e2e tests against a
# CUDA server, then what the MTP layer costs a step: one request at a time through the server (V2-Lite shape plus an
# MTP layer and the DeepSeek-V3 tokenizer's vocabulary, dummy weights, so drafts are almost never kept), without
# drafts and with EAGLE, median TPOT and the accepted drafts. `probe` runs the bench with the engine thread's phases and
# the GPU's idle time between steps logged at shutdown (MLASERVE_ENGINE_STATS=1, MLASERVE_GPU_IDLE_STATS=1), and EAGLE
# without overlap scheduling too. `golden` first makes the v3mtp golden family again (tools/golden/make_mtp_golden.py:
# its weights must be the repository's, its reference.safetensors goes to the tests and to $OUT), then runs the tests.
# usage: tools/device/mtp_run.sh PKG_DIR [tests|bench|probe|golden]   (binaries in PKG_DIR/bin; default tests, bench)
set -uo pipefail
source tools/device/bench_env.sh
P=$1/bin
e2e_env $P
mode=${2:-}
if [ "$mode" = golden ]; then
  python3 tools/golden/make_mtp_golden.py /tmp/gold > /tmp/gold.log 2>&1 || { tail -20 /tmp/gold.log; exit 1; }
  tail -4 /tmp/gold.log
  G=tests/golden/data/v3mtp
  for f in $G/*.safetensors $G/config.json $G/model.safetensors.index.json; do
    b=$(basename $f)
    [ $b = reference.safetensors ] && continue
    cmp -s $f /tmp/gold/v3mtp/$b || { echo "== $b differs from the repository's: not taken"; exit 1; }
  done
  cp /tmp/gold/v3mtp/reference.safetensors $G/
  tar -C /tmp/gold -cf ${OUT:-/tmp}/v3mtp_reference.tar v3mtp/reference.safetensors
  mode=tests
fi
if [ -z "$mode" ] || [ "$mode" = tests ]; then
  gtest_run model 300 $P/cuda_model_test '*'
  grep -E "v3mtp" /tmp/model.log
  gtest_run ops 120 $P/cuda_ops_test 'CudaOps.ElementwiseOps:CudaOps.Sample*'
  # (ServerE2E's npm client and bench-serving tests need this machine's npm packages and build folder)
  env_only=ServerE2E.OpenAINpmClient:ServerE2E.BenchServingPrintsTheMetricBlock
  gtest_run e2e 420 $P/server_e2e_test "ServeFlags.Mtp*:ServeFlags.Ngram*:ServerE2E.*-$env_only"
  [ -z "$mode" ] || exit 0
fi
M=/tmp/v2lite-mtp
mkdir -p $M
python3 -c "import json; c = json.load(open('tools/bench/deepseek-v2-lite/config.json')); \
c['num_nextn_predict_layers'] = 1; c['vocab_size'] = 129280; json.dump(c, open('$M/config.json', 'w'))"
specs=("" "--speculative-algorithm EAGLE --speculative-num-steps 1"
       "--speculative-algorithm EAGLE --speculative-num-steps 3")
vars=()
if [ "$mode" = probe ]; then
  specs+=("--speculative-algorithm EAGLE --disable-overlap-schedule")
  vars=(MLASERVE_ENGINE_STATS=1 MLASERVE_GPU_IDLE_STATS=1)
fi
for spec in "${specs[@]}"; do
  PORT=31$((RANDOM % 400 + 100))
  env "${vars[@]}" $P/mlaserve serve --model-path $M --load-format dummy --skip-tokenizer-init --port $PORT \
    --disable-radix-cache $spec > /tmp/s.log 2>&1 &
  SPID=$!
  serve_up $PORT $SPID /tmp/s.log || continue
  timeout 150 $P/mlaserve bench-serving --backend sglang --host 127.0.0.1 --port $PORT --dataset-name random-ids \
    --tokenizer .devcarry/tok --random-input 128 --random-output 512 --random-range-ratio 1 --num-prompts 4 \
    --max-concurrency 1 --warmup-requests 1 > /tmp/b.log 2>&1
  rc=$?
  got=$(grep -iE 'median tpot|output token throughput' /tmp/b.log | tr -s ' ' | tr '\n' '|')
  echo "== [${spec:-no drafts}] rc=$rc $got"
  python3 -c "import json, urllib.request; \
s = json.load(urllib.request.urlopen('http://127.0.0.1:$PORT/get_server_info'))['internal_states'][0]; \
print('   spec', {k: v for k, v in s.items() if 'spec' in k})"
  kill -INT $SPID; wait $SPID 2>/dev/null
  [ "$mode" = probe ] && grep -iE "idle|engine thread" /tmp/s.log | tail -4
done
exit 0
