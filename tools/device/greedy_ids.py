#!/usr/bin/env python3
"""Sends greedy /generate requests of token ids to an mlaserve (or SGLang) server and prints the output ids as JSON.

Used on the device to compare two servers (overlap scheduling on / off, graphs on / off) request by request.
usage: greedy_ids.py PORT [--concurrent] [--penalties] [--top-logprobs] [--n N] [--len L] [--new M]
       greedy_ids.py --check-top FILE: of the tokens of the requests in FILE (an output with --top-logprobs) that
       asked for top logprobs, how many have their own id as the best alternative (greedy: all, when each row's
       logits are its own), printed as "K/N"
  default: N requests one after another (each runs alone, so both servers run the very same steps);
  --concurrent: all at once (batch composition then depends on timing);
  --penalties: every other request has frequency and presence penalties of -1 (favouring the tokens it generated,
  the newest included: with overlap scheduling that one is still in flight when the next step is launched);
  --top-logprobs: every other request also asks for its top-5 logprobs (computed on the host from the step's logits),
  printed with the ids.
"""
import json
import sys
import threading
import urllib.request


def generate(port, ids, new, penalised=False, top=False):
    sp = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    if penalised:
        sp.update(frequency_penalty=-1.0, presence_penalty=-1.0)
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


def main():
    args = sys.argv[1:]
    if args[0] == "--check-top":
        check_top(args[1])
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
    if "--concurrent" in args:
        def run(i):
            out[i] = generate(port, prompts[i], new, pen and i % 2 == 1, top and i % 2 == 1)
        ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in ts: t.start()
        for t in ts: t.join()
    else:
        for i in range(n):
            out[i] = generate(port, prompts[i], new, pen and i % 2 == 1, top and i % 2 == 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
