#!/usr/bin/env python3
"""Compare an eval-logits output against a reference (stdlib only).

usage: compare_logits.py REFERENCE.safetensors OUT.safetensors [--near-tie 0.02]
Prints, per prompt, the max |diff| of logits relative to the reference's logit scale (std), and whether the
greedy tokens match up to the first near-tie step of the reference (margin_j below the threshold).
Exits 1 when a prompt fails: relative error > --tol or a greedy mismatch before a near tie.
"""
import json, math, struct, sys


def read(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    fmt = {"F32": "f", "I32": "i", "I64": "q"}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        b, e = v["data_offsets"]
        c = fmt[v["dtype"]]
        cnt = (e - b) // struct.calcsize(c)
        out[k] = (v["shape"], struct.unpack("<%d%s" % (cnt, c), data[b:e]))
    return out


def main():
    args = sys.argv[1:]
    tol, near = 2e-3, 0.02
    if "--tol" in args:
        i = args.index("--tol"); tol = float(args[i + 1]); del args[i:i + 2]
    if "--near-tie" in args:
        i = args.index("--near-tie"); near = float(args[i + 1]); del args[i:i + 2]
    ref, out = read(args[0]), read(args[1])
    ok = True
    j = 0
    while f"logits_{j}" in ref:
        rl, ol = ref[f"logits_{j}"][1], out[f"logits_{j}"][1]
        mean = sum(rl) / len(rl)
        std = math.sqrt(sum((x - mean) ** 2 for x in rl) / len(rl))
        err = max(abs(a - b) for a, b in zip(rl, ol)) / std
        rg, og = ref[f"greedy_{j}"][1], out.get(f"greedy_{j}", (None, ()))[1]
        margins = ref.get(f"margin_{j}", (None, [1.0] * len(rg)))[1]
        upto = next((i for i, m in enumerate(margins) if m < near), len(rg))
        gmatch = list(rg[:upto]) == list(og[:upto])
        full = list(rg) == list(og)
        status = "ok" if err <= tol and gmatch else "FAIL"
        ok &= status == "ok"
        print(f"prompt {j}: len {ref[f'logits_{j}'][0][0]} max|dlogit|/std {err:.2e} greedy "
              f"{'equal' if full else ('equal to near-tie step %d' % upto if gmatch else 'DIFFERENT')} {status}")
        j += 1
    if j == 0:
        print("no logits_0 in the reference"); ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
