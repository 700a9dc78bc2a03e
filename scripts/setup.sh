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
  python3-venv         # the openai client for the server tests (.venv)
)

# The server tests (label `server`) drive `plow serve` with the official `openai` Python client, from
# PyPI into a repo-local virtual environment (.venv, git-ignored). Skipped when already importable.
setup_python_client() {
  local root venv
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  venv="$root/.venv"
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import openai' 2>/dev/null; then
    echo "setup: openai client present ($venv)"
    return
  fi
  echo "setup: installing the openai Python client into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check 'openai>=1.40,<3'
}

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all packages present"
  setup_python_client
  exit 0
fi

sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
setup_python_client
