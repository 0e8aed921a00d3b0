#!/usr/bin/env bash
# Decoding step time on one GPU with the small-M GEMM kernel against cuBLASLt, in BF16 and FP8,
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
out=${OUT:-/tmp}/decode_gemm.jsonl
: > "$out"

variants=("bf16|--config $config --random-weights --bf16"
          "fp8 tensorwise|--config $config --random-weights --fp8-hybrid --fp8-recipe tensorwise")
if [ -n "${DELAYED_CKPT:-}" ]; then
  variants+=("fp8 delayed (checkpoint)|--load $DELAYED_CKPT")
fi

for variant in "${variants[@]}"; do
  IFS='|' read -r name flags <<< "$variant"
  for small_m in off on; do
    # shellcheck disable=SC2086
    common=(sample $flags --random-prompt "$prompt" --max-new-tokens "$new_tokens" --temperature 0 --ignore-eos
            --batch-size "$batch" --small-m-gemm "$small_m" --device cuda --quiet --log-level warn)
    line=$("$binary" "${common[@]}" | tail -1)
    echo "{\"impl\":\"$name\",\"small_m_gemm\":\"$small_m\",\"batch\":$batch,\"run\":$line}" | tee -a "$out"
    if [ "${PROFILE:-0}" = "1" ]; then
      profile=$("$binary" "${common[@]}" --profile-ops | grep '"op_profile"' | tail -1)
      echo "{\"impl\":\"$name\",\"small_m_gemm\":\"$small_m\",\"batch\":$batch,\"profile\":$profile}" | tee -a "$out"
    fi
  done
done

python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
runs = [r for r in rows if "run" in r]
base = {r["small_m_gemm"]: r["run"]["ms_per_step"] for r in runs if r["impl"] == "bf16"}
print(f"{'implementation':<26} {'small-M':>7} {'batch':>5} {'ms/step':>9} {'tokens/s':>10} "
      f"{'vs bf16 cuBLASLt':>17} {'vs bf16 small-M':>16}")
for r in runs:
    ms = r["run"]["ms_per_step"]
    ratio = lambda key: f"{base[key] / ms:.2f}x" if key in base else "-"
    print(f"{r['impl']:<26} {r['small_m_gemm']:>7} {r['batch']:>5} {ms:>9.2f} {r['run']['tokens_per_s']:>10.1f} "
          f"{ratio('off'):>17} {ratio('on'):>16}")
for r in rows:
    if "profile" not in r:
        continue
    p = r["profile"]
    print(f"\n{r['impl']}, small-M {r['small_m_gemm']}: profiled step {p['step_ms']:.2f} ms, ops {p['ops_ms']:.2f} ms")
    for c in p["op_profile"]:
        if c["class"].startswith("gemm") or c["ms"] > 0.05 * p["step_ms"]:
            gbs = c["bytes"] / (c["ms"] * 1e-3) / 1e9 if c["ms"] > 0 else 0
            print(f"  {c['class']:<28} {c['ms']:7.3f} ms  {c['calls']:5.0f} calls  {gbs:7.0f} GB/s")
PY
