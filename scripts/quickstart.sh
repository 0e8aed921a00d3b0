#!/usr/bin/env bash
# The README's first command: from a fresh machine to English text sampled from a model
# trained here, in FP8.
#   1. scripts/setup.sh: the system packages and the fp8lm binary (not the tests)
#   2. scripts/prepare_data.sh: nlp-corpus (about 9 MB of English) and GPT-2's tokenizer
#      files, tokenized into data/nlp-corpus/
#   3. a short FP8 training run on that text: gpt2-124m on a GPU; on the CPU a 4-layer,
#      64-wide GPT with GPT-2's vocabulary (configs/quickstart-cpu.json), sized to finish in
#      under 15 minutes on 2 cores, the build included
#   4. fp8lm eval of the checkpoint, beside the unigram entropy of the training text (the
#      loss of a model that knows only word frequencies)
#   5. fp8lm sample from the checkpoint
# Everything lands in data/ (git ignores it); the run itself in data/quickstart/, replaced
# on every call. FP8LM_QUICKSTART_ITERS overrides the number of training steps.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
say() { echo "quickstart: $*" >&2; }
start=$(date +%s)

FP8LM_BUILD_TARGET=fp8lm scripts/setup.sh
scripts/prepare_data.sh

corpus=data/nlp-corpus
run=data/quickstart
rm -rf "$run"
mkdir -p "$run"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  device=cuda
  say "a GPU is present: gpt2-124m, FP8 (hybrid), on the GPU"
  model=(--config configs/gpt2-124m.json --device cuda --micro-batch-size 16 --seq-length 512
         --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 60 --weight-decay 0.1)
  iters=${FP8LM_QUICKSTART_ITERS:-600}
else
  device=cpu
  say "no GPU: a 4-layer, 64-wide GPT (configs/quickstart-cpu.json), FP8 (hybrid) emulated on the CPU"
  model=(--config configs/quickstart-cpu.json --device cpu --micro-batch-size 8 --seq-length 64
         --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 40 --weight-decay 0)
  iters=${FP8LM_QUICKSTART_ITERS:-640}
fi

# GPT-2's recipe: cosine decay, beta2 0.95 (Megatron's defaults are linear and 0.999).
build/fp8lm "${model[@]}" --fp8-hybrid --train-iters "$iters" --lr-decay-style cosine --adam-beta2 0.95 \
  --train-data-path "$corpus/train_*.bin" --valid-data-path "$corpus/val_*.bin" \
  --log-interval 20 --eval-interval 100 --eval-iters 20 \
  --save "$run/checkpoint" --metrics-file "$run/train.jsonl"

# The unigram entropy (nats per token) of the training tokens: an llm.c shard is a
# 1024-byte header, then uint16 token ids.
entropy=$(od -An -v -tu2 -w2 -j 1024 "$corpus"/train_000000.bin |
          awk '{ count[$1]++; n++ } END { for (t in count) { p = count[t] / n; h -= p * log(p) } printf "%.3f", h }')
eval_line=$(build/fp8lm eval --load "$run/checkpoint" --valid-data-path "$corpus/val_*.bin" --eval-iters 50 \
            --log-level warn | tail -1)
loss=$(echo "$eval_line" | sed -E 's/.*"loss":([0-9.eE+-]+).*/\1/')
say "validation loss $(printf '%.3f' "$loss") nats/token against a unigram entropy of $entropy (word frequencies alone)"
awk -v l="$loss" -v h="$entropy" 'BEGIN { exit !(l < h - 0.5) }' ||
  say "WARNING: the loss is not half a nat below the unigram entropy: the model learned little beyond word frequencies"

say "a sample from $run/checkpoint:"
build/fp8lm sample --load "$run/checkpoint" --vocab-file data/tokenizer/encoder.json \
  --merge-file data/tokenizer/vocab.bpe --prompt "The" --max-new-tokens 48 --top-k 40 --seed 1 \
  --device "$device" --ignore-eos --log-level warn
say "done in $(( $(date +%s) - start )) s (training log: $run/train.jsonl; plot it with scripts/plot_loss.sh)"
