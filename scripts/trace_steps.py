#!/usr/bin/env python3
"""The training step as it runs, from a kernel trace (scripts/kernel_trace.cpp).

  scripts/trace_steps.py TRACE [--top N]

TRACE holds one line per kernel, "start_ns end_ns stream name". A step begins with its
embedding lookup (the first kernel of every training step). The tracer loses the records of
whatever ran during its forced flushes, which shows as a gap of tens of milliseconds, so only
whole steps count: those without such a gap, with the most common kernel count among them. For them it prints each step's time (from its first kernel's start to
the next step's) and idle time (no kernel on the GPU), then,
averaged over them, the idle time by the pair of kernels around each gap and the kernel time
by kernel, in order of time. Run fp8lm with --programmatic-launch off for this: under
programmatic launch a kernel starts while its predecessor runs, so spans overlap and gaps hide.
"""
import argparse
import collections
import re
import sys


def load(path):
    rows = set()
    for line in open(path):
        parts = line.split(" ", 3)
        if parts[3].startswith(("api:", "memcpy:", "memset:")):
            continue  # the host's calls (KTRACE_API), the copies and fills: not kernels
        if len(parts) == 4 and 0 < int(parts[0]) <= int(parts[1]):
            rows.add((int(parts[0]), int(parts[1]), int(parts[2]), parts[3].strip()))
    return sorted(rows)


def short(name):
    """A kernel's readable name: cuBLASLt's as it is, fp8lm's without the mangling around it."""
    if not name.startswith("_Z"):
        return name[:70]
    match = re.search(r"_cu_[0-9a-f]{8}(\d+)([A-Za-z_]\w*)", name)
    if not match:
        return name[:70]
    length, rest = int(match.group(1)), match.group(2)
    return rest[:length]


def steps_of(rows):
    """[(kernels, next): a step's kernels and the first kernel of the step after it]."""
    starts = [i for i, r in enumerate(rows) if short(r[3]) == "embedding_lookup_kernel"]
    return [(rows[a:b], rows[b]) for a, b in zip(starts, starts[1:])]


def gaps(step):
    """(idle ns, kernel before, kernel after) for every moment of the step that no kernel ran,
    the one before the next step's first kernel included."""
    kernels, following = step
    out, end, last = [], kernels[0][1], kernels[0]
    for r in kernels[1:] + [following]:
        if r[0] > end:
            out.append((r[0] - end, last, r))
        if r[1] > end:
            end, last = r[1], r
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--max-gap-ms", type=float, default=5.0, help="a longer gap means lost records")
    args = parser.parse_args()
    steps = steps_of(load(args.trace))
    if not steps:
        sys.exit(f"{args.trace}: no whole step (no two embedding lookups)")
    # Lost records leave a long gap (tens of ms); a whole step has none and the usual count.
    kept = [s for s in steps if max((g[0] for g in gaps(s)), default=0) < args.max_gap_ms * 1e6]
    if not kept:
        sys.exit(f"{args.trace}: every step has a gap over {args.max_gap_ms} ms (lost records)")
    whole_count = collections.Counter(len(s[0]) for s in kept).most_common(1)[0][0]
    whole = [s for s in kept if len(s[0]) == whole_count]
    print(f"{len(steps)} steps in the trace, {len(whole)} whole ({whole_count} kernels each)")
    for s in whole:
        idle = sum(g[0] for g in gaps(s))
        print(f"  step {(s[1][0] - s[0][0][0]) / 1e6:8.2f} ms   idle {idle / 1e6:6.2f} ms")
    n = len(whole)
    pairs = collections.defaultdict(lambda: [0, 0])
    kernels = collections.defaultdict(lambda: [0, 0])
    for s in whole:
        for idle, before, after in gaps(s):
            key = (short(before[3]), short(after[3]))
            pairs[key][0] += idle
            pairs[key][1] += 1
        for r in s[0]:
            kernels[short(r[3])][0] += r[1] - r[0]
            kernels[short(r[3])][1] += 1
    print("idle a step, by the kernels around it (ms, gaps):")
    for (before, after), (ns, count) in sorted(pairs.items(), key=lambda kv: -kv[1][0])[: args.top // 2]:
        print(f"  {ns / n / 1e6:7.3f} {count / n:6.0f}  {before} -> {after}")
    print("kernel time a step (ms, calls, us a call):")
    for name, (ns, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"  {ns / n / 1e6:8.3f} {count / n:6.0f} {ns / count / 1e3:9.1f}  {name}")
    print(f"  {sum(v[0] for v in kernels.values()) / n / 1e6:8.3f}  in all (kernels on other lanes overlap)")


if __name__ == "__main__":
    main()
