#!/usr/bin/env python3
"""Reads nsys's cuda_gpu_trace CSV (tools/device/nsys_step.sh) and prints one decode step's timeline: the step is
the kernels from the second-last to the last kernel whose name contains 'embedding'. Lists one layer (5th to 6th
kernel named like LAYER_MARKER) with each kernel's start, duration and the gap since the previous kernel ended
(negative: PDL overlap), then per kernel name the mean duration and mean gap before it over the step.
usage: timeline.py TRACE_CSV [LAYER_MARKER]"""
import csv
import re
import shutil
import signal
import subprocess
import sys
from collections import defaultdict


def short(name):
    """Kernel name without namespaces and parameter list, template arguments kept."""
    name = re.sub(r"\(anonymous namespace\)::|mlaserve::cuda::|void ", "", name)
    depth, cut = 0, len(name)
    for i, c in enumerate(name):
        depth += c == "<"
        depth -= c == ">"
        if c == "(" and depth == 0:
            cut = i
            break
    return name[:cut][:60]


def read_trace(path):
    """The kernels of a trace CSV ("Start (ns),Duration (ns),Name"), sorted by start: (start ns, duration ns, short
    demangled name); copies, sets and dummy weights' fill kernels left out."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            name = r.get("Name", "")
            if not name or "memcpy" in name.lower() or "memset" in name.lower():
                continue
            rows.append((int(r["Start (ns)"]), int(r["Duration (ns)"]), name))
    if shutil.which("c++filt"):  # CUPTI gives mangled names
        names = sorted({n for _, _, n in rows})
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
        plain = dict(zip(names, out))
        rows = [(s, d, plain.get(n, n)) for s, d, n in rows]
    return sorted((s, d, short(n)) for s, d, n in rows if "fill_random" not in n)


def step_starts(rows):
    """Indices of the kernels that start a model step (the embedding)."""
    return [i for i, r in enumerate(rows) if "embedding" in r[2]]


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head
    rows = read_trace(sys.argv[1])
    marks = step_starts(rows)
    if len(marks) < 2:
        sys.exit(f"fewer than two steps in {len(rows)} kernels")
    step = rows[marks[-2]:marks[-1]]
    t0 = step[0][0]
    end = max(s + d for s, d, _ in step)
    busy, last_end, gaps = 0, t0, []
    for s, d, n in step:
        gaps.append(s - last_end)
        busy += max(0, s + d - max(s, last_end))
        last_end = max(last_end, s + d)
    print(f"step: {len(step)} kernels, {(end - t0) / 1e3:.1f} us from first start to last end, "
          f"GPU busy {busy / 1e3:.1f} us, idle {(end - t0 - busy) / 1e3:.1f} us")
    marker = sys.argv[2] if len(sys.argv) > 2 else "mla_decode_ws"
    at = [i for i, r in enumerate(step) if marker in r[2]]
    if len(at) >= 6:
        a, b = at[4], at[5]
        print(f"one layer (kernels {a}..{b - 1}): {(step[b][0] - step[a][0]) / 1e3:.1f} us; per kernel: start, "
              "duration, gap since the previous kernel ended (negative: PDL overlap), and 'adds': how much later "
              "it ends than every kernel before it (the adds sum to the layer)")
        prev_end = max(s + d for s, d, _ in step[:a]) if a > 0 else step[a][0]
        for i in range(a, b):
            s, d, n = step[i]
            adds = max(0, s + d - prev_end)
            prev_end = max(prev_end, s + d)
            print(f"  +{(s - step[a][0]) / 1e3:6.2f} us  dur {d / 1e3:6.2f}  gap {gaps[i] / 1e3:6.2f}  "
                  f"adds {adds / 1e3:6.2f}  {n}")
    by = defaultdict(lambda: [0, 0, 0])
    for (s, d, n), g in zip(step, gaps):
        by[n][0] += 1
        by[n][1] += d
        by[n][2] += g
    print("per kernel name over the step: count, total dur us, mean dur us, mean gap before us")
    for n, (c, d, g) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"  {c:4d} {d / 1e3:8.1f} {d / c / 1e3:7.2f} {g / c / 1e3:7.2f}  {n}")


if __name__ == "__main__":
    main()
