#!/usr/bin/env python3
"""Constrained decoding through a running server (stdlib only): SGLang's regex on /generate, alone and with
unconstrained requests beside it (threads), and response_format json_schema on chat. Prints one JSON object: every
output, whether each regex output is a whole match (Python's re) and whether each chat answer that ended is JSON of
the schema. usage: structured_check.py PORT"""
import json
import re
import sys
import threading
import time
import urllib.request

PORT = int(sys.argv[1])


def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


PATTERNS = ["(red|green|blue|[αβγ]{2}) [0-9]{1,2}!", "[a-z]{3,8}@[a-z]{2,5}\\.(com|org)", "(yes|no)"]
out = {"regex": [], "chat": [], "mixed_ok": True}
for pat in PATTERNS:
    for seed, temp in ((0, 0.0), (1, 0.9), (2, 0.9)):
        t0 = time.time()
        g = post("/generate", {"text": "Answer:", "sampling_params": {"max_new_tokens": 40, "temperature": temp,
                                                                      "seed": seed, "regex": pat}})
        out["regex"].append({"pattern": pat, "seed": seed, "text": g["text"],
                             "match": bool(re.fullmatch(pat, g["text"])),
                             "finish": g["meta_info"]["finish_reason"]["type"], "s": round(time.time() - t0, 3)})
# Mixed batch: constrained and plain requests at once (overlap scheduling waits only for the constrained ones).
results = {}


def worker(i):
    body = {"text": f"Request {i}:", "sampling_params": {"max_new_tokens": 24, "temperature": 0.0}}
    if i % 2 == 0:
        body["sampling_params"]["regex"] = PATTERNS[0]
    results[i] = post("/generate", body)


threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
for i, g in sorted(results.items()):
    if i % 2 == 0 and not re.fullmatch(PATTERNS[0], g["text"]):
        out["mixed_ok"] = False
    out.setdefault("mixed", []).append(g["text"])
schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "n": {"type": "integer"}}}
for temp in (0.0, 1.0):
    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 60,
                                      "temperature": temp, "seed": 4,
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "p", "schema": schema}}})
    c = r["choices"][0]
    ok = None
    if c["finish_reason"] == "stop":
        try:
            d = json.loads(c["message"]["content"])
            ok = list(d) == ["colour", "n"] and d["colour"] in ("red", "green") and isinstance(d["n"], int)
        except ValueError:
            ok = False
    out["chat"].append({"content": c["message"]["content"], "finish": c["finish_reason"], "valid": ok})
print(json.dumps(out, ensure_ascii=False))
