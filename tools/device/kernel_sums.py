#!/usr/bin/env python3
"""Where a run's GPU time goes by kernel: reads kernel_trace.cpp's CSV (timeline.read_trace: copies and dummy weights'
fill kernels left out) and prints, per kernel (short name, template arguments kept), the launches, the summed time and
its share of all kernel time, largest first, after the span from the first kernel's start to the last one's end. Used
for prefill steps, where every kernel is long enough that tracing does not distort the shares (tools/device/
trace_step.sh is for decode). With STEP=longest only the longest step counts (steps start at the embedding kernel):
one prefill without the startup's, the warm-up's and decode's kernels.
usage: [STEP=longest] kernel_sums.py TRACE_CSV [TOP]"""
import os
import signal
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timeline import read_trace, step_starts  # noqa: E402


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    rows = read_trace(sys.argv[1])
    if not rows:
        sys.exit("no kernels in the trace")
    if os.environ.get("STEP") == "longest":
        marks = step_starts(rows) + [len(rows)]
        steps = [rows[a:b] for a, b in zip(marks, marks[1:])]
        if not steps:
            sys.exit("no step (embedding kernel) in the trace")
        rows = max(steps, key=lambda st: st[-1][0] + st[-1][1] - st[0][0])
    count, total = defaultdict(int), defaultdict(int)
    for _, d, k in rows:
        count[k] += 1
        total[k] += d
    all_ns = sum(total.values())
    span = max(s + d for s, d, _ in rows) - rows[0][0]
    print(f"{len(rows)} kernels, {all_ns / 1e6:.3f} ms of kernel time, span {span / 1e6:.3f} ms")
    for k in sorted(total, key=total.get, reverse=True)[:top]:
        print(f"{total[k] / 1e6:10.3f} ms {100.0 * total[k] / all_ns:5.1f}% {count[k]:6d}x  {k}")


if __name__ == "__main__":
    main()
