#!/usr/bin/env bash
# Runs the test suite on any machine: sets up (packages, configure, build) when
# anything is missing or stale, then runs every test through ctest. GPU tests report
# SKIPPED where no GPU is present.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
"$repo/scripts/setup.sh"
cd build
ctest --output-on-failure -j "$(nproc)" "$@"
