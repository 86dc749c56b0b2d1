#!/usr/bin/env python3
"""Where the time goes inside the kernels of one grid size, from a probe build's records (tools/device/probe_step.sh).

Every probe mark (tag 0: a block reaches its PDL wait, 1: the wait returns, others: probe_mark(tag) in the kernel) is
taken relative to the kernel's first wait return; per tag this prints, averaged over the step's kernels of that grid
size, the earliest block, the median block and the last block, plus the next kernel's first wait return ("next").
usage: probe_phases.py RECORDS BLOCKS   (e.g. 128 for mla_one_token at V2-Lite's 16 heads)
"""
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_timeline import read_records  # noqa: E402


def main():
    want = int(sys.argv[2])
    grids, blocks, order = read_records(sys.argv[1])
    per_tag = defaultdict(lambda: [[], [], []])
    nxt = []
    count = 0
    for i, (ret, g) in enumerate(order):
        if len(blocks[g]) != want:
            continue
        count += 1
        for tag, ts in grids[g].items():
            ts = sorted((t - ret) / 1e3 for t in ts)
            per_tag[tag][0].append(ts[0])
            per_tag[tag][1].append(ts[len(ts) // 2])
            per_tag[tag][2].append(ts[-1])
        if i + 1 < len(order):
            nxt.append((order[i + 1][0] - ret) / 1e3)
    print(f"{count} kernels of {want} blocks; us from the kernel's first wait return (mean over the kernels)")
    print(" tag   first  median    last")
    for tag in sorted(per_tag):
        a, m, z = (statistics.mean(x) for x in per_tag[tag])
        print(f"{tag:4d} {a:7.2f} {m:7.2f} {z:7.2f}")
    if nxt:
        print(f"next {statistics.mean(nxt):7.2f}")


if __name__ == "__main__":
    main()
