#!/usr/bin/env python3
"""Greedy output ids of random-id prompts of the given lengths, one request at a time (so two servers run the very
same steps), printed as one JSON list: device scripts compare two servers' outputs with cmp.
usage: served_ids.py PORT NEW_TOKENS LEN...   (prompt ids drawn from [3, 600) with seed 5)
"""
import json
import random
import sys
import urllib.request

port, new = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(5)
out = []
for n in map(int, sys.argv[3:]):
    ids = [rng.randrange(3, 600) for _ in range(n)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    out.append(json.loads(urllib.request.urlopen(req, timeout=60).read())["output_ids"])
print(json.dumps(out))
