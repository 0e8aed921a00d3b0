#!/usr/bin/env bash
# Draws training and validation loss against tokens seen, one colour per run, from fp8lm's
# --metrics-file JSONL files (for example an FP8 run against a BF16 one):
#   scripts/plot_loss.sh run1.jsonl [run2.jsonl ...] [-o loss.png] [--title TEXT]
# Each run is labelled by its file name. Training loss is the thin line, validation loss the
# thick line with points. Tokens = iteration x tokens per step, where tokens per step =
# tokens_per_s x ms_per_iter / 1000 of the run's log lines (both are written per log interval).
#
# With --fp8-stat FIELD it draws instead one of the FP8 tensor statistics that
# --fp8-stats-interval writes (saturated, underflow, subnormal, amax, scale_amax or scale)
# against the iteration, one line per run and FP8 operand whose name matches --tensor REGEX
# (an awk regular expression; default: every operand), e.g.
#   scripts/plot_loss.sh run.jsonl --fp8-stat underflow --tensor 'grad_output$' -o underflow.png
# amax, scale_amax and scale are drawn on a log scale.
# Needs gnuplot (apt-get install gnuplot-nox). Exit 0: plot written; 2: bad arguments or an
# unreadable metrics file; 3: gnuplot is missing.
set -euo pipefail

usage() {
  echo "usage: scripts/plot_loss.sh run1.jsonl [run2.jsonl ...] [-o loss.png] [--title TEXT]" >&2
  echo "         [--fp8-stat saturated|underflow|subnormal|amax|scale_amax|scale [--tensor REGEX]]" >&2
}
bad() { echo "plot_loss: $1${2:+ HINT: $2}" >&2; exit 2; }

output=loss.png
title=""
stat=""
tensor_pattern="."
runs=()
while [ $# -gt 0 ]; do
  case "$1" in
    -o|--output) [ $# -ge 2 ] || bad "$1 needs a file name"; output=$2; shift 2 ;;
    --title) [ $# -ge 2 ] || bad "$1 needs a text"; title=$2; shift 2 ;;
    --fp8-stat) [ $# -ge 2 ] || bad "$1 needs a statistic"; stat=$2; shift 2 ;;
    --tensor) [ $# -ge 2 ] || bad "$1 needs a regular expression"; tensor_pattern=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    -*) usage; bad "unknown option '$1'" ;;
    *) runs+=("$1"); shift ;;
  esac
done
[ ${#runs[@]} -gt 0 ] || { usage; bad "no metrics file given" "pass the JSONL files that fp8lm train --metrics-file wrote"; }
case "$stat" in
  ""|saturated|underflow|subnormal|amax|scale_amax|scale) ;;
  *) bad "--fp8-stat $stat is not a statistic" "one of saturated, underflow, subnormal, amax, scale_amax, scale" ;;
esac
[ -n "$stat" ] || [ "$tensor_pattern" = "." ] || bad "--tensor selects FP8 operands" "use it with --fp8-stat FIELD"
if [ -z "$title" ]; then
  if [ -n "$stat" ]; then title="fp8lm: FP8 $stat per operand"; else title="fp8lm: loss against tokens"; fi
fi
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
if [ -n "$stat" ]; then
  # One file pair per (run, operand): its name, and its iterations and values, from the
  # "fp8_stats" lines (an amax of NaN is written as null and left out).
  series=0
  for run in "${runs[@]}"; do
    [ -r "$run" ] && [ -f "$run" ] || bad "$run: no such metrics file"
    awk -v dir="$work" -v run="$index" -v stat="$stat" -v pattern="$tensor_pattern" '
      function field(key,    m) {
        if (match($0, "\"" key "\":-?[0-9.]+([eE][-+]?[0-9]+)?")) {
          m = substr($0, RSTART, RLENGTH); sub(/^"[^"]*":/, "", m); return m
        }
        return ""
      }
      match($0, /"fp8_stats":"[^"]*"/) {
        name = substr($0, RSTART + 13, RLENGTH - 14)
        if (name !~ pattern) next
        value = field(stat); iter = field("iter")
        if (value == "" || iter == "") next
        if (!(name in file)) {
          file[name] = dir "/" run "." (++count) ".stat"
          print name > (dir "/" run "." count ".name")
        }
        print iter, value > file[name]
      }' "$run" || exit 2
    label=$(label_of "$run")
    for ((k = 1; ; ++k)); do  # in the order the operands first appear (the scaling table's)
      names="$work/$index.$k.name"
      [ -e "$names" ] || break
      tensor=$(tr -d '"\\' < "$names")
      series=$((series + 1))
      plot_commands+=("'${names%.name}.stat' using 1:2 with linespoints lw 1 pt 7 ps 0.5 lc $((series % 8 + 1)) title \"$label $tensor\"")
    done
    index=$((index + 1))
  done
  [ ${#plot_commands[@]} -gt 0 ] || bad "no FP8 statistics matching '$tensor_pattern' in ${runs[*]}" \
    "train with --fp8-stats-interval N and --metrics-file, and check --tensor"
  log_scale=""
  case "$stat" in amax|scale_amax|scale) log_scale="set logscale y" ;; esac
  plot_line=$(printf '%s, ' "${plot_commands[@]}")
  title=$(printf '%s' "$title" | tr -d '"\\')
  gnuplot <<GNUPLOT
set terminal pngcairo noenhanced size 1100,650 font "sans,11"
set output "$output"
set title "$title"
set xlabel "iteration"
set ylabel "$stat"
$log_scale
set grid
set key outside right
plot ${plot_line%, }
GNUPLOT
  echo "plot_loss: wrote $output ($series FP8 operand series)" >&2
  exit 0
fi

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
