#!/usr/bin/env python3
"""scripts/bench_node.sh's report: the node table from its benchmark lines, then the 50-step
loss gaps across layouts and the resume across layouts, each against the parallelism issue's
tolerance: the largest relative gap over the steps below 2e-3. Exits 1 when a loss row fails.

  scripts/bench_node_report.py BENCH_NODE_JSONL LOGS_DIR
"""
import json
import os
import sys

TOLERANCE = 2e-3
LOSS_RUNS = ("loss-tp4", "loss-tp4-sp", "loss-tp2dp2", "loss-tp2dp2-sp", "loss-tp4dp2", "loss-tp4dp2-sp")  # each when present


def table(rows):
    # One GPU's step for each model and precision ("peer": fp8lm-fp8-hybrid, fp8lm-bf16, ...).
    one = {(r["model"], r.get("peer")): r["step_ms"] for r in rows if r.get("ranks") == 1 and "step_ms" in r}
    print("| run | model | ranks | tp x dp | step | tokens/s per GPU | model TFLOP/s per GPU | DP efficiency "
          "| peak memory per rank | optimizer memory per rank | bytes sent per rank per step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "step_ms" not in r:
            continue
        # Data-parallel efficiency: the same model on one GPU over this row's step.
        key = (r["model"], r.get("peer"))
        eff = f"{one[key] / r['step_ms'] * 100:.1f}%" if r["tp"] == 1 and r["dp"] > 1 and key in one else "-"
        sent = r.get("bytes_per_step", {})
        traffic = " + ".join(f"{k} {v / 1e9:.3f} GB" for k, v in sent.items() if v > 1e6) or "-"
        print(f"| {r['tag']} | {r['model']} | {r['ranks']} | {r['tp']} x {r['dp']} | {r['step_ms']:.2f} ms | "
              f"{r['tok_s_per_gpu']:,.0f} | {r['tflops'] / r['ranks']:.0f} | {eff} | {r['peak_gib']:.2f} GiB | "
              f"{r.get('optimizer_gib', 0):.2f} GiB | {traffic} |")


def field(path, name):
    """One field of every line of a metrics file that has it, in order ([] without the file)."""
    if not os.path.exists(path):
        return []
    return [line[name] for line in map(json.loads, open(path)) if name in line]


def losses(path):
    return field(path, "loss")


def largest_gap(run, ref):
    """The largest relative gap over the steps both have, and how many steps that is."""
    n = min(len(run), len(ref))
    return (max(abs(a - b) / abs(b) for a, b in zip(run[:n], ref[:n])) if n else float("nan")), n


def verdict(gap, steps, expected):
    return "ok" if steps == expected and steps > 0 and gap < TOLERANCE else "FAIL"


def loss_rows(logs):
    """Prints each layout's gap to one GPU and the resume's; returns whether all are ok."""
    ok = True
    ref = losses(os.path.join(logs, "loss-dp1.jsonl"))
    ref_norm = field(os.path.join(logs, "loss-dp1.jsonl"), "grad_norm")
    if ref:
        print()
    floor = losses(os.path.join(logs, "loss-dp1-mb2.jsonl"))
    if ref and floor:
        gap, n = largest_gap(floor, ref)
        print(f"noise floor: one GPU at micro-batch 2 (the same batches, summed in another order): {n}/{len(ref)} "
              f"steps, largest relative loss gap {gap:.2e}")
    for name in LOSS_RUNS:
        path = os.path.join(logs, name + ".jsonl")
        run = losses(path)
        if ref and run:
            gap, n = largest_gap(run, ref)
            v = verdict(gap, n, len(ref))
            # The first step's gradient norm is the global batch's on every layout (the same
            # weights and batch; 2% leaves room for FP8 gradients).
            norm = field(path, "grad_norm")
            norm_gap = abs(norm[0] - ref_norm[0]) / ref_norm[0] if norm and ref_norm else float("nan")
            if not norm_gap < 2e-2:
                v = "FAIL"
            ok &= v == "ok"
            print(f"{v} {name}: {n}/{len(ref)} steps, largest relative loss gap to one GPU {gap:.2e}, "
                  f"first gradient norm's {norm_gap:.1e}")
    first, resumed, whole = (losses(os.path.join(logs, n + ".jsonl")) for n in ("resume-first", "resume-tp4", "loss-tp2dp2"))
    if whole and first and resumed:
        # The resumed run continues the TP = 2 x DP = 2 run it was saved from: the uninterrupted
        # run's later steps are its reference; one GPU's are beside them.
        gap, n = largest_gap(resumed, whole[len(first):])
        v = verdict(gap, n, len(whole) - len(first))
        ok &= v == "ok"
        line = (f"{v} saved at TP=2 x DP=2 (step {len(first)}), resumed at TP=4: {n} steps, largest relative gap "
                f"to the uninterrupted TP=2 x DP=2 run {gap:.2e}")
        if ref:
            line += f", to one GPU {largest_gap(resumed, ref[len(first):])[0]:.2e}"
        print(line)
    return ok


def main():
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
    table(rows)
    return 0 if loss_rows(sys.argv[2]) else 1


if __name__ == "__main__":
    sys.exit(main())
