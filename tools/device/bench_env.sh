# Sourced by the device benchmark scripts: the libraries packed with the binaries (LIB, default .devcarry/lib; its
# libicudata is kept xz-compressed to fit the carry limit) and BOB, the batch-decode benchmark every A/B runs
# (V2-Lite shape, dummy weights, 128-token prompts; add --output-len and --batch-size; BOB_MODEL=DIR another model
# folder, BOB_ARGS more options).
LIB=${LIB:-.devcarry/lib}
[ -f $LIB/libicudata.so.72.xz ] && xz -d -k -f $LIB/libicudata.so.72.xz
export LD_LIBRARY_PATH=$PWD/$LIB:${LD_LIBRARY_PATH:-}
BOB="bench-one-batch --device cuda --model-path ${BOB_MODEL:-tools/bench/deepseek-v2-lite} ${BOB_ARGS:-} --load-format dummy --input-len 128 --log-level info"
