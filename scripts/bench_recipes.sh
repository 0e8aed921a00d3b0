#!/usr/bin/env bash
# Each FP8 recipe's step time and memory against the default (delayed scaling) and BF16, on one
# GPU, in one call so the times are comparable: mock data, T = 1024, the mean step over the
# timed window after the warm-up (fp8lm --benchmark). The recipes run interleaved, PASSES times
# (default 2), and the table keeps each one's fastest step: a second pass evens out clock and
# thermal drift between runs.
#   scripts/bench_recipes.sh                          # expects build-gpu/fp8lm (scripts/gpu_test.sh builds it)
#   MODELS="gpt2-1558m:8" RECIPES="delayed blockwise" PASSES=1 scripts/bench_recipes.sh
#   FP8LM=build/fp8lm scripts/bench_recipes.sh
# Recipes (the run names of scripts/numerics_runs.sh, whose losses docs/NUMERICS.md reports):
#   delayed      --fp8-hybrid (history 1, most_recent)
#   fp8-te       --fp8-hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
#   tensorwise   --fp8-hybrid --fp8-recipe tensorwise
#   blockwise    --fp8-hybrid --fp8-recipe blockwise
#   bf16-ends    --fp8-hybrid --first-last-layers-bf16
#   fp8-lm-head  --fp8-hybrid --fp8-lm-head
#   bf16         --bf16
# Writes one JSON line per run to $OUT/recipes.jsonl when OUT is set (device runs), else
# build-gpu/logs/recipes.jsonl, then a Markdown table per model: step, against delayed, peak memory.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
binary=${FP8LM:-build-gpu/fp8lm}
logs=${OUT:-$repo/build-gpu/logs}
models=${MODELS:-gpt2-124m:16 gpt2-1558m:8}
recipes=${RECIPES:-delayed fp8-te tensorwise blockwise bf16-ends fp8-lm-head bf16}
mkdir -p "$logs"
out=$logs/recipes.jsonl
: > "$out"
[ -x "$binary" ] || { echo "bench_recipes: $binary not built. HINT: scripts/gpu_test.sh --bench-only builds build-gpu/" >&2; exit 1; }

recipe_flags() {
  case $1 in
    delayed) echo "--fp8-hybrid" ;;
    fp8-te) echo "--fp8-hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max" ;;
    tensorwise) echo "--fp8-hybrid --fp8-recipe tensorwise" ;;
    blockwise) echo "--fp8-hybrid --fp8-recipe blockwise" ;;
    bf16-ends) echo "--fp8-hybrid --first-last-layers-bf16" ;;
    fp8-lm-head) echo "--fp8-hybrid --fp8-lm-head" ;;
    bf16) echo "--bf16" ;;
    *) return 1 ;;
  esac
}
for recipe in $recipes; do
  recipe_flags "$recipe" > /dev/null || { echo "bench_recipes: unknown recipe '$recipe' in RECIPES" >&2; exit 2; }
done

for pass in $(seq 1 "${PASSES:-2}"); do
  for model in $models; do
    config=${model%%:*} batch=${model#*:}
    for recipe in $recipes; do
      # shellcheck disable=SC2046
      line=$(timeout 300 "$binary" --config "configs/$config.json" --mock-data --benchmark --micro-batch-size "$batch" \
               --seq-length 1024 --train-iters 20 --log-interval 100 --eval-interval 0 --eval-iters 0 --log-level warn \
               $(recipe_flags "$recipe") 2>> "$logs/recipes.err" | tail -1)
      echo "{\"pass\":$pass,\"config\":\"$config\",\"micro_batch\":$batch,\"recipe\":\"$recipe\",\"run\":$line}" | tee -a "$out"
    done
  done
done

python3 - "$out" <<'PY'
import json, sys
best, peak = {}, {}
for line in open(sys.argv[1]):
    row = json.loads(line)
    key = (row["config"], row["micro_batch"], row["recipe"])
    best[key] = min(best.get(key, float("inf")), row["run"]["step_ms"])
    peak[key] = row["run"]["peak_gib"]
for config, batch in sorted({(k[0], k[1]) for k in best}):
    print(f"\n{config}, micro-batch {batch}\n")
    print("| recipe | step | against delayed | peak memory |\n|---|---|---|---|")
    base = best.get((config, batch, "delayed"))
    for (c, b, recipe), ms in best.items():
        if (c, b) != (config, batch):
            continue
        ratio = f"{(ms / base - 1) * 100:+.1f}%" if base else "-"
        print(f"| {recipe} | {ms:.2f} ms | {ratio} | {peak[(c, b, recipe)]:.2f} GiB |")
PY
