#!/usr/bin/env bash
# Draws training and validation loss against tokens seen, one colour per run, from fp8lm's
# --metrics-file JSONL files (for example an FP8 run against a BF16 one):
#   scripts/plot_loss.sh run1.jsonl [run2.jsonl ...] [-o loss.png] [--title TEXT]
# Each run is labelled by its file name. Training loss is the thin line, validation loss the
# thick line with points. Tokens = iteration x tokens per step, where tokens per step =
# tokens_per_s x ms_per_iter / 1000 of the run's log lines (both are written per log interval).
# Needs gnuplot (apt-get install gnuplot-nox). Exit 0: plot written; 2: bad arguments or an
# unreadable metrics file; 3: gnuplot is missing.
set -euo pipefail

usage() { echo "usage: scripts/plot_loss.sh run1.jsonl [run2.jsonl ...] [-o loss.png] [--title TEXT]" >&2; }
bad() { echo "plot_loss: $1${2:+ HINT: $2}" >&2; exit 2; }

output=loss.png
title="fp8lm: loss against tokens"
runs=()
while [ $# -gt 0 ]; do
  case "$1" in
    -o|--output) [ $# -ge 2 ] || bad "$1 needs a file name"; output=$2; shift 2 ;;
    --title) [ $# -ge 2 ] || bad "$1 needs a text"; title=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) usage; bad "unknown option '$1'" ;;
    *) runs+=("$1"); shift ;;
  esac
done
[ ${#runs[@]} -gt 0 ] || { usage; bad "no metrics file given" "pass the JSONL files that fp8lm train --metrics-file wrote"; }
command -v gnuplot >/dev/null 2>&1 || {
  echo "plot_loss: gnuplot is not installed. HINT: apt-get install gnuplot-nox" >&2
  exit 3
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# gnuplot strings are double-quoted: labels keep their text but not quotes or backslashes.
label_of() { basename "$1" | tr -d '"\\'; }

plot_commands=()
index=0
for run in "${runs[@]}"; do
  [ -r "$run" ] && [ -f "$run" ] || bad "$run: no such metrics file"
  # Pulls numbers out of the compact one-line JSON that fp8lm writes (no jq needed).
  awk -v train="$work/$index.train" -v val="$work/$index.val" -v name="$run" '
    function field(key,    m) {
      if (match($0, "\"" key "\":-?[0-9.]+([eE][-+]?[0-9]+)?")) {
        m = substr($0, RSTART, RLENGTH); sub(/^"[^"]*":/, "", m); return m
      }
      return ""
    }
    {
      iter = field("iter")
      if (iter == "") next
      if (per_step == "") {
        rate = field("tokens_per_s"); ms = field("ms_per_iter")
        if (rate != "" && ms != "") per_step = int(rate * ms / 1000 + 0.5)
      }
      loss = field("loss"); val_loss = field("val_loss")
      if (loss != "") { train_iter[++n_train] = iter; train_loss[n_train] = loss }
      if (val_loss != "") { val_iter[++n_val] = iter; val_value[n_val] = val_loss }
    }
    END {
      if (per_step == "" || per_step <= 0) {
        print "plot_loss: " name ": no training log line with tokens_per_s and ms_per_iter. HINT: pass a JSONL file written by fp8lm train --metrics-file" > "/dev/stderr"
        exit 1
      }
      for (i = 1; i <= n_train; ++i) print train_iter[i] * per_step, train_loss[i] > train
      for (i = 1; i <= n_val; ++i) print val_iter[i] * per_step, val_value[i] > val
      close(train); close(val)
    }' "$run" || exit 2
  label=$(label_of "$run")
  color=$((index % 8 + 1))
  [ -s "$work/$index.train" ] &&
    plot_commands+=("'$work/$index.train' using 1:2 with lines lw 1 lc $color title \"$label train\"")
  [ -s "$work/$index.val" ] &&
    plot_commands+=("'$work/$index.val' using 1:2 with linespoints lw 3 pt 7 ps 0.8 lc $color title \"$label validation\"")
  index=$((index + 1))
done
[ ${#plot_commands[@]} -gt 0 ] || bad "no loss values in ${runs[*]}"

plot_line=$(printf '%s, ' "${plot_commands[@]}")
title=$(printf '%s' "$title" | tr -d '"\\')
gnuplot <<EOF
set terminal pngcairo noenhanced size 1100,650 font "sans,11"
set output "$output"
set title "$title"
set xlabel "tokens"
set ylabel "loss (nats per token)"
set format x "%.1s%c"
set grid
set key top right
plot ${plot_line%, }
EOF
echo "plot_loss: wrote $output (${#runs[@]} run(s))" >&2
