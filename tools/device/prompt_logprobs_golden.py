#!/usr/bin/env python3
"""Prompt logprobs of a served golden model against Hugging Face (device runs; numpy + safetensors).

The server runs a golden family (tests/golden/data/FAMILY, --skip-tokenizer-init); its reference.safetensors holds
Hugging Face's fp32 logits at every position of each prompt. Each prompt goes to /generate with logprob_start_len 0
and top 3 (no new token); every position t >= 1 is compared with log_softmax(logits[t - 1])[prompt[t]], and the
top 3 ids with Hugging Face's. Prints one line per prompt: positions, median / max |d logprob|, top-1 equal.
usage: prompt_logprobs_golden.py PORT REFERENCE [LOGITS]
  LOGITS: other logits of the same prompts (an eval-logits output: the engine's own forward) to compare against.
"""
import sys

import numpy as np
from safetensors.numpy import load_file

from prompt_logprobs_check import post


def main():
    port, ref = int(sys.argv[1]), load_file(sys.argv[2])
    other = load_file(sys.argv[3]) if len(sys.argv) > 3 else ref
    j = 0
    while f"prompt_{j}" in ref:
        prompt = [int(x) for x in ref[f"prompt_{j}"]]
        logits = other[f"logits_{j}"].astype(np.float64)
        lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
        hf = logits - lse[:, None]
        meta = post(port, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                           "logprob_start_len": 0, "top_logprobs_num": 3})["meta_info"]
        got, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
        assert len(got) == len(prompt) and got[0][0] is None, (len(got), len(prompt))
        d = [abs(got[t][0] - hf[t - 1][prompt[t]]) for t in range(1, len(prompt))]
        top1 = sum(tops[t][0][1] == int(hf[t - 1].argmax()) for t in range(1, len(prompt)))
        if d:
            print(f"prompt {j}: {len(d)} positions, |d logprob| median {np.median(d):.4f} max {max(d):.4f}, "
                  f"top-1 equal {top1}/{len(d)}, HF logprob spread (std) {hf.std():.3f}")
        j += 1


if __name__ == "__main__":
    main()
