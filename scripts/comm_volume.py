#!/usr/bin/env python3
"""fp8lm's communication-volume model: bytes each rank sends per step, per group, counted
as the ring algorithms move them (parallel/communicator.h: all-reduce 2(n-1)/n x bytes,
reduce-scatter, all-gather and all-to-all (n-1)/n x the whole buffer), and the step time it
implies at a given bandwidth. docs/MULTINODE.md explains it and lists its output.

  python3 scripts/comm_volume.py            # the check against measured bytes, then the extrapolation
"""
import math

GPT2 = {  # layers, width, heads, MLP width, vocab (padded), positions
    "gpt2-774m": (36, 1280, 20, 5120, 50304, 1024),
    "gpt2-1558m": (48, 1600, 25, 6400, 50304, 1024),
}


def parameters(model, tp=1):
    """Per tensor-parallel rank: (Linear weights, other parameters)."""
    L, C, H, F, V, P = GPT2[model]
    linear = L * (3 * C * C + C * C + F * C + C * F) // tp
    other = V * C // tp + P * C + L * (4 * C + 3 * C // tp + C + F // tp + C) + 2 * C
    return linear, other


def data_parallel_bytes(model, dp, tp=1, grads="bf16", weights="bf16"):
    """Reduce-scatter of the gradients and all-gather of the weights, per rank per step."""
    linear, other = parameters(model, tp)
    p = linear + other
    g = {"fp32": 4, "bf16": 2, "fp8": 1}[grads]
    w_linear = {"bf16": 2, "fp8": 1}[weights]
    f = (dp - 1) / dp
    return f * p * g, f * (linear * w_linear + other * 2)


def tensor_parallel_bytes(model, tp, B, T, sequence_parallel):
    """Per rank per micro-batch: the model's mappings (parallel/mappings.h)."""
    L, C, H, F, V, P = GPT2[model]
    A = B * T * C  # elements of one [B*T, C] activation
    if tp == 1:
        return 0.0
    if not sequence_parallel:  # all-reduces: the FP32 embedding, 2 forward + 2 backward BF16 per block, the LM head's
        ring = 2 * (tp - 1) / tp
        return ring * (4 * A + L * 4 * 2 * A + 2 * A) + (tp - 1) * B * T * 3 * 4
    f = (tp - 1) / tp
    # Per block: 2 FP8 all-gathers and 2 BF16 reduce-scatters forward, 2 BF16 all-gathers and
    # 2 BF16 reduce-scatters backward; the embedding (FP32 reduce-scatter, BF16 all-gather back),
    # ln_f's BF16 all-gather and the LM head's BF16 reduce-scatter.
    return f * (L * (2 * A + 6 * 2 * A) + 4 * A + 3 * 2 * A) + (tp - 1) * B * T * 3 * 4


def check():
    print("predicted bytes per rank per step against the counters (2 H200s, micro-batch 8, T = 1024)")
    B, T = 8, 1024
    rows = [
        ("gpt2-774m TP=2", tensor_parallel_bytes("gpt2-774m", 2, B, T, False), 3082911867),
        ("gpt2-774m TP=2 SP", tensor_parallel_bytes("gpt2-774m", 2, B, T, True), 2700929147),
        ("gpt2-774m DP=2 BF16 grads + weights", sum(data_parallel_bytes("gpt2-774m", 2)), 1548198912),
        ("gpt2-774m DP=2 FP8 grads + FP8 weights", sum(data_parallel_bytes("gpt2-774m", 2, grads="fp8", weights="fp8")),
         387051476 + 420205056),
        ("gpt2-1558m DP=2 BF16 grads (no overlap)", data_parallel_bytes("gpt2-1558m", 2)[0] * 2, 3115392004),
    ]
    # Four H200s, device call 16 (scripts/bench_node.sh 4): FP8 GEMMs, overlapped traffic.
    rows4 = [
        ("gpt2-1558m DP=4 FP32 grads", sum(data_parallel_bytes("gpt2-1558m", 4, grads="fp32")), 7009744896),
        ("gpt2-1558m DP=4 BF16 grads", sum(data_parallel_bytes("gpt2-1558m", 4)), 4673163264),
        ("gpt2-1558m DP=4 FP8 grads", sum(data_parallel_bytes("gpt2-1558m", 4, grads="fp8")), 3504875928),
        ("gpt2-1558m DP=4 FP8 grads + FP8 weights", sum(data_parallel_bytes("gpt2-1558m", 4, grads="fp8", weights="fp8")),
         2398955928),
        # Without the distributed optimizer: one FP32 all-reduce, 2(n-1)/n of the gradients.
        ("gpt2-1558m DP=4 all-reduce (no ZeRO-1)", 2 * data_parallel_bytes("gpt2-1558m", 4, grads="fp32")[0], 9346326528),
        ("gpt2-774m TP=4", tensor_parallel_bytes("gpt2-774m", 4, B, T, False), 4624515234),
        ("gpt2-774m TP=4 SP", tensor_parallel_bytes("gpt2-774m", 4, B, T, True), 4051541154),
        ("gpt2-774m TP=2 x DP=2: TP", tensor_parallel_bytes("gpt2-774m", 2, B, T, False), 3082911852),
        ("gpt2-774m TP=2 x DP=2: DP FP32 grads", sum(data_parallel_bytes("gpt2-774m", 2, tp=2, grads="fp32")), 1163533824),
    ]
    for row in rows + [None] + rows4:
        if row is None:
            print("  and on 4 H200s")
            continue
        name, predicted, measured = row
        print(f"  {name:40s} predicted {predicted / 1e9:7.3f} GB  measured {measured / 1e9:7.3f} GB  "
              f"({100 * (predicted / measured - 1):+.2f}%)")


def extrapolate(model="gpt2-1558m", compute_ms=151.3, measured_overhead=0.042, inter_node_gbs=45.0,
                intra_node_gbs=250.0, gpus_per_node=8):
    """Step time at DP = n with overlap: the reduce-scatter hides behind the backward (2/3 of
    the step), the gathers behind the next forward (1/3); what does not fit is exposed, and the
    measured cost of overlapped traffic at DP = 2 (SM and memory contention) is kept."""
    print(f"\n{model}, micro-batch 8 per GPU, {compute_ms} ms of compute per step (one H200),"
          f" ring bus bandwidth {intra_node_gbs:.0f} GB/s inside a node, {inter_node_gbs:.0f} GB/s across nodes")
    print(f"  {'GPUs':>5s} {'grads/weights':>14s} {'GB sent':>8s} {'RS ms':>7s} {'AG ms':>7s} {'step ms':>8s} {'efficiency':>10s}")
    for n in [2, 4, 8, 64, 256, 1024]:
        bandwidth = intra_node_gbs if n <= gpus_per_node else inter_node_gbs
        # "fp8*": FP8 gradients reduced at the end of the step, as measured before they were
        # overlapped; "fp8/fp8": bucket by bucket during the backward, as fp8lm does now.
        for grads, weights, overlapped in [("bf16", "bf16", True), ("fp8", "fp8", False), ("fp8", "fp8", True)]:
            rs, ag = data_parallel_bytes(model, n, grads=grads, weights=weights)
            rs_ms, ag_ms = rs / bandwidth / 1e6, ag / bandwidth / 1e6
            window = 2 * compute_ms / 3 if overlapped else 0.0
            exposed = max(0.0, rs_ms - window) + max(0.0, ag_ms - compute_ms / 3)
            step = compute_ms * (1 + measured_overhead) + exposed
            label = grads + "/" + weights + ("" if overlapped else "*")
            print(f"  {n:5d} {label:>14s} {(rs + ag) / 1e9:8.2f} {rs_ms:7.1f} {ag_ms:7.1f} {step:8.1f}"
                  f" {100 * compute_ms / step:9.1f}%")


if __name__ == "__main__":
    check()
    extrapolate()
