#!/usr/bin/env bash
# Compares this tree with an earlier fp8lm on one GPU, in one device call:
#   1. both builds, side by side (Ninja);
#   2. the GPU tests of this tree;
#   3. gpt2-124m, 200 steps, in BF16, FP8 delayed and FP8 tensorwise, on both builds:
#      per-step losses compared (bit-identical or the largest relative gap);
#   4. a checkpoint saved by the earlier build resumed by this one;
#   5. median step time (20 timed steps) at 124M (micro-batch 32) and 1558M (micro-batch 8),
#      FP8 and BF16, both builds.
# The earlier tree is a source folder (e.g. `git archive REV | tar -x -C .carry/before`),
# carried to the device beside this one.
#   scripts/gpu_compare.sh .carry/before [losses|no-tests]
# `losses` runs 1 and 3 only; `no-tests` all but 2 (when the GPU tests run in another call).
# Logs go to build-gpu/logs, and as one logs.tgz to $OUT when set (the device tool's
# output folder returns a few files only).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
before=$(cd "${1:?usage: gpu_compare.sh BEFORE_SOURCE_DIR [losses|no-tests]}" && pwd)
only_losses=$([ "${2:-}" = losses ] && echo 1 || echo 0)
skip_tests=$([ -n "${2:-}" ] && echo 1 || echo 0)
logs=$repo/build-gpu/logs
mkdir -p "$logs"
[ -n "${OUT:-}" ] && trap 'tar czf "$OUT/logs.tgz" -C "$logs" .' EXIT
export NCCL_NVLS_ENABLE=0 PATH=/usr/local/cuda/bin:$PATH
status=0
step() { echo; echo "==== $*"; }

step "build this tree and the earlier one"
configure() {  # source build
  [ -f "$2/build.ninja" ] || cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc > "$logs/configure-$(basename "$2").log" 2>&1
}
configure "$repo" build-gpu && configure "$before" build-before || { tail -20 "$logs"/configure-*.log; exit 1; }
( ninja -C build-gpu -j 10 > "$logs/build.log" 2>&1 ) & now=$!
( ninja -C build-before -j 6 fp8lm > "$logs/build-before.log" 2>&1 ) & old=$!
wait $now || { grep -E "error|FAILED" -A5 "$logs/build.log" | head -60; exit 1; }
wait $old || { grep -E "error|FAILED" -A5 "$logs/build-before.log" | head -40; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

[ $skip_tests = 1 ] || step "GPU tests"
[ $skip_tests = 1 ] || timeout 420 build-gpu/tests/fp8lm_tests "[gpu]~[.bench]" --durations yes > "$logs/gpu_tests.log" 2>&1 || status=1
[ $skip_tests = 1 ] || grep -E "FAILED|with expansion|test cases|assertions" "$logs/gpu_tests.log" | tail -40

step "gpt2-124m, 200 steps: this tree against the earlier one"
train() {  # binary tag flags...
  local bin=$1 tag=$2; shift 2
  rm -f "$logs/$tag.jsonl"
  timeout 200 "$bin" --config configs/gpt2-124m.json --mock-data --micro-batch-size 16 --seq-length 1024 \
    --train-iters 200 --lr 6e-4 --lr-warmup-iters 20 --log-interval 1 --eval-interval 0 --eval-iters 0 \
    --log-level warn --metrics-file "$logs/$tag.jsonl" "$@" > "$logs/$tag.log" 2>&1 || { status=1; tail -5 "$logs/$tag.log"; }
}
for mode in bf16 delayed tensorwise; do
  case $mode in
    bf16) flags=(--bf16) ;;
    delayed) flags=(--fp8-hybrid) ;;
    tensorwise) flags=(--fp8-hybrid --fp8-recipe tensorwise) ;;
  esac
  train build-gpu/fp8lm "after-$mode" "${flags[@]}"
  train build-before/fp8lm "before-$mode" "${flags[@]}"
done
python3 - "$logs" <<'PY' | tee "$logs/compare_losses.txt"
import json, sys
logs = sys.argv[1]
def losses(tag):
    return [json.loads(l)["loss"] for l in open(f"{logs}/{tag}.jsonl") if '"loss"' in l]
for mode in ["bf16", "delayed", "tensorwise"]:
    a, b = losses(f"after-{mode}"), losses(f"before-{mode}")
    n = min(len(a), len(b))
    same = sum(1 for i in range(n) if a[i] == b[i])
    gaps = [abs(a[i] - b[i]) / abs(b[i]) for i in range(n)]
    worst = max(range(n), key=lambda i: gaps[i])
    late = max(gaps[100:]) if n > 100 else float("nan")
    print(f"{mode:10s} steps {n}: bit-identical {same}/{n}; largest relative gap {gaps[worst]:.2e} at step {worst+1} "
          f"({b[worst]:.5f} -> {a[worst]:.5f}); largest over steps 101-200 {late:.2e}; "
          f"final {b[-1]:.5f} -> {a[-1]:.5f}; mean of last 10 {sum(b[-10:])/10:.5f} -> {sum(a[-10:])/10:.5f}")
PY

[ $only_losses = 1 ] && exit $status

step "a checkpoint of the earlier build resumed by this one"
work=$(mktemp -d)
ck="--config configs/gpt2-124m.json --mock-data --micro-batch-size 4 --seq-length 256 --fp8-hybrid --lr 6e-4
    --log-interval 1 --eval-interval 0 --eval-iters 0 --log-level warn"
timeout 120 build-before/fp8lm $ck --train-iters 10 --save "$work/old" > "$logs/ckpt-before.log" 2>&1 || status=1
timeout 120 build-before/fp8lm $ck --train-iters 14 --load "$work/old" --metrics-file "$logs/ckpt-before-resumed.jsonl" \
  > /dev/null 2>&1 || status=1
timeout 120 build-gpu/fp8lm $ck --train-iters 14 --load "$work/old" --metrics-file "$logs/ckpt-after-resumed.jsonl" \
  > "$logs/ckpt-after.log" 2>&1 || { status=1; tail -5 "$logs/ckpt-after.log"; }
python3 - "$logs" <<'PY' | tee -a "$logs/compare_losses.txt"
import json, sys
logs = sys.argv[1]
def losses(tag):
    return [json.loads(l)["loss"] for l in open(f"{logs}/{tag}.jsonl") if '"loss"' in l]
a, b = losses("ckpt-after-resumed"), losses("ckpt-before-resumed")
print("version-1 checkpoint resumed, steps 11-14: before", [f"{x:.5f}" for x in b], "after", [f"{x:.5f}" for x in a])
PY

step "median step time, 20 timed steps after 5 warm-up"
bench() {  # binary tag config batch flags...
  local bin=$1 tag=$2 config=$3 batch=$4; shift 4
  timeout 150 "$bin" --config "configs/$config.json" --mock-data --benchmark --micro-batch-size "$batch" \
    --seq-length 1024 --train-iters 25 --log-interval 100 --eval-interval 0 --eval-iters 0 --log-level warn "$@" \
    2>> "$logs/bench.err" | grep '^{' | sed "s/^{/{\"build\":\"$tag\",/" >> "$logs/bench.jsonl" || status=1
}
rm -f "$logs/bench.jsonl"
for round in 1 2; do  # interleaved, so drift hits both builds alike
  for build in before after; do
    bin=build-gpu/fp8lm; [ $build = before ] && bin=build-before/fp8lm
    bench $bin $build gpt2-124m 32 --fp8-hybrid
    bench $bin $build gpt2-124m 32 --bf16
    bench $bin $build gpt2-1558m 8 --fp8-hybrid
    bench $bin $build gpt2-1558m 8 --bf16
  done
done
python3 - "$logs/bench.jsonl" <<'PY' | tee "$logs/compare_speed.txt"
import json, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows[(r["model"], r["peer"], r["build"])].append(r["step_ms"])
for (model, peer) in sorted({(m, p) for (m, p, _) in rows}):
    b, a = min(rows[(model, peer, "before")]), min(rows[(model, peer, "after")])
    print(f"{model:12s} {peer:16s} before {b:8.2f} ms  after {a:8.2f} ms  ({100*(a/b-1):+.2f}%)  runs {rows[(model, peer, 'before')]} {rows[(model, peer, 'after')]}")
PY
exit $status
