#!/usr/bin/env python3
"""Greedy outputs of two running servers (one without drafts, one with n-gram speculative decoding) compared request
by request: where they first differ, the first server's margin between its top two tokens there (a near tie:
the two computations round differently), and the largest logprob difference of the chosen tokens before it.

usage: spec_check.py PORT_PLAIN PORT_SPEC REQUESTS OUTPUT_LEN ALLOWED ('-' or ids separated by commas)
  PORT_SPEC equal to PORT_PLAIN: the scale of such differences without drafts; each prompt alone against the same
  prompt in a batch with three others (decode steps of 4 tokens take other kernels than steps of 1).
"""
import json
import random
import sys
import urllib.request


def generate(port, prompt, out_len, allowed, others=()):
    sp = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    if allowed != "-":
        sp["allowed_token_ids"] = [int(x) for x in allowed.split(",")]
    ids = [prompt, *others] if others else prompt
    body = json.dumps({"input_ids": ids, "sampling_params": sp, "return_logprob": True,
                       "top_logprobs_num": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        res = json.load(r)
    return res[0] if others else res


def main():
    p1, p2, n, out_len, allowed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    rng = random.Random(11)
    for i in range(n):
        prompt = [rng.randrange(1000, 50000) for _ in range(128)]
        others = [[rng.randrange(1000, 50000) for _ in range(128)] for _ in range(3)] if p1 == p2 else ()
        a, b = generate(p1, prompt, out_len, allowed), generate(p2, prompt, out_len, allowed, others)
        ia, ib = a["output_ids"], b["output_ids"]
        la = [e[0] for e in a["meta_info"]["output_token_logprobs"]]
        lb = [e[0] for e in b["meta_info"]["output_token_logprobs"]]
        same = 0
        while same < min(len(ia), len(ib)) and ia[same] == ib[same]:
            same += 1
        drift = max((abs(x - y) for x, y in zip(la[:same], lb[:same])), default=0.0)
        if same == len(ia):
            print(f"request {i}: {len(ia)} tokens equal; largest logprob difference {drift:.4f}")
            continue
        top = a["meta_info"]["output_top_logprobs"][same]
        margin = top[0][0] - top[1][0] if len(top) > 1 else float("nan")
        print(f"request {i}: equal for {same} of {len(ia)} tokens; there the plain run's top-2 margin {margin:.4f}; "
              f"largest logprob difference before {drift:.4f}")


if __name__ == "__main__":
    main()
