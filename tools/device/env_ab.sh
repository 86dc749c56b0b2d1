#!/usr/bin/env bash
# Decode at small batches of one build under several environments, alternating (machines vary by a few percent).
# usage: LIB=.devcarry/lib tools/device/env_ab.sh BIN_DIR "ENV1" "ENV2" ...  (each ENV: "VAR=x VAR2=y" or "-" for
# none; ROUNDS=2 BATCHES="1")
set -uo pipefail
source "$(dirname "$0")/bench_env.sh"
BIN=$1; shift
L=/tmp/envab; mkdir -p $L
for r in $(seq ${ROUNDS:-2}); do
  for b in ${BATCHES:-1}; do
    for e in "$@"; do
      vars=; [ "$e" != "-" ] && vars=$e
      env $vars timeout -s KILL 60 $BIN/mlaserve $BOB --output-len 64 --batch-size $b > $L/run.log 2>&1
      echo "== [$e] b$b r$r rc=$?: $(grep -E 'decode:' $L/run.log | tr -s ' ')"
    done
  done
done
