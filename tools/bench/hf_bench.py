#!/usr/bin/env python3
"""Hugging Face transformers peer benchmark on the GPU machine: DeepSeek V2-Lite shape (config.json only), random
bf16 weights, sdpa attention, experts_implementation="grouped_mm" (the in-place peer of docs/perf.md).

  prefill: one forward of B x I tokens (logits of the last position only), median of 3 after a warm-up
  decode:  a static batch of B prompts of I tokens, then O - 1 greedy steps through the KV cache; tok/s = B / median step

usage: hf_bench.py CONFIG_DIR [--prefill B I] [--decode B I O]
"""
import statistics, sys, time

import torch
import transformers


def sync():
    torch.cuda.synchronize()


def main():
    args = sys.argv[1:]
    d = args[0]
    prefill = decode = None
    if "--prefill" in args:
        i = args.index("--prefill"); prefill = (int(args[i + 1]), int(args[i + 2]))
    if "--decode" in args:
        i = args.index("--decode"); decode = (int(args[i + 1]), int(args[i + 2]), int(args[i + 3]))
    cfg = transformers.AutoConfig.from_pretrained(d)
    t0 = time.time()
    kw = dict(dtype=torch.bfloat16, attn_implementation="sdpa")
    with torch.device("cuda"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="grouped_mm", **kw)
            impl = "grouped_mm"
        except (TypeError, ValueError) as e:
            model = transformers.AutoModelForCausalLM.from_config(cfg, **kw)
            impl = "default (%s)" % e
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    print(f"hf: transformers {transformers.__version__} torch {torch.__version__}: {n / 1e9:.2f}B params built in "
          f"{time.time() - t0:.1f} s, experts_implementation={impl}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    V = cfg.vocab_size
    with torch.no_grad():
        if prefill:
            B, I = prefill
            ids = torch.randint(2, V, (B, I), device="cuda", generator=g)
            model(ids, use_cache=False, logits_to_keep=1)
            sync()
            ts = []
            for _ in range(3):
                t = time.time()
                model(ids, use_cache=False, logits_to_keep=1)
                sync()
                ts.append(time.time() - t)
            m = statistics.median(ts)
            print(f"hf prefill: batch {B} x {I}: {m * 1e3:.1f} ms -> {B * I / m:.0f} tok/s", flush=True)
        if decode:
            B, I, O = decode
            ids = torch.randint(2, V, (B, I), device="cuda", generator=g)
            for rep in range(2):  # the first pass warms up
                sync()
                t = time.time()
                out = model(ids, use_cache=True, logits_to_keep=1)
                sync()
                t_pre = time.time() - t
                past = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                steps = []
                for _ in range(O - 1 if rep else 2):
                    t = time.time()
                    out = model(nxt, past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                    sync()
                    steps.append(time.time() - t)
                del past, out
            m = statistics.median(steps)
            print(f"hf decode: batch {B}, input {I}, output {O}: prefill {t_pre * 1e3:.1f} ms ({B * I / t_pre:.0f} tok/s), "
                  f"decode {m * 1e3:.1f} ms/step -> {B / m:.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
