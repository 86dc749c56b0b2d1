#!/usr/bin/env bash
# Packs built binaries for the GPU machine: copies them plus the shared libraries it lacks (spdlog, fmt, ...)
# into DEST (an ignored folder such as .devcarry/NAME, sent with the device tool's `carry`).
# There: `export LD_LIBRARY_PATH=$PWD/DEST/lib:$LD_LIBRARY_PATH` before running them.
# usage: tools/device/pack.sh DEST FILE...
set -euo pipefail
dest=$1; shift
mkdir -p "$dest/bin" "$dest/lib"
for f in "$@"; do
  cp -f "$f" "$dest/bin/"
  ldd "$f" | awk '/=> \//{print $3}' | { grep -E 'lib(spdlog|fmt|boost|pcre2|gtest|gmock|icuuc|icudata|icui18n|nccl)' || true; } | while read -r lib; do
    cp -fL "$lib" "$dest/lib/"
  done
done
du -sh "$dest"
