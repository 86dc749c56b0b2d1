#!/usr/bin/env python3
"""One decode step as a timeline from a probe build's records (tools/device/probe_step.sh).

Each record is "grid block tag time_ns": tag 0 when a block reaches its PDL wait, 1 when the wait returns (the kernel
before has completed), 2 / 3 where a kernel marks a point of its own (MoE: plan built / block done; router: routed /
block done). Kernels are ordered by their first wait return; a kernel's "span" is the time from its first wait return
to the next kernel's (its own critical path plus one dependency).
usage: probe_timeline.py RECORDS [--all] [--layer N]
"""
import signal
import sys
from collections import defaultdict

signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet when piped into head


def read_records(path):
    """grids: grid -> tag -> times (ns); blocks: grid -> block indices; order: (first wait return, grid), sorted."""
    grids = defaultdict(lambda: defaultdict(list))
    blocks = defaultdict(set)
    for line in open(path):
        g, b, tag, t = line.split()
        grids[g][int(tag)].append(int(t))
        blocks[g].add(int(b))
    order = sorted((min(v[1]) if v[1] else min(v[0]), g) for g, v in grids.items())
    return grids, blocks, order


def main():
    grids, blocks, ks = read_records(sys.argv[1])
    t0 = ks[0][0]
    rows = []
    for i, (rel, g) in enumerate(ks):
        v = grids[g]
        nxt = ks[i + 1][0] if i + 1 < len(ks) else None
        rows.append(dict(i=i, n=len(blocks[g]), arrive=(min(v[0]) - t0) / 1e3 if v[0] else None, rel=(rel - t0) / 1e3,
                         span=(nxt - rel) / 1e3 if nxt else None,
                         lastrel=(max(v[1]) - rel) / 1e3 if v[1] else None,
                         t2=(max(v[2]) - rel) / 1e3 if v[2] else None,
                         t3=(max(v[3]) - rel) / 1e3 if v[3] else None,
                         t3min=(min(v[3]) - rel) / 1e3 if v[3] else None))
    total = (ks[-1][0] - t0) / 1e3
    print(f"{len(rows)} kernels, first wait return to last: {total:.1f} us")
    sel = rows
    if "--layer" in sys.argv:
        n = int(sys.argv[sys.argv.index("--layer") + 1])
        # layers start at the kernel after a small-batch MoE down kernel (the one with mark 3 and no mark 2)
        starts = [r["i"] for r in rows if r["i"] > 0 and rows[r["i"] - 1]["t3"] is not None
                  and rows[r["i"] - 1]["t2"] is None]
        if n < len(starts) - 1:
            sel = rows[starts[n]:starts[n + 1]]
            print(f"layer {n}: kernels {starts[n]}..{starts[n + 1] - 1}, "
                  f"{(rows[starts[n + 1]]['rel'] - rows[starts[n]]['rel']):.1f} us")
    print(" idx blocks  arrive   return    span  last-return  mark2  mark3(min..max)")
    f = lambda x: "   -  " if x is None else f"{x:7.2f}"
    for r in sel:
        m3 = "" if r["t3"] is None else f"{r['t3min']:.2f}..{r['t3']:.2f}"
        print(f"{r['i']:4d} {r['n']:6d} {f(r['arrive'])} {f(r['rel'])} {f(r['span'])} {f(r['lastrel'])}    "
              f"{f(r['t2'])} {m3}")
    # per kernel kind (block count) over the whole step
    agg = defaultdict(lambda: [0, 0.0])
    for r in rows:
        if r["span"] is not None:
            agg[r["n"]][0] += 1
            agg[r["n"]][1] += r["span"]
    print("by block count: count, total span us")
    for n, (c, s) in sorted(agg.items(), key=lambda x: -x[1][1]):
        print(f"  {n:6d} blocks: {c:4d} kernels, {s:8.1f} us, {s / c:6.2f} each")


if __name__ == "__main__":
    main()
