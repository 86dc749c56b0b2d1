#!/usr/bin/env python3
"""Sums ncu's per-kernel durations (CSV from `ncu --metrics gpu__time_duration.sum --csv`) over the last N launches,
by kernel name: where one decode step's GPU time goes.
usage: kernel_profile.py NCU_CSV LAST_N"""
import csv
import sys
from collections import defaultdict


def main():
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
    last = rows[-int(sys.argv[2]):]
    total = sum(u for _, u, _, _ in last)
    by = defaultdict(lambda: [0, 0.0])
    for n, u, _, _ in last:
        by[n][0] += 1
        by[n][1] += u
    print(f"{len(rows)} kernels profiled; last {len(last)}: {total:.1f} us of kernel time")
    for n, (c, u) in sorted(by.items(), key=lambda kv: -kv[1][1])[:28]:
        print(f"{u:9.1f} us {100 * u / total:5.1f}% {c:5d}x {u / c:7.2f} us  {n}")


if __name__ == "__main__":
    main()
