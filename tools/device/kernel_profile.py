#!/usr/bin/env python3
"""Sums ncu's per-kernel durations (CSV from `ncu --metrics gpu__time_duration.sum --csv`) by kernel name: where one
decode step's GPU time goes. The step is the last N launches, or (--step MARKER) the launches from the second-last
kernel whose name contains MARKER up to the last one (one whole step when MARKER is its first kernel). With --layer
LAYER_MARKER also every kernel of one decoder layer in launch order (time, grid, block): the launches from the 5th to
the 6th kernel of the step whose name contains LAYER_MARKER (e.g. mla_decode_ws).
usage: kernel_profile.py NCU_CSV (LAST_N | --step MARKER [--layer LAYER_MARKER])"""
import csv
import signal
import sys
from collections import defaultdict


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head
    rows = []
    with open(sys.argv[1], newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "ns")
        us = v / 1000.0 if unit == "nsecond" or unit == "ns" else v if unit in ("usecond", "us") else v * 1000.0
        rows.append((r["Kernel Name"][:90], us, r.get("Grid Size", ""), r.get("Block Size", "")))
    if sys.argv[2] == "--step":
        marks = [i for i, r in enumerate(rows) if sys.argv[3] in r[0]]
        if len(marks) < 2:
            sys.exit(f"fewer than two kernels named like '{sys.argv[3]}' in {len(rows)} profiled")
        last = rows[marks[-2]:marks[-1]]
    else:
        last = rows[-int(sys.argv[2]):]
    if len(sys.argv) > 5 and sys.argv[4] == "--layer":
        at = [i for i, r in enumerate(last) if sys.argv[5] in r[0]]
        if len(at) >= 6:
            layer = last[at[4]:at[5]]
            for n, u, g, b in layer:
                print(f"{u:7.2f} us  {n.split('(')[0][:60]:60s} {g} {b}")
            print(f"{sum(u for _, u, _, _ in layer):7.2f} us  one layer")
    total = sum(u for _, u, _, _ in last)
    by = defaultdict(lambda: [0, 0.0])
    for n, u, _, _ in last:
        by[n][0] += 1
        by[n][1] += u
    print(f"{len(rows)} kernels profiled; one step: {len(last)} kernels, {total:.1f} us of kernel time")
    for n, (c, u) in sorted(by.items(), key=lambda kv: -kv[1][1])[:40]:
        print(f"{u:9.1f} us {100 * u / total:5.1f}% {c:5d}x {u / c:7.2f} us  {n}")


if __name__ == "__main__":
    main()
