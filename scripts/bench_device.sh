#!/usr/bin/env bash
# The single-GPU speed and memory table of docs/PERFORMANCE.md in one device call: for each
# size, fp8lm FP8 (hybrid, delayed) and fp8lm BF16, then the PyTorch BF16 peer on the same GPU
# (torch.compile, fused AdamW, flash SDPA; .carry/torch_gpt_bench.py, copied from the peers'
# folder). T = 1024, mock data; fp8lm's step is the mean over the window after its warm-up,
# the peer's the mean over 10 steps after 5.
#   scripts/bench_device.sh [SIZES]    SIZES: model:micro-batch,... (default: all four)
#   e.g. scripts/bench_device.sh 124m:32,1558m:8
# The peer compiles each model for up to a few minutes: on one H200 (2026-12-03, call 280) the
# eight fp8lm rows and the peer's first three models took 405 s, and its gpt2-1558m about 100 s
# more, so all four sizes barely fit a 600 s device call; split them when in doubt (the ratios
# are per size, each from the same call). Needs build-gpu/fp8lm (scripts/gpu_test.sh builds it). Writes bench.jsonl and
# the table to $OUT (or build-gpu/logs).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
sizes=${1:-124m:32,350m:16,774m:16,1558m:8}
logs=${OUT:-$repo/build-gpu/logs}
mkdir -p "$logs"
status=0
[ -x build-gpu/fp8lm ] || { echo "bench_device.sh: build-gpu/fp8lm is missing (scripts/gpu_test.sh --bench-only builds it)"; exit 1; }

peer_models=""
peer_batches=""
for entry in ${sizes//,/ }; do
  model=${entry%%:*} batch=${entry##*:}
  for precision in --fp8-hybrid --bf16; do
    timeout 200 build-gpu/fp8lm --config "configs/gpt2-$model.json" --mock-data --benchmark --micro-batch-size "$batch" \
      --seq-length 1024 --train-iters 20 --benchmark-warmup 6 --log-interval 100 --eval-interval 0 --eval-iters 0 \
      --log-level warn "$precision" 2>> "$logs/bench.err" | grep '^{' | tee -a "$logs/bench.jsonl" || status=1
  done
  peer_models+="${peer_models:+,}${model^^}"
  peer_batches+="${peer_batches:+,}${model^^}:$batch"
done
if [ -f .carry/torch_gpt_bench.py ]; then
  timeout 900 python3 .carry/torch_gpt_bench.py --models "$peer_models" --batch "$peer_batches" --modes bf16 --steps 10 \
    2>> "$logs/peer.err" | grep '^{' | tee -a "$logs/bench.jsonl" || status=1
else
  echo "bench_device.sh: no .carry/torch_gpt_bench.py: the peer's column stays empty"
fi

python3 - "$logs/bench.jsonl" <<'PY' | tee "$logs/bench_table.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def find(model, peer):
    hits = [r for r in rows if r.get("model", "").lower().endswith(model) and r.get("peer") == peer and "step_ms" in r]
    return hits[-1] if hits else None
print("| model, micro-batch | fp8lm FP8 | fp8lm BF16 | PyTorch BF16 peer | FP8 vs peer | FP8 vs fp8lm BF16 | peak memory FP8 / BF16 / peer |")
print("|---|---|---|---|---|---|---|")
for model in ("124m", "350m", "774m", "1558m"):
    fp8, bf16, peer = find(model, "fp8lm-fp8-hybrid"), find(model, "fp8lm-bf16"), find(model, "pytorch-bf16")
    if not fp8:
        continue
    ms = lambda r: f"{r['step_ms']:.2f} ms" if r else "-"
    ratio = lambda a, b: f"{b['step_ms'] / a['step_ms']:.2f}x" if a and b else "-"
    gib = lambda r: f"{r['peak_gib']:.2f}" if r else "-"
    print(f"| gpt2-{model}, {fp8['B']} | {ms(fp8)} | {ms(bf16)} | {ms(peer)} | {ratio(fp8, peer)} | {ratio(fp8, bf16)} | "
          f"{gib(fp8)} / {gib(bf16)} / {gib(peer)} GiB |")
PY
exit $status
