# Sourced by the device benchmark scripts: the libraries packed with the binaries (LIB, default .devcarry/lib; its
# libicudata is kept xz-compressed to fit the carry limit) and BOB, the batch-decode benchmark every A/B runs
# (V2-Lite shape, dummy weights, 128-token prompts; add --output-len and --batch-size; BOB_MODEL=DIR another model
# folder, BOB_ARGS more options).
LIB=${LIB:-.devcarry/lib}
[ -f $LIB/libicudata.so.72.xz ] && xz -d -k -f $LIB/libicudata.so.72.xz
export LD_LIBRARY_PATH=$PWD/$LIB:${LD_LIBRARY_PATH:-}
BOB="bench-one-batch --device cuda --model-path ${BOB_MODEL:-tools/bench/deepseek-v2-lite} ${BOB_ARGS:-} --load-format dummy --input-len 128 --log-level info"
# serve_up PORT PID LOG: waits up to 120 s for the server's /health; 1 (and the log's tail printed) if it died first.
serve_up() {
  local up=0
  until python3 -c "import urllib.request;urllib.request.urlopen('http://127.0.0.1:$1/health',timeout=2)" 2>/dev/null; do
    sleep 1
    up=$((up + 1))
    if [ $up -gt 120 ] || ! kill -0 "$2" 2>/dev/null; then echo "== no server: $(tail -2 "$3")"; return 1; fi
  done
}
# gtest_run NAME SECONDS BINARY FILTER: one test binary (killed after SECONDS) into /tmp/NAME.log; prints
# "== NAME rc=R N ok" and its first failures.
gtest_run() {
  timeout -s KILL "$2" "$3" --gtest_filter="$4" > "/tmp/$1.log" 2>&1
  local rc=$? ok failed
  ok=$(grep -cE '^\[       OK' "/tmp/$1.log")
  failed=$(grep -E 'FAILED  \]|Failure' "/tmp/$1.log" | head -5 | tr '\n' ' ')
  echo "== $1 rc=$rc $ok ok $failed"
}
# e2e_env BIN_DIR: the environment of the e2e tests (and the golden data) for the mlaserve in BIN_DIR.
e2e_env() {
  export MLASERVE_GOLDEN_DIR=$PWD/tests/golden/data MLASERVE_E2E_BINARY=$PWD/$1/mlaserve MLASERVE_E2E_ROOT=$PWD \
    MLASERVE_E2E_TOKENIZER=$PWD/.devcarry/tok MLASERVE_E2E_DEVICE=cuda
}
