#!/usr/bin/env bash
# Long-prompt prefill on one GPU (V2-Lite shape, dummy weights): bench-one-batch's prefill of BS prompts (default 1)
# of each length in LENS in one step, once per environment setting in ENVS (default "-": none; e.g. ENVS="- X=1" for
# an A/B, alternating per length); with TRACE=LEN also a kernel trace of that length's run (warm-up and measured
# prefill both traced) summed by kernel (kernel_sums.py; needs .devcarry/lib/libkt.so and libcupti.so.13, see
# kernel_trace.cpp). Binaries from BIN (default .devcarry/x/bin, xz-compressed as packed).
# usage: [LENS="1024 4096"] [BS=1] [ENVS=...] [TRACE=16384] [BOB_ARGS=...] tools/device/prefill_run.sh
set -uo pipefail
B=${BIN:-.devcarry/x/bin}
for f in $B/*.xz .devcarry/lib/libcupti.so.13.xz; do [ -f "$f" ] && xz -d -f "$f"; done
chmod +x $B/*
source tools/device/bench_env.sh
BS=${BS:-1}
run() {  # run LEN [env...]: one bench-one-batch prefill of BS x LEN tokens
  local L=$1; shift
  timeout -s KILL 300 env "$@" $B/mlaserve bench-one-batch --device cuda \
    --model-path ${BOB_MODEL:-tools/bench/deepseek-v2-lite} --load-format dummy --batch-size $BS --input-len $L \
    --output-len 2 --max-prefill-tokens $((L * BS)) ${BOB_ARGS:-} --log-level warning 2>&1
}
for L in ${LENS:-1024 4096 16384 32768}; do
  for E in ${ENVS:--}; do
    [ "$E" = - ] && E=MLASERVE_NONE=1
    echo "== $BS x $L $E: $(run $L $E | grep -E 'prefill:|rror' | tr -s ' ' | head -3)"
  done
done
if [ -n "${TRACE:-}" ]; then
  run $TRACE KT_OUT=/tmp/kt.csv LD_PRELOAD=$PWD/.devcarry/lib/libkt.so |
    grep -E 'prefill:|kernel_trace|rror' | tr -s ' '
  python3 tools/device/kernel_sums.py /tmp/kt.csv ${TOP:-25}
fi
