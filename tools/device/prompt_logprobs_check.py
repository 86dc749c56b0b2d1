#!/usr/bin/env python3
"""Checks a server's prompt logprobs against its own next-token distributions (device runs; stdlib only).

One /generate request of L token ids asks for the logprobs of its whole prompt (logprob_start_len 0, top 3, no new
token); then for some positions i a request of the first i ids asks for its first token's top 3. Both are the model's
distribution after the same i tokens (computed in other batches and chunks), so the top-3 ids should agree (but for
near ties) and their logprobs within bf16 noise. Prints one line: positions, top-3 ids equal, max |d logprob|.
usage: prompt_logprobs_check.py PORT [--len L] [--seed S]
"""
import json
import random
import sys
import urllib.request


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def main():
    port = int(sys.argv[1])
    length = int(sys.argv[sys.argv.index("--len") + 1]) if "--len" in sys.argv else 700
    seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 1
    rng = random.Random(seed)
    ids = [rng.randrange(1000, 30000) for _ in range(length)]
    whole = post(port, {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                        "logprob_start_len": 0, "top_logprobs_num": 3})["meta_info"]
    inp, tops = whole["input_token_logprobs"], whole["input_top_logprobs"]
    assert len(inp) == length and inp[0][0] is None, (len(inp), inp[:1])
    positions = sorted({1, 2, 17, 255, 511, 512, 513, length // 2, length - 1})
    same, worst = 0, 0.0
    for i in positions:
        one = post(port, {"input_ids": ids[:i], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                          "return_logprob": True, "top_logprobs_num": 3})["meta_info"]
        want = one["output_top_logprobs"][0]
        got = tops[i]
        same += [e[1] for e in got] == [e[1] for e in want]
        worst = max(worst, max(abs(a[0] - b[0]) for a, b in zip(got, want)))
        assert inp[i][1] == ids[i]
    print(f"{len(positions)} positions of {length}: top-3 ids equal at {same}, max |d logprob| of the top 3 "
          f"{worst:.4f}")


if __name__ == "__main__":
    main()
