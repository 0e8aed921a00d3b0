#!/usr/bin/env bash
# The CPU test suite under AddressSanitizer and UndefinedBehaviorSanitizer, in build-sanitize/
# (a Debug build with -fsanitize=address,undefined; any report fails the test that made it).
#   scripts/sanitize.sh              # every test
#   scripts/sanitize.sh -R checkpoint   # extra arguments go to ctest
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
FP8LM_SKIP_APT=${FP8LM_SKIP_APT:-0} scripts/setup.sh > /dev/null  # packages, and the normal build for the tools
export PATH=/usr/local/cuda/bin:$PATH
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
[ -f build-sanitize/CMakeCache.txt ] || cmake -S . -B build-sanitize "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DFP8LM_SANITIZE=ON -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc > /dev/null
cmake --build build-sanitize -j "$(nproc)"
# protect_shadow_gap=0: the CUDA runtime maps memory where ASan's shadow gap would be.
# Leaks are checked; lsan.supp names the libraries whose process-lifetime state is not ours.
export LSAN_OPTIONS=suppressions=$repo/scripts/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
cd build-sanitize
# The tests that run under mpirun: Open MPI's components are dlopen()ed and unloaded at
# MPI_Finalize, so LeakSanitizer reports their ~116 KB of process-lifetime state from an
# "<unknown module>" that no suppression can name. Those tests are checked for every
# address and undefined-behaviour error, without the leak check; all others with it. A test
# that launches mpirun says so in its name ("under mpirun"), or is one of the older ones below.
mpi_tests='mpi_|mpirun|every parallel layout|resumes at TP=1|fp8lm_rank_'
status=0
ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1:halt_on_error=1 \
  ctest --output-on-failure -j "$(nproc)" -E "$mpi_tests" "$@" || status=1
ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0:halt_on_error=1 \
  ctest --output-on-failure -j "$(nproc)" -R "$mpi_tests" "$@" || status=1
exit $status
