#!/usr/bin/env bash
# Decoding step time on one GPU with the small-M GEMM kernel against cuBLASLt (or, with
# TOGGLE=cuda-graph, replayed CUDA-graph steps against op-by-op launches; TOGGLE=programmatic-launch,
# kernels placed while their predecessors finish against plain stream order), in BF16 and FP8,
# in one call so that the ratios are comparable (docs/INFERENCE.md): fp8lm sample with random
# weights, a random prompt, greedy decoding, no early stop. FP8 runs --fp8-recipe tensorwise
# (random weights have no delayed scales); DELAYED_CKPT=DIR adds FP8 rows decoded from that
# checkpoint with its own delayed scales (e.g. two steps of `fp8lm --fp8-hybrid --mock-data
# --save DIR`, which leaves the scales initialized).
#   scripts/bench_decode_gemm.sh [CONFIG] [PROMPT] [NEW_TOKENS] [BATCH]
#   (defaults: configs/gpt2-1558m.json 896 128 1: GPT-2's context is 1,024 tokens, so the cache
#    ends at position 1,023 = 896 + 128 - 1)
# FP8LM_BINARY picks the binary (default build/fp8lm). PROFILE=1 adds a --profile-ops run of each variant and prints its GEMM classes (ms, GB/s).
# Writes one JSON line per run to $OUT/decode_gemm.jsonl when OUT is set (device runs).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
config=${1:-configs/gpt2-1558m.json}
prompt=${2:-896}
new_tokens=${3:-128}
batch=${4:-1}
binary=${FP8LM_BINARY:-build/fp8lm}  # build-gpu/fp8lm on the device
toggle=${TOGGLE:-small-m-gemm}       # the on/off flag compared: small-m-gemm, cuda-graph or programmatic-launch
case $toggle in small-m-gemm|cuda-graph|programmatic-launch) ;;
  *) echo "TOGGLE must be small-m-gemm, cuda-graph or programmatic-launch" >&2; exit 2 ;; esac
out=${OUT:-/tmp}/decode_gemm.jsonl
: > "$out"

# VARIANTS picks the rows (default "bf16 tensorwise", plus "delayed" with DELAYED_CKPT):
#   bf16, tensorwise (FP8, current scaling), prompt (FP8, scales calibrated on the prompt),
#   prompt-fp8-cache (the same with an E4M3 key/value cache), delayed (DELAYED_CKPT's scales).
default_variants="bf16 tensorwise"
[ -n "${DELAYED_CKPT:-}" ] && default_variants+=" delayed"
variants=()
for variant in ${VARIANTS:-$default_variants}; do
  case $variant in
    bf16) variants+=("bf16|--config $config --random-weights --bf16") ;;
    tensorwise) variants+=("fp8 tensorwise|--config $config --random-weights --fp8-hybrid --fp8-recipe tensorwise") ;;
    prompt) variants+=("fp8 prompt scales|--config $config --random-weights --fp8-hybrid --fp8-activation-scales prompt") ;;
    prompt-fp8-cache) variants+=("fp8 prompt scales, fp8 cache|--config $config --random-weights --fp8-hybrid --fp8-activation-scales prompt --kv-cache-dtype fp8") ;;
    delayed) variants+=("fp8 delayed (checkpoint)|--load ${DELAYED_CKPT:?delayed needs DELAYED_CKPT}") ;;
    *) echo "unknown variant $variant" >&2; exit 2 ;;
  esac
done

for variant in "${variants[@]}"; do
  IFS='|' read -r name flags <<< "$variant"
  for setting in off on; do
    # shellcheck disable=SC2086
    common=(sample $flags --random-prompt "$prompt" --max-new-tokens "$new_tokens" --temperature 0 --ignore-eos
            --batch-size "$batch" --"$toggle" "$setting" --device cuda --quiet --log-level warn)
    line=$("$binary" "${common[@]}" | tail -1)
    echo "{\"impl\":\"$name\",\"setting\":\"$setting\",\"batch\":$batch,\"run\":$line}" | tee -a "$out"
    # --profile-ops times ops one by one: not a replayed graph's steps.
    if [ "${PROFILE:-0}" = "1" ] && { [ "$toggle" = small-m-gemm ] || [ "$setting" = off ]; }; then
      profile=$("$binary" "${common[@]}" --profile-ops | grep '"op_profile"' | tail -1)
      echo "{\"impl\":\"$name\",\"setting\":\"$setting\",\"batch\":$batch,\"profile\":$profile}" | tee -a "$out"
    fi
  done
done

python3 - "$out" "$toggle" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
toggle = sys.argv[2]
runs = [r for r in rows if "run" in r]
base = {r["setting"]: r["run"]["ms_per_step"] for r in runs if r["impl"] == "bf16"}
print(f"{'implementation':<26} {toggle:>12} {'batch':>5} {'ms/step':>9} {'tokens/s':>10} "
      f"{'vs bf16 ' + toggle + ' off':>24} {'vs bf16 ' + toggle + ' on':>23}")
for r in runs:
    ms = r["run"]["ms_per_step"]
    ratio = lambda key: f"{base[key] / ms:.2f}x" if key in base else "-"
    print(f"{r['impl']:<26} {r['setting']:>12} {r['batch']:>5} {ms:>9.2f} {r['run']['tokens_per_s']:>10.1f} "
          f"{ratio('off'):>24} {ratio('on'):>23}")
for r in rows:
    if "profile" not in r:
        continue
    p = r["profile"]
    print(f"\n{r['impl']}, {toggle} {r['setting']}: profiled step {p['step_ms']:.2f} ms, ops {p['ops_ms']:.2f} ms")
    for c in p["op_profile"]:
        if c["class"].startswith("gemm") or c["ms"] > 0.05 * p["step_ms"]:
            gbs = c["bytes"] / (c["ms"] * 1e-3) / 1e9 if c["ms"] > 0 else 0
            print(f"  {c['class']:<28} {c['ms']:7.3f} ms  {c['calls']:5.0f} calls  {gbs:7.0f} GB/s")
PY
