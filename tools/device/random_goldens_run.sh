#!/usr/bin/env bash
# Random tiny configs made golden families for the CPU suite (tests/golden/data/random/sSEED-fuzzK): each SEED:K is
# config K of tools/device/config_fuzz.py's seed SEED (the same config as in its runs), saved as a sharded bf16
# checkpoint with Hugging Face's reference (tools/golden/make_golden.py), checked by eval-logits on the CPU and the
# GPU, then packed into $OUT/random.tar.xz (config, shards, index, reference per family: the device tool brings back
# a few files only) for `tar -C tests/golden/data/random -xJf random.tar.xz`.
# usage (device, .devcarry carried: x/bin from pack.sh with mlaserve, lib):
#   bash tools/device/random_goldens_run.sh SEED:K...
set -u
B=.devcarry/x/bin
[ -f $B/mlaserve.xz ] && xz -d -f $B/mlaserve.xz
chmod +x $B/mlaserve
source tools/device/bench_env.sh
for spec in "$@"; do
  seed=${spec%%:*} k=${spec##*:}
  root=/tmp/rg$seed
  FUZZ_ONLY=$k timeout 300 python3 tools/device/config_fuzz.py "$B/mlaserve" "$root" $((k + 1)) "$seed" cpu,cuda 2>&1 |
    tail -3
  dest=/tmp/random_goldens/s$seed-fuzz$k
  mkdir -p "$dest"
  cp "$root/fuzz$k"/config.json "$root/fuzz$k"/model*.safetensors* "$root/fuzz$k"/reference.safetensors "$dest/"
done
du -sh /tmp/random_goldens/*
tar -C /tmp/random_goldens -cJf "$OUT/random.tar.xz" .
