#!/usr/bin/env python3
"""Time to first token of a long prompt run again after others pushed it out of the device's KV pool, against a
running mlaserve server (stdlib only; the device tool's hierarchical-cache runs).

usage: hicache_bench.py PORT PROMPT_TOKENS OTHERS [ROUNDS]

Each round: prompt A (random ids, a fresh seed per round), then OTHERS prompts of the same length with nothing in
common (each evicting what the pool holds), then A again. Prints per round the seconds of A's first run, of its second
run, and the cached tokens the second one reports; then the medians.
"""
import json
import random
import statistics
import sys
import time
import urllib.request


def generate(port, ids):
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out["meta_info"].get("cached_tokens", 0)


def main():
    port, n, others = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    firsts, agains = [], []
    for k in range(rounds):
        rng = random.Random(1000 + k)
        a = [rng.randrange(100, 100000) for _ in range(n)]
        t_first, _ = generate(port, a)
        for j in range(others):
            generate(port, [rng.randrange(100, 100000) for _ in range(n)])
        t_again, cached = generate(port, a)
        firsts.append(t_first)
        agains.append(t_again)
        print(f"round {k}: first {t_first:.4f} s, again {t_again:.4f} s, cached {cached}", flush=True)
    print(f"median: first {statistics.median(firsts):.4f} s, again {statistics.median(agains):.4f} s", flush=True)


if __name__ == "__main__":
    main()
