#!/usr/bin/env python3
"""Paired gaps of scripts/numerics_runs.sh's runs against a baseline run (default bf16).

  scripts/paired_gaps.py DIR [--baseline bf16] [--last 3] [--until ITER] [--at ITER ...]

Each run RUN_sSEED.jsonl is scored by the mean of its last N validation losses (the issue's
rule). For every run name other than the baseline, the gap at one seed is
(score - baseline score) / baseline score, paired at that seed; the table gives the mean gap
over the seeds, its sample standard deviation and standard error (std / sqrt(seeds)), and
each seed's gap. --until scores only the evaluations up to that iteration (a run's score
"after 200 steps"). --at also reports the gap of the single evaluation at those iterations.
Prints Markdown.
"""
import argparse
import json
import math
import pathlib
import re
import sys


def val_losses(path):
    losses = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "val_loss" in record:
            losses[int(record["iter"])] = float(record["val_loss"])
    return losses


def stats(values):
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
    return mean, std, std / math.sqrt(n) if n > 1 else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir")
    parser.add_argument("--baseline", default="bf16")
    parser.add_argument("--last", type=int, default=3)
    parser.add_argument("--until", type=int, default=None)
    parser.add_argument("--at", type=int, nargs="*", default=[])
    args = parser.parse_args()

    runs = {}  # name -> seed -> {iter: val_loss}
    for path in sorted(pathlib.Path(args.dir).glob("*_s*.jsonl")):
        match = re.fullmatch(r"(.+)_s(\d+)\.jsonl", path.name)
        if match:
            runs.setdefault(match.group(1), {})[int(match.group(2))] = val_losses(path)
    if args.baseline not in runs:
        sys.exit(f"paired_gaps: no {args.baseline}_s*.jsonl in {args.dir}")

    def score(losses):
        iters = sorted(i for i in losses if args.until is None or i <= args.until)[-args.last:]
        return sum(losses[i] for i in iters) / len(iters) if len(iters) == args.last else None

    baseline = runs[args.baseline]
    until = f" up to iteration {args.until}" if args.until is not None else ""
    print(f"Score: mean of the last {args.last} validation losses{until}. Gap: (run - {args.baseline}) / {args.baseline}, "
          f"paired by seed.\n")
    seeds_all = sorted(baseline)
    print("| run | " + " | ".join(f"score, seed {s}" for s in seeds_all) + " | mean gap | std | std. error | seeds |")
    print("|---|" + "---|" * (len(seeds_all) + 4))
    for name in [args.baseline] + sorted(n for n in runs if n != args.baseline):
        scores, gaps = [], []
        for seed in seeds_all:
            s = score(runs[name].get(seed, {}))
            b = score(baseline[seed])
            scores.append(f"{s:.4f}" if s is not None else "-")
            if s is not None and b is not None and name != args.baseline:
                gaps.append((s - b) / b)
        if name == args.baseline:
            print(f"| {name} | " + " | ".join(scores) + " | - | - | - | " + str(sum(x != '-' for x in scores)) + " |")
            continue
        if not gaps:
            print(f"| {name} | " + " | ".join(scores) + " | - | - | - | 0 |")
            continue
        mean, std, se = stats(gaps)
        print(f"| {name} | " + " | ".join(scores) +
              f" | {100 * mean:+.3f}% | {100 * std:.3f}% | {100 * se:.3f}% | {len(gaps)} |")
    for at in args.at:
        print(f"\nAt iteration {at} (single evaluation):\n")
        print("| run | mean gap | std. error | seeds |")
        print("|---|---|---|---|")
        for name in sorted(n for n in runs if n != args.baseline):
            gaps = [(runs[name][s][at] - baseline[s][at]) / baseline[s][at]
                    for s in seeds_all if at in runs[name].get(s, {}) and at in baseline[s]]
            if gaps:
                mean, _, se = stats(gaps)
                print(f"| {name} | {100 * mean:+.3f}% | {100 * se:.3f}% | {len(gaps)} |")


if __name__ == "__main__":
    main()
