#!/usr/bin/env bash
# Installs the Debian packages plow builds against. Idempotent, non-interactive, runs as root
# (or through sudo when not root). Skips apt entirely when everything is already present.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  nlohmann-json3-dev   # JSON (config.json, safetensors headers, CLI output)
  libcli11-dev         # command-line parsing
  libspdlog-dev libfmt-dev  # logging
  libgtest-dev libgmock-dev # tests
  libpcre2-dev         # tokenizer pre-tokenizer regexes (Unicode classes)
  libcpp-httplib-dev   # HTTP server
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all packages present"
  exit 0
fi

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
