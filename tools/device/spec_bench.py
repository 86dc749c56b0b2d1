#!/usr/bin/env python3
"""One request at a time through a running server (/generate, greedy, EOS ignored): output tokens per second, for
A/B runs of speculative decoding, and a digest of every output so that runs can be compared for equal tokens.

usage: spec_bench.py PORT REQUESTS OUTPUT_LEN ALLOWED
  ALLOWED: '-' (any token) or token ids separated by commas (allowed_token_ids: with a few, a model's greedy output
  loops, so n-gram drafts are kept). The first request is a warm-up, not counted.
"""
import hashlib
import json
import random
import sys
import time
import urllib.request


def spec_counts(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/get_server_info", timeout=60) as r:
        st = json.load(r)["internal_states"][0]
    return st.get("spec_draft_tokens", 0), st.get("spec_accepted_tokens", 0), st.get("forward_steps", 0)


def main():
    port, n, out_len, allowed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    before = None
    rng = random.Random(7)
    tokens, seconds = 0, 0.0
    digest = hashlib.sha256()
    for i in range(n + 1):
        prompt = [rng.randrange(1000, 50000) for _ in range(128)]
        sp = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
        if allowed != "-":
            sp["allowed_token_ids"] = [int(x) for x in allowed.split(",")]
        body = json.dumps({"input_ids": prompt, "sampling_params": sp}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            res = json.load(r)
        dt = time.perf_counter() - t0
        if i == 0:
            before = spec_counts(port)
        else:
            tokens += res["meta_info"]["completion_tokens"]
            seconds += dt
            digest.update(json.dumps(res["output_ids"]).encode())
    after = spec_counts(port)
    drafts, kept, steps = (a - b for a, b in zip(after, before))
    print(f"allowed={allowed} requests={n} output_len={out_len} tok/s={tokens / seconds:.1f} "
          f"ms/token={1000 * seconds / tokens:.3f} steps={steps} tokens/step={tokens / max(steps, 1):.2f} "
          f"drafts={drafts} kept={kept} outputs={digest.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
