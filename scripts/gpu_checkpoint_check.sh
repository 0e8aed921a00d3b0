#!/usr/bin/env bash
# Checkpoint checks on a GPU machine (resume, Hugging Face import and export), logs under $OUT:
#   1. FP8 gpt2-124m: 40 steps straight vs 20, save, load, 20 more: are losses and
#      weights bit-identical on the GPU?
#   2. A BF16 GPT-2 written by transformers' save_pretrained is loaded and trained on.
#   3. `fp8lm convert` output loads in transformers as GPT2LMHeadModel.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
logs=${OUT:-$repo/build-gpu/logs}
work=$(mktemp -d)
mkdir -p "$logs"
export PATH=/usr/local/cuda/bin:$PATH
status=0
if [ ! -f build-gpu/build.ninja ]; then
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc > "$logs/configure.log" 2>&1
fi
ninja -C build-gpu fp8lm > "$logs/build.log" 2>&1 || { grep -E "error" -A5 "$logs/build.log" | head -40; exit 1; }
bin=build-gpu/fp8lm
run="--config configs/gpt2-124m.json --mock-data --micro-batch-size 8 --seq-length 512 --lr 6e-4 --lr-warmup-iters 5
     --train-iters 40 --log-interval 1 --eval-interval 0 --eval-iters 2 --log-level warn"

echo "==== 1. FP8 resume on the GPU"
$bin $run --fp8-hybrid --save "$work/straight" --metrics-file "$logs/straight.jsonl" || status=1
$bin $run --fp8-hybrid --exit-interval 20 --save "$work/split" --metrics-file "$logs/split.jsonl" || status=1
$bin $run --fp8-hybrid --load "$work/split" --save "$work/split" --metrics-file "$logs/split.jsonl" || status=1
python3 - "$logs/straight.jsonl" "$logs/split.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
b = [json.loads(l) for l in open(sys.argv[2]) if '"loss"' in l]
same = [x["loss"] == y["loss"] and x["grad_norm"] == y["grad_norm"] for x, y in zip(a, b)]
print(f"iterations {len(a)} vs {len(b)}; identical loss+grad norm at {sum(same)}/{len(same)}")
print("loss straight  at 20, 21, 40:", a[19]["loss"], a[20]["loss"], a[39]["loss"])
print("loss resumed   at 20, 21, 40:", b[19]["loss"], b[20]["loss"], b[39]["loss"])
PY
for f in model.safetensors optimizer.safetensors fp8_scaling.safetensors; do
  cmp -s "$work/straight/iter_0000040/$f" "$work/split/iter_0000040/$f" && echo "$f: bit-identical" || echo "$f: DIFFERS"
done

echo "==== 2. transformers BF16 checkpoint -> fp8lm FP8 training"
python3 - "$work/hf_bf16" <<'PY' 2>&1 | grep -v Warning
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
config = GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024)
model = GPT2LMHeadModel(config).to(torch.bfloat16)
model.save_pretrained(sys.argv[1], safe_serialization=True)
from safetensors import safe_open
with safe_open(sys.argv[1] + "/model.safetensors", "pt") as f:
    keys = list(f.keys())
    print("saved", len(keys), "tensors, e.g.", keys[:3], f.get_tensor(keys[0]).dtype)
PY
$bin $run --fp8-hybrid --train-iters 30 --init-from "$work/hf_bf16" --log-level info --log-interval 10 \
  > "$logs/hf_init.log" 2>&1 || status=1
grep -E "initialised|iter |error" "$logs/hf_init.log" | tail -6

echo "==== 3. fp8lm convert -> transformers"
$bin convert --load "$work/straight" --to "$work/export" --dtype bf16 || status=1
python3 - "$work/export" <<'PY' 2>&1 | grep -v Warning
import sys, torch
from transformers import GPT2LMHeadModel
model, info = GPT2LMHeadModel.from_pretrained(sys.argv[1], output_loading_info=True)
print("missing", info["missing_keys"], "unexpected", info["unexpected_keys"], "dtype", model.dtype)
ids = torch.randint(0, 50257, (2, 64))
with torch.no_grad():
    out = model(ids, labels=ids)
print("loss on random tokens", float(out.loss), "finite", bool(torch.isfinite(out.loss)))
PY
rm -rf "$work"
exit $status
