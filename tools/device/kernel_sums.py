#!/usr/bin/env python3
"""Where a run's GPU time goes by kernel: reads kernel_trace.cpp's CSV ("Start (ns),Duration (ns),Name") and prints,
per kernel (short name, template arguments kept), the launches, the summed time and its share of all kernel time,
largest first; then the span from the first kernel's start to the last one's end. Used for prefill steps, where
every kernel is long enough that tracing does not distort the shares (tools/device/trace_step.sh is for decode).
usage: kernel_sums.py TRACE_CSV [TOP]"""
import csv
import re
import shutil
import signal
import subprocess
import sys
from collections import defaultdict


def short(name):
    name = re.sub(r"\(anonymous namespace\)::|mlaserve::cuda::|void ", "", name)
    depth, cut = 0, len(name)
    for i, c in enumerate(name):
        depth += c == "<"
        depth -= c == ">"
        if c == "(" and depth == 0:
            cut = i
            break
    return name[:cut][:70]


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    rows = []
    with open(sys.argv[1], newline="") as f:
        for r in csv.DictReader(f):
            rows.append((int(r["Start (ns)"]), int(r["Duration (ns)"]), r["Name"]))
    if not rows:
        sys.exit("no kernels in the trace")
    names = sorted({n for _, _, n in rows})
    demangled = dict(zip(names, names))
    if shutil.which("c++filt"):
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
        demangled = {n: d for n, d in zip(names, out)}
    count, total = defaultdict(int), defaultdict(int)
    for _, d, n in rows:
        k = short(demangled[n])
        count[k] += 1
        total[k] += d
    all_ns = sum(total.values())
    print(f"{len(rows)} kernels, {all_ns / 1e6:.3f} ms of kernel time, span "
          f"{(max(s + d for s, d, _ in rows) - min(s for s, _, _ in rows)) / 1e6:.3f} ms")
    for k in sorted(total, key=total.get, reverse=True)[:top]:
        print(f"{total[k] / 1e6:10.3f} ms {100.0 * total[k] / all_ns:5.1f}% {count[k]:6d}x  {k}")


if __name__ == "__main__":
    main()
