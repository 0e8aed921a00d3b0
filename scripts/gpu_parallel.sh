#!/usr/bin/env bash
# Multi-GPU checks and figures on one node (nvidia-h200-x2 or larger), in one device call:
#   scripts/gpu_parallel.sh tests      build, the single-GPU tests, the NCCL tests, every
#                                      parallel layout against one GPU, the socket transport
#   scripts/gpu_parallel.sh bench      build, then the 2-GPU table at gpt2-1558m and the
#                                      PyTorch peer under torchrun (needs .carry/torch_gpt_bench.py)
#   scripts/gpu_parallel.sh all        both
#   scripts/gpu_parallel.sh dp         build, then data-parallel efficiency at gpt2-1558m: one GPU
#                                      against two with each overlapped gradient precision
#   scripts/gpu_parallel.sh final      build, the single-GPU and NCCL tests, the FP8 layouts against
#                                      one GPU, and the tensor-parallel and traffic rows at gpt2-774m
# Logs go to build-gpu/logs, and as one logs.tgz to $OUT when set.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
mode=${1:-all}
logs=$repo/build-gpu/logs
mkdir -p "$logs"
[ -n "${OUT:-}" ] && trap 'tar czf "$OUT/logs.tgz" -C "$logs" .' EXIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PATH=/usr/local/cuda/bin:$PATH
gpus=$(nvidia-smi -L | wc -l)
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none -x NCCL_NVLS_ENABLE=0 -x PATH -x LD_LIBRARY_PATH)
status=0
step() { echo; echo "==== $*"; }

step "build"
[ -f build-gpu/build.ninja ] || cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc > "$logs/configure.log" 2>&1 || { tail -20 "$logs/configure.log"; exit 1; }
ninja -C build-gpu > "$logs/build.log" 2>&1 || { grep -E "error|FAILED" -A5 "$logs/build.log" | head -60; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -4

compare() {  # reference metrics, then other metrics files: the largest relative loss gap of each
  python3 - "$@" <<'PY'
import json, sys
def losses(path):
    try:
        return [json.loads(l)["loss"] for l in open(path) if '"loss"' in l]
    except FileNotFoundError:
        return []
ref = losses(sys.argv[1])
for path in sys.argv[2:]:
    run = losses(path)
    n = min(len(ref), len(run))
    gap = max((abs(a - b) / abs(b) for a, b in zip(run, ref)), default=float("nan"))
    verdict = "ok" if n == len(ref) and n > 0 and gap < 2e-3 else "FAIL"
    print(f"{verdict:4s} {path.split('/')[-1]:40s} steps {n}/{len(ref)} largest relative gap {gap:.2e}")
PY
}

if [ "$mode" = tests ] || [ "$mode" = all ] || [ "$mode" = final ]; then
  step "single-GPU tests"
  CUDA_VISIBLE_DEVICES=0 timeout 420 build-gpu/tests/fp8lm_tests "[gpu]~[.bench]" > "$logs/gpu_tests.log" 2>&1 || status=1
  grep -E "FAILED|test cases|assertions" "$logs/gpu_tests.log" | tail -12

  step "multi-rank tests over NCCL ($gpus ranks)"
  timeout 300 "${mpi[@]}" -np "$gpus" build-gpu/tests/fp8lm_mpi_tests > "$logs/mpi_tests.log" 2>&1 || status=1
  grep -E "FAILED|test cases|assertions" "$logs/mpi_tests.log" | sort | uniq -c | tail -8

  step "every layout against one GPU: tiny model, 12 steps, over NCCL"
  tiny="--config configs/tiny.json --mock-data --device cuda --seq-length 64 --micro-batch-size 1 --global-batch-size 4
        --train-iters 12 --lr 3e-3 --lr-warmup-iters 2 --log-interval 1 --eval-interval 0 --eval-iters 0 --log-level warn"
  precisions="--fp8-hybrid --bf16"
  [ "$mode" = final ] && precisions=--fp8-hybrid
  for precision in $precisions; do
    p=${precision#--}
    build-gpu/fp8lm $tiny $precision --metrics-file "$logs/eq-$p-single.jsonl" > "$logs/eq-$p-single.log" 2>&1 || status=1
    i=0
    while read -r flags; do
      i=$((i + 1))
      timeout 120 "${mpi[@]}" -np 2 build-gpu/fp8lm $tiny $precision $flags --metrics-file "$logs/eq-$p-$i.jsonl" \
        < /dev/null > "$logs/eq-$p-$i.log" 2>&1 || { status=1; tail -3 "$logs/eq-$p-$i.log"; }
      echo "$p-$i: $flags" >> "$logs/eq-layouts.txt"
    done <<'LAYOUTS'
--tensor-model-parallel-size 2
--use-distributed-optimizer
--tensor-model-parallel-size 2 --sequence-parallel
--grad-reduce-in-bf16
--fp8-grad-comm
--fp8-grad-comm --fp8-grad-reduce reduce-scatter
--fp8-param-gather
--grad-reduce-in-bf16 --overlap-grad-reduce --overlap-param-gather
--fp8-grad-comm --fp8-param-gather --overlap-grad-reduce --overlap-param-gather
--fp8-grad-comm --fp8-grad-reduce reduce-scatter --overlap-grad-reduce
--tensor-model-parallel-size 2 --sequence-parallel --fp8-grad-comm
LAYOUTS
    compare "$logs/eq-$p-single.jsonl" "$logs"/eq-$p-[0-9]*.jsonl | tee -a "$logs/equivalence.txt"
  done
  cat "$logs/eq-layouts.txt"

  [ "$mode" = final ] || step "the socket transport (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1): TP=2 and DP=2"
  [ "$mode" = final ] || for flags in "--tensor-model-parallel-size 2 --sequence-parallel" "--fp8-grad-comm"; do
    tag=socket-$(echo "$flags" | tr -dc 'a-z0-9' | head -c 20)
    timeout 180 "${mpi[@]}" -x NCCL_P2P_DISABLE=1 -x NCCL_SHM_DISABLE=1 -x NCCL_DEBUG=INFO -np 2 build-gpu/fp8lm $tiny \
      --fp8-hybrid $flags --metrics-file "$logs/$tag.jsonl" > "$logs/$tag.log" 2>&1 || status=1
    grep -m1 -oE "NET/Socket|via NET/[A-Za-z]+" "$logs/$tag.log" || echo "(transport line not found)"
    compare "$logs/eq-fp8-hybrid-single.jsonl" "$logs/$tag.jsonl"
  done
fi

if [ "$mode" = final ]; then
  step "gpt2-774m, micro-batch 8, T=1024: TP=1 and 2; the bytes of each data-parallel traffic mode"
  rm -f "$logs/bench-774m.jsonl"
  for args in "1" "2 --tensor-model-parallel-size 2" "2 --tensor-model-parallel-size 2 --sequence-parallel" \
              "2 --grad-reduce-in-bf16 --overlap-grad-reduce --overlap-param-gather" \
              "2 --fp8-grad-comm --fp8-param-gather --overlap-grad-reduce --overlap-param-gather"; do
    set -- $args
    ranks=$1; shift
    run=(build-gpu/fp8lm --config configs/gpt2-774m.json --mock-data --benchmark --micro-batch-size 8 --seq-length 1024
         --train-iters 14 --benchmark-warmup 5 --log-interval 100 --eval-interval 0 --eval-iters 0 --log-level warn
         --fp8-hybrid "$@")
    if [ "$ranks" = 1 ]; then timeout 150 "${run[@]}"; else timeout 150 "${mpi[@]}" -np "$ranks" "${run[@]}" < /dev/null; fi \
    2>> "$logs/bench.err" | grep '^{' | tee -a "$logs/bench-774m.jsonl" || status=1
  done
fi

bench() {  # ranks flags...: one 1558M benchmark line into bench.jsonl
  local ranks=$1; shift
  local run=(build-gpu/fp8lm --config configs/gpt2-1558m.json --mock-data --benchmark --micro-batch-size 8
             --seq-length 1024 --train-iters 16 --benchmark-warmup 6 --log-interval 100 --eval-interval 0
             --eval-iters 0 --log-level warn --fp8-hybrid "$@")
  if [ "$ranks" = 1 ]; then timeout 200 "${run[@]}"; else timeout 200 "${mpi[@]}" -np "$ranks" "${run[@]}"; fi \
    2>> "$logs/bench.err" | grep '^{' | tee -a "$logs/bench.jsonl" || status=1
}

if [ "$mode" = dp ]; then
  step "gpt2-1558m, micro-batch 8, T=1024: data-parallel efficiency with overlap"
  rm -f "$logs/bench.jsonl"
  bench 1
  bench 2 --overlap-grad-reduce --overlap-param-gather
  bench 2 --grad-reduce-in-bf16 --overlap-grad-reduce --overlap-param-gather
  bench 2 --fp8-grad-comm --overlap-grad-reduce --overlap-param-gather
  bench 2 --fp8-grad-comm --fp8-param-gather --overlap-grad-reduce --overlap-param-gather
fi

if [ "$mode" = bench ] || [ "$mode" = all ]; then
  step "gpt2-1558m, micro-batch 8, T=1024: tokens/s, bytes per step, memory per rank"
  rm -f "$logs/bench.jsonl"
  bench 1
  bench 2 --grad-reduce-in-bf16
  bench 2 --grad-reduce-in-bf16 --overlap-grad-reduce --overlap-param-gather
  bench 2 --fp8-grad-comm --fp8-param-gather --overlap-grad-reduce --overlap-param-gather
  bench 2 --grad-reduce-in-bf16 --no-use-distributed-optimizer
  bench 2 --tensor-model-parallel-size 2
  bench 2 --tensor-model-parallel-size 2 --sequence-parallel
  if [ -f .carry/torch_gpt_bench.py ]; then
    step "PyTorch BF16 peer: one GPU, then DDP over two (same call)"
    for n in 1 2; do
      timeout 300 torchrun --standalone --nproc_per_node "$n" .carry/torch_gpt_bench.py --models 1558M --modes bf16 \
        --steps 10 2>> "$logs/peer.err" | grep '^{' | tee -a "$logs/bench.jsonl" || status=1
    done
  fi
fi
exit $status
