#!/usr/bin/env python3
"""Sends greedy /generate requests of token ids to an mlaserve (or SGLang) server and prints the output ids as JSON.

Used on the device to compare two servers (overlap scheduling on / off, graphs on / off) request by request.
usage: greedy_ids.py PORT [--concurrent] [--penalties] [--top-logprobs] [--bias] [--n N] [--len L] [--new M]
       greedy_ids.py --check-top FILE: of the tokens of the requests in FILE (an output with --top-logprobs) that
       asked for top logprobs, how many have their own id as the best alternative (greedy: all, when each row's
       logits are its own), printed as "K/N"
       greedy_ids.py --check-bias FILE: of the requests in FILE (an output with --bias) that had the bias, how many
       gave exactly the expected tokens, printed as "K/N"
  default: N requests one after another (each runs alone, so both servers run the very same steps);
  --concurrent: all at once (batch composition then depends on timing);
  --penalties: every other request has frequency and presence penalties of -1 (favouring the tokens it generated,
  the newest included: with overlap scheduling that one is still in flight when the next step is launched);
  --top-logprobs: every other request also asks for its top-5 logprobs (computed on the host from the step's logits),
  printed with the ids.
  --bias: every other request (i odd) has logit_bias {100 + i: +30, 2000 + i: +15}, min_new_tokens 4 and stop token
  100 + i: the stop token is banned for the first 4 draws (2000 + i wins them), then drawn and ends the request:
  [2000 + i] * 4 + [100 + i].
"""
import json
import sys
import threading
import urllib.request


def generate(port, ids, new, penalised=False, top=False, bias=None):
    sp = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    if penalised:
        sp.update(frequency_penalty=-1.0, presence_penalty=-1.0)
    if bias is not None:
        sp.update(logit_bias={str(100 + bias): 30.0, str(2000 + bias): 15.0}, min_new_tokens=4,
                  stop_token_ids=[100 + bias])
    req = {"input_ids": ids, "sampling_params": sp}
    if top:
        req.update(return_logprob=True, top_logprobs_num=5)
    body = json.dumps(req).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    if top:
        return [out["output_ids"], out["meta_info"]["output_top_logprobs"]]
    return out["output_ids"]


def check_top(path):
    good = total = 0
    for r in json.load(open(path)):
        if len(r) == 2 and isinstance(r[0], list):  # [ids, top lists]
            for tok, alts in zip(r[0], r[1]):
                total += 1
                good += bool(alts) and alts[0][1] == tok
    print(f"{good}/{total}")


def check_bias(path):
    out = json.load(open(path))
    want = {i: [2000 + i] * 4 + [100 + i] for i in range(1, len(out), 2)}
    print(f"{sum(out[i] == w for i, w in want.items())}/{len(want)}")


def main():
    args = sys.argv[1:]
    if args[0] == "--check-top":
        check_top(args[1])
        return
    if args[0] == "--check-bias":
        check_bias(args[1])
        return
    port = int(args[0])
    n, length, new = 8, 24, 32
    if "--n" in args: n = int(args[args.index("--n") + 1])
    if "--len" in args: length = int(args[args.index("--len") + 1])
    if "--new" in args: new = int(args[args.index("--new") + 1])
    prompts = [[(1000 + 7919 * (i * length + j)) % 100000 for j in range(length + i)] for i in range(n)]
    out = [None] * n
    pen = "--penalties" in args
    top = "--top-logprobs" in args
    bias = "--bias" in args
    if "--concurrent" in args:
        def run(i):
            out[i] = generate(port, prompts[i], new, pen and i % 2 == 1, top and i % 2 == 1,
                              i if bias and i % 2 == 1 else None)
        ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in ts: t.start()
        for t in ts: t.join()
    else:
        for i in range(n):
            out[i] = generate(port, prompts[i], new, pen and i % 2 == 1, top and i % 2 == 1,
                              i if bias and i % 2 == 1 else None)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
