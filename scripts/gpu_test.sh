#!/usr/bin/env bash
# The one command to run on a GPU machine: Ninja build, every GPU test, a short FP8
# training run of gpt2-124m on mock data, and (with --bench) the benchmark table.
#   scripts/gpu_test.sh            # build + GPU tests + training run
#   scripts/gpu_test.sh --bench    # ... + benchmarks (fp8lm fp8/bf16 and the PyTorch peer)
#   scripts/gpu_test.sh --bench-only
# Logs go to $OUT when set (the device tool's output folder), else to build-gpu/logs.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
logs=${OUT:-$repo/build-gpu/logs}
mkdir -p "$logs"
mode=${1:-tests}
export NCCL_NVLS_ENABLE=0
export PATH=/usr/local/cuda/bin:$PATH

step() { echo; echo "==== $*"; }
status=0

step "build (Ninja, $(nproc) jobs)"
if [ ! -f build-gpu/build.ninja ]; then
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
    > "$logs/configure.log" 2>&1 || { tail -30 "$logs/configure.log"; exit 1; }
fi
ninja -C build-gpu > "$logs/build.log" 2>&1 || { grep -E "error|FAILED" -A5 "$logs/build.log" | head -80; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if [ "$mode" != "--bench-only" ]; then
  step "GPU tests"
  timeout 420 build-gpu/tests/fp8lm_tests "[gpu]~[.bench]" --durations yes > "$logs/gpu_tests.log" 2>&1 || status=1
  grep -E "FAILED|with expansion|test cases|assertions|passed| s: " "$logs/gpu_tests.log" | tail -60

  step "training: gpt2-124m, FP8 hybrid, mock data, 60 steps"
  timeout 120 build-gpu/fp8lm --config configs/gpt2-124m.json --fp8-hybrid --mock-data --micro-batch-size 16 --seq-length 1024 \
    --train-iters 60 --lr 6e-4 --lr-warmup-iters 10 --log-interval 10 --eval-interval 0 --eval-iters 4 \
    --metrics-file "$logs/train_124m_fp8.jsonl" > "$logs/train_124m_fp8.log" 2>&1 || status=1
  grep -E "iter|done|error" "$logs/train_124m_fp8.log" | tail -12
fi

if [ "$mode" = "--bench" ] || [ "$mode" = "--bench-only" ]; then
  step "benchmarks: gpt2-124m and gpt2-1558m, fp8lm FP8 and BF16 and the PyTorch peer (scripts/bench_device.sh)"
  scripts/bench_device.sh 124m:32,1558m:8 || status=1
fi
exit $status
