#!/usr/bin/env bash
# Paired-seed FP8-against-BF16 runs on real text: every run of the list at every seed, same
# data, schedule and seed within a pair, so each comparison is paired (docs/NUMERICS.md).
#   scripts/numerics_runs.sh [options] -- [extra fp8lm flags]
#     --bin PATH          the fp8lm binary (default build-gpu/fp8lm, else build/fp8lm)
#     --config NAME       configs/NAME.json (default gpt2-124m)
#     --seeds "S1 S2 .."  (default "1234 99 7 42 2026")
#     --runs "R1 R2 .."   run names, below (default "bf16 fp8-delayed fp8-te tensorwise")
#     --iters N           optimizer steps (default 1000)
#     --micro-batch B --seq-length T   (default 4 and 512: 2,048 tokens a step, about one
#                         epoch of nlp-corpus's 1.95M training tokens in 1,000 steps)
#     --eval-interval N   (default 100) --eval-iters N (default 20)
#     --data DIR          llm.c shards train_*.bin / val_*.bin (default data/nlp-corpus)
#     --gpus "G1 G2 .."   one run at a time on each of these GPUs (CUDA_VISIBLE_DEVICES), taking the
#                         next run from one queue as each finishes; instead of --parallel
#     --parallel P        runs at once on the one GPU (default 3: small models leave it idle; 1 for
#                         large ones: shared-GPU runs at 1558M diverged and failed, docs/RELIABILITY.md)
#     --out DIR           RUN_sSEED.jsonl and .log per run (default build-gpu/numerics)
#     --save-first        also save the first seed's checkpoints into DIR/ckpt-RUN (for eval)
#     --fp8-stats N       --fp8-stats-interval N on the FP8 runs but blockwise (the statistics change
#                         no number; block scaling refuses them)
# Run names (each one set of precision flags; the rest is shared):
#   bf16             --bf16 (FP32 master weights, E4M3/FP16 AdamW moments: fp8lm's optimizer)
#   bf16-fp32-moments  --bf16 --optimizer-state-precision fp32 (the optimizer's baseline)
#   fp8-delayed      --fp8-hybrid: Megatron's defaults, history 1, most_recent
#   fp8-te           --fp8-hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
#   tensorwise       --fp8-hybrid --fp8-recipe tensorwise
#   fp8-bf16-ends    --fp8-hybrid --first-last-layers-bf16
#   fp8-lm-head      --fp8-hybrid --fp8-lm-head (the tied LM head's GEMMs in FP8 too)
#   fp8-fast-accum   --fp8-hybrid --fp8-fast-accumulation all (no FP32 promotion in dgrad and wgrad)
#   fp8-speed        --fp8-hybrid --fp8-lm-head --fp8-fast-accumulation all (the fastest per-tensor FP8 step)
#   fp8-bf16-grads   --fp8-hybrid --grad-reduce-in-bf16 (the weight gradients kept and reduced in BF16)
#   fp8-speed-bf16-grads  fp8-speed's flags and --grad-reduce-in-bf16
#   blockwise        --fp8-hybrid --fp8-recipe blockwise
#   auto-precision   --fp8-hybrid --fp8-auto-precision (blocks switch to BF16 GEMMs by the statistics)
# scripts/paired_gaps.py DIR summarises the gaps (mean, standard error) against bf16.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

bin=""; config=gpt2-124m; seeds="1234 99 7 42 2026"; runs="bf16 fp8-delayed fp8-te tensorwise"
iters=1000; micro_batch=4; seq_length=512; eval_interval=100; eval_iters=20
data=data/nlp-corpus; parallel=3; out=build-gpu/numerics; save_first=0; fp8_stats=0; gpus=""
while [ $# -gt 0 ]; do
  case $1 in
    --bin) bin=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --micro-batch) micro_batch=$2; shift 2 ;;
    --seq-length) seq_length=$2; shift 2 ;;
    --eval-interval) eval_interval=$2; shift 2 ;;
    --eval-iters) eval_iters=$2; shift 2 ;;
    --data) data=$2; shift 2 ;;
    --parallel) parallel=$2; shift 2 ;;
    --gpus) gpus=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --save-first) save_first=1; shift ;;
    --fp8-stats) fp8_stats=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "numerics_runs: unknown option $1" >&2; exit 2 ;;
  esac
done
extra=("$@")
if [ -z "$bin" ]; then
  for candidate in build-gpu/fp8lm build/fp8lm; do [ -x "$candidate" ] && { bin=$candidate; break; }; done
fi
[ -x "$bin" ] || { echo "numerics_runs: no fp8lm binary (--bin)" >&2; exit 2; }
ls "$data"/train_*.bin "$data"/val_*.bin >/dev/null 2>&1 ||
  { echo "numerics_runs: no train_*.bin / val_*.bin in $data HINT: scripts/prepare_data.sh" >&2; exit 2; }

flags_of() {
  case $1 in
    bf16) echo "--bf16" ;;
    bf16-fp32-moments) echo "--bf16 --optimizer-state-precision fp32" ;;
    fp8-delayed) echo "--fp8-hybrid" ;;
    fp8-te) echo "--fp8-hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max" ;;
    tensorwise) echo "--fp8-hybrid --fp8-recipe tensorwise" ;;
    fp8-bf16-ends) echo "--fp8-hybrid --first-last-layers-bf16" ;;
    fp8-lm-head) echo "--fp8-hybrid --fp8-lm-head" ;;
    fp8-fast-accum) echo "--fp8-hybrid --fp8-fast-accumulation all" ;;
    fp8-speed) echo "--fp8-hybrid --fp8-lm-head --fp8-fast-accumulation all" ;;
    fp8-bf16-grads) echo "--fp8-hybrid --grad-reduce-in-bf16" ;;
    fp8-speed-bf16-grads) echo "--fp8-hybrid --fp8-lm-head --fp8-fast-accumulation all --grad-reduce-in-bf16" ;;
    blockwise) echo "--fp8-hybrid --fp8-recipe blockwise" ;;
    auto-precision) echo "--fp8-hybrid --fp8-auto-precision" ;;
    *) return 1 ;;
  esac
}
for run in $runs; do flags_of "$run" >/dev/null || { echo "numerics_runs: unknown run name $run" >&2; exit 2; }; done

if [ -z "$gpus" ] && [ "$parallel" -gt 1 ]; then
  echo "numerics_runs: warning: --parallel $parallel runs several processes on one GPU; at gpt2-1558m such runs" \
       "diverged and failed with Xid 43 (docs/RELIABILITY.md): pass --parallel 1 for large models" >&2
fi
mkdir -p "$out"
first_seed=${seeds%% *}
jobs=()
for seed in $seeds; do
  for run in $runs; do jobs+=("$run $seed"); done
done

one_run() {  # run seed
  local run=$1 seed=$2 tag="$1_s$2" save=() stats=()
  [ "$save_first" = 1 ] && [ "$seed" = "$first_seed" ] && save=(--save "$out/ckpt-$run")
  # Block scaling has no one scale per tensor to report: its runs go without statistics.
  [ "$fp8_stats" != 0 ] && [[ " $(flags_of "$run") " == *" --fp8-hybrid "* ]] && [ "$run" != blockwise ] &&
    stats=(--fp8-stats-interval "$fp8_stats")
  rm -f "$out/$tag.jsonl"
  # shellcheck disable=SC2046
  "$bin" --config "configs/$config.json" $(flags_of "$run") --seed "$seed" \
    --train-data-path "$data/train_*.bin" --valid-data-path "$data/val_*.bin" \
    --micro-batch-size "$micro_batch" --seq-length "$seq_length" --train-iters "$iters" \
    --lr 6e-4 --min-lr 6e-5 --lr-warmup-iters 50 --weight-decay 0.1 --lr-decay-style cosine --adam-beta2 0.95 \
    --eval-interval "$eval_interval" --eval-iters "$eval_iters" --log-interval 10 \
    --metrics-file "$out/$tag.jsonl" "${save[@]}" "${stats[@]}" "${extra[@]}" > "$out/$tag.log" 2>&1
  local status=$?
  echo "$tag: exit $status, last val $(grep -o '"val_loss":[0-9.]*' "$out/$tag.jsonl" | tail -1)"
  return $status
}
export -f one_run flags_of
export bin config micro_batch seq_length iters eval_interval eval_iters data out save_first first_seed fp8_stats
export extra_flags="${extra[*]}"
status=0
if [ -n "$gpus" ]; then
  # One queue, one worker per GPU: a worker takes the next run when its last one ends.
  queue="$out/.queue"; next="$out/.next"; failed="$out/.failed"
  printf '%s\n' "${jobs[@]}" > "$queue"; echo 0 > "$next"; : > "$failed"
  worker() {  # gpu
    local index job
    while true; do
      index=$(flock "$next" bash -c 'n=$(cat "$1"); echo $((n + 1)) > "$1"; echo "$n"' _ "$next")
      job=$(sed -n "$((index + 1))p" "$queue")
      [ -n "$job" ] || return 0
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=$1 one_run $job || echo "$job" >> "$failed"
    done
  }
  for gpu in $gpus; do worker "$gpu" & done
  wait
  [ -s "$failed" ] && status=1
  rm -f "$queue" "$next" "$failed"
else
  printf '%s\n' "${jobs[@]}" | xargs -P "$parallel" -L 1 bash -c 'extra=($extra_flags); one_run "$0" "$1"' || status=1
fi
exit $status
