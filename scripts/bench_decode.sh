#!/usr/bin/env bash
# Decoding speed on one GPU, in one call so that the ratios are comparable: fp8lm sample
# in BF16, FP8 GEMMs, and FP8 GEMMs + FP8 KV cache, beside Hugging Face transformers'
# generate in BF16, at batch 1 and 32 with a long prompt (docs/INFERENCE.md). The prompt is
# 1,024 tokens where the context allows it, else the context minus the new tokens (GPT-2's
# 1,024: 896 + 128). Random weights (the speed does not depend on them); greedy decoding, no
# early stop. fp8lm's ms/step is its steady steps' (after the two that plan its GEMMs and
# record its step), transformers' is timed after a warm-up call.
#   scripts/bench_decode.sh [CONFIG] [NEW_TOKENS]     (defaults: configs/gpt2-1558m.json 128)
# Environment: BATCHES (default "1 32"); PROMPT (tokens); SCALES, the FP8 rows' activation
# scales: prompt (default: calibrated on the prompt, as a trained FP8 checkpoint's delayed
# scales would be fixed) or tensorwise (current scaling: an amax pass before every cast);
# TRANSFORMERS=0 leaves the transformers rows out; FP8LM_BINARY (default build/fp8lm).
# Writes one JSON line per run to $OUT/decode.jsonl when OUT is set (device runs), and a table.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
config=${1:-configs/gpt2-1558m.json}
new_tokens=${2:-128}
binary=${FP8LM_BINARY:-build/fp8lm}
context=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c.get("n_positions", c.get("max_position_embeddings", 1024)))' "$config")
prompt=${PROMPT:-$(( context - new_tokens < 1024 ? context - new_tokens : 1024 ))}
case ${SCALES:=prompt} in
  prompt) fp8="--fp8-hybrid --fp8-activation-scales prompt" ;;
  tensorwise) fp8="--fp8-hybrid --fp8-recipe tensorwise" ;;
  *) echo "SCALES must be prompt or tensorwise" >&2; exit 2 ;;
esac
out=${OUT:-/tmp}/decode.jsonl
: > "$out"

for batch in ${BATCHES:-1 32}; do
  for variant in "bf16|--bf16|bf16" "fp8|$fp8|bf16" "fp8+fp8kv|$fp8|fp8"; do
    IFS='|' read -r name precision kv <<< "$variant"
    # shellcheck disable=SC2086
    line=$("$binary" sample --config "$config" --random-weights --random-prompt "$prompt" \
           --max-new-tokens "$new_tokens" --temperature 0 --ignore-eos --batch-size "$batch" \
           $precision --kv-cache-dtype "$kv" --device cuda --quiet --log-level warn | tail -1)
    echo "{\"impl\":\"fp8lm $name\",\"batch\":$batch,\"run\":$line}" | tee -a "$out"
  done
  [ "${TRANSFORMERS:-1}" = 0 ] && continue
  python3 - "$config" "$batch" "$prompt" "$new_tokens" <<'PY' | tee -a "$out"
import json, sys, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel
config_path, batch, prompt, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = json.load(open(config_path))
# Built on the GPU in BF16 directly: a 6.7B model's FP32 initialisation on the host would take minutes.
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in cfg.items() if k in (
        "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "layer_norm_epsilon")})).eval()
ids = torch.randint(0, cfg["vocab_size"], (batch, prompt), device="cuda")
def timed(n):
    torch.cuda.synchronize(); t = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                   do_sample=False, pad_token_id=0)
    torch.cuda.synchronize(); return time.perf_counter() - t
with torch.no_grad():
    timed(4)  # warm-up
    prefill = timed(1)
    total = timed(new_tokens)
decode_s = total - prefill
print(json.dumps({"impl": "transformers bf16", "batch": batch, "run": {
    "prefill_ms": prefill * 1e3, "decode_ms": decode_s * 1e3,
    "ms_per_step": decode_s * 1e3 / (new_tokens - 1),
    "tokens_per_s": batch * (new_tokens - 1) / decode_s}}))
PY
done

python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ms = {(r["impl"], r["batch"]): r["run"]["ms_per_step"] for r in rows}
def ratio(other, r):
    base = ms.get((other, r["batch"]))
    return f"{base / r['run']['ms_per_step']:.2f}x" if base else "-"
print(f"{'implementation':<22} {'batch':>5} {'ms/step':>9} {'tokens/s':>10} {'vs transformers':>16} {'vs fp8lm bf16':>14}")
for r in rows:
    print(f"{r['impl']:<22} {r['batch']:>5} {r['run']['ms_per_step']:>9.3f} {r['run']['tokens_per_s']:>10.1f} "
          f"{ratio('transformers bf16', r):>16} {ratio('fp8lm bf16', r):>14}")
PY
