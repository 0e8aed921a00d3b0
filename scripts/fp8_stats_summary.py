#!/usr/bin/env python3
"""Summary of the FP8 tensor statistics (--fp8-stats-interval) in fp8lm metrics files.

  scripts/fp8_stats_summary.py RUN.jsonl [RUN2.jsonl ...] [--top 10] [--run-compare]

Each file is one run, labelled by its file stem. For each run, over every layer and report
step (docs/NUMERICS.md, "FP8 tensor statistics", defines the fields):
  1. per operand class (linear x input/weight/grad_output): mean and max of the saturated,
     underflow and subnormal fractions, with the layer and step of the max, and the ratio
     scale_amax / amax: its min (where) and median. Below 1 the step's amax exceeded the amax
     the scale was made for (values saturate); above 1 the scale keeps headroom (a stale,
     larger amax: small values lose bits or underflow). Current scaling gives 1.
  2. the --top N tensors by saturated and by underflow fraction, with their step;
  3. per class, the mean underflow and saturated fraction at each report step.
--run-compare adds the class means of every run side by side. Means are plain means over the
records (every layer of a class casts the same number of elements). Fractions print as
percentages. Prints Markdown; a file without statistics lines is named and skipped.
"""
import argparse
import json
import pathlib
import re
import statistics
import sys

OPERANDS = ("input", "weight", "grad_output")
FRACTIONS = ("saturated", "underflow", "subnormal")
# h.L.attn.c_attn.input -> layer L, linear attn.c_attn, operand input; lm_head.* has no layer.
NAME = re.compile(r"(?:h\.(\d+)\.)?(.+)\.(" + "|".join(OPERANDS) + r")$")


def read_stats(path):
    """The statistics records of one metrics file, each with its layer, linear and operand."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        if not isinstance(record, dict) or "fp8_stats" not in record:
            continue
        match = NAME.fullmatch(record["fp8_stats"])
        if not match:
            continue
        layer, linear, operand = match.groups()
        record["layer"] = int(layer) if layer is not None else None
        record["cls"] = (linear, operand)
        amax, scale_amax = record.get("amax"), record.get("scale_amax")
        # amax is null when the tensor held a NaN; an all-zero tensor has no meaningful ratio.
        record["ratio"] = scale_amax / amax if amax and scale_amax is not None else None
        records.append(record)
    return records


def pct(value):
    return "-" if value is None else f"{100 * value:.3g}%"


def where(record):
    layer = "" if record["layer"] is None else f"L{record['layer']} "
    return f"{layer}@{record['iter']}"


def class_order(records):
    linears = sorted({r["cls"][0] for r in records}, key=lambda name: (name == "lm_head", name))
    present = {r["cls"] for r in records}
    return [(lin, op) for lin in linears for op in OPERANDS if (lin, op) in present]


def by_class(records):
    groups = {}
    for record in records:
        groups.setdefault(record["cls"], []).append(record)
    return groups


def mean(values):
    return sum(values) / len(values) if values else None


def class_table(records):
    groups = by_class(records)
    print("| class | format | records | " + " | ".join(f"{f} mean | {f} max (where)" for f in FRACTIONS) +
          " | scale_amax/amax min (where) | median |")
    print("|---|---|---|" + "---|---|" * len(FRACTIONS) + "---|---|")
    for cls in class_order(records):
        group = groups[cls]
        cells = [".".join(cls), "/".join(sorted({r["format"] for r in group})), str(len(group))]
        for field in FRACTIONS:
            worst = max(group, key=lambda r: r[field])
            cells += [pct(mean([r[field] for r in group])), f"{pct(worst[field])} ({where(worst)})"]
        with_ratio = [r for r in group if r["ratio"] is not None]
        if with_ratio:
            lowest = min(with_ratio, key=lambda r: r["ratio"])
            cells += [f"{lowest['ratio']:.3g} ({where(lowest)})",
                      f"{statistics.median(r['ratio'] for r in with_ratio):.3g}"]
        else:
            cells += ["-", "-"]
        print("| " + " | ".join(cells) + " |")


def worst_table(records, field, top):
    hits = sorted((r for r in records if r[field] > 0), key=lambda r: -r[field])[:top]
    if not hits:
        print(f"No tensor has a nonzero {field} fraction.\n")
        return
    print(f"| tensor | iter | {field} | amax | scale_amax | scale_amax/amax |")
    print("|---|---|---|---|---|---|")
    for r in hits:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3g}"
        print(f"| {r['fp8_stats']} | {r['iter']} | {pct(r[field])} | {r['amax']} | {r['scale_amax']:.4g} | {ratio} |")
    print()


def trend_table(records, field):
    iters = sorted({r["iter"] for r in records})
    groups = by_class(records)
    print(f"Mean {field} per report step:\n")
    print("| class | " + " | ".join(str(i) for i in iters) + " |")
    print("|---|" + "---|" * len(iters))
    for cls in class_order(records):
        at = {i: mean([r[field] for r in groups[cls] if r["iter"] == i]) for i in iters}
        print(f"| {'.'.join(cls)} | " + " | ".join(pct(at[i]) for i in iters) + " |")
    print()


def run_compare(runs):
    classes = class_order([r for records in runs.values() for r in records])
    for field in FRACTIONS + ("ratio",):
        title = "min scale_amax/amax" if field == "ratio" else f"mean {field}"
        print(f"### {title} by run\n")
        print("| class | " + " | ".join(runs) + " |")
        print("|---|" + "---|" * len(runs))
        for cls in classes:
            cells = []
            for records in runs.values():
                group = [r for r in records if r["cls"] == cls]
                if field == "ratio":
                    ratios = [r["ratio"] for r in group if r["ratio"] is not None]
                    cells.append(f"{min(ratios):.3g}" if ratios else "-")
                else:
                    cells.append(pct(mean([r[field] for r in group])))
            print(f"| {'.'.join(cls)} | " + " | ".join(cells) + " |")
        print()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=pathlib.Path)
    parser.add_argument("--top", type=int, default=10, help="tensors listed by saturation and by underflow")
    parser.add_argument("--run-compare", action="store_true", help="class means of every run side by side")
    args = parser.parse_args()

    runs = {}  # label -> statistics records, in the order given
    for path in args.files:
        if not path.is_file():  # exit 2 for a missing input, as scripts/plot_loss.sh does
            print(f"fp8_stats_summary: no such file: {path}", file=sys.stderr)
            sys.exit(2)
        records = read_stats(path)
        print(f"## {path.stem}\n")
        if not records:
            print(f"{path} has no FP8 statistics lines (train with --fp8-stats-interval N).\n")
            continue
        runs[path.stem] = records
        steps = sorted({r["iter"] for r in records})
        print(f"{len(records)} records, {len(steps)} report steps ({steps[0]}..{steps[-1]}), "
              f"{len({r['fp8_stats'] for r in records})} tensors.\n")
        class_table(records)
        print()
        for field in ("saturated", "underflow"):
            print(f"### Top {args.top} by {field}\n")
            worst_table(records, field, args.top)
        print("### Trend\n")
        for field in ("underflow", "saturated"):
            trend_table(records, field)
    if args.run_compare:
        print("## Runs compared\n")
        if runs:
            run_compare(runs)
        else:
            print("No run has FP8 statistics lines.\n")


if __name__ == "__main__":
    main()
