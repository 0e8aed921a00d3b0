#!/usr/bin/env bash
# --fp8-recipe blockwise against tensorwise (and delayed, the default) on one GPU, in one call
# so the step times are comparable: gpt2-124m at micro-batch 16 and gpt2-1558m at micro-batch 8,
# T = 1024, mock data, the mean step over the timed window after 5 warm-up steps (fp8lm --benchmark). The recipes
# run interleaved, twice (PASSES), and the table keeps each one's faster median: a second pass
# evens out clock and thermal drift between runs.
#   scripts/bench_blockwise.sh              # expects build-gpu/fp8lm (scripts/gpu_test.sh builds it)
#   FP8LM=build/fp8lm scripts/bench_blockwise.sh
#   PASSES=1 scripts/bench_blockwise.sh     # one pass (half the device time)
# Writes one JSON line per run to $OUT/blockwise.jsonl when OUT is set (device runs), else
# build-gpu/logs/blockwise.jsonl, then a table: step ms per recipe and blockwise / tensorwise.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
binary=${FP8LM:-build-gpu/fp8lm}
logs=${OUT:-$repo/build-gpu/logs}
mkdir -p "$logs"
out=$logs/blockwise.jsonl
: > "$out"
[ -x "$binary" ] || { echo "bench_blockwise: $binary not built. HINT: scripts/gpu_test.sh --bench-only builds build-gpu/" >&2; exit 1; }

for pass in $(seq 1 "${PASSES:-2}"); do
  for model in "gpt2-124m 16" "gpt2-1558m 8"; do
    read -r config batch <<< "$model"
    for recipe in delayed tensorwise blockwise; do
      line=$(timeout 300 "$binary" --config "configs/$config.json" --mock-data --benchmark --micro-batch-size "$batch" \
               --seq-length 1024 --train-iters 20 --log-interval 100 --eval-interval 0 --eval-iters 0 --log-level warn \
               --fp8-hybrid --fp8-recipe "$recipe" 2>> "$logs/blockwise.err" | tail -1)
      echo "{\"pass\":$pass,\"config\":\"$config\",\"micro_batch\":$batch,\"recipe\":\"$recipe\",\"run\":$line}" | tee -a "$out"
    done
  done
done

python3 - "$out" <<'PY'
import json, sys
best = {}
for line in open(sys.argv[1]):
    row = json.loads(line)
    key = (row["config"], row["micro_batch"], row["recipe"])
    best[key] = min(best.get(key, float("inf")), row["run"]["step_ms"])
print(f"{'model':<12} {'micro-batch':>11} {'delayed ms':>11} {'tensorwise ms':>14} {'blockwise ms':>13} {'blockwise/tensorwise':>21}")
for config, batch in sorted({(k[0], k[1]) for k in best}):
    d, t, b = (best[(config, batch, r)] for r in ("delayed", "tensorwise", "blockwise"))
    print(f"{config:<12} {batch:>11} {d:>11.2f} {t:>14.2f} {b:>13.2f} {b / t:>21.3f}")
PY
