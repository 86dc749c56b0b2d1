#!/usr/bin/env python3
"""Random DeepSeek configs against Hugging Face (runs on the GPU machine: torch + transformers).

usage: config_fuzz.py MLASERVE_BINARY OUT_DIR [N] [SEED] [DEVICES]

Each of N random tiny configs (V2 or V3 form: head counts and widths no kernel is tuned to, q LoRA or not, routing
of every kind with or without groups, dense layers first or none, one or two shared experts, plain RoPE or YaRN)
becomes a random bf16 checkpoint with Hugging Face's reference logits and greedy tokens (tools/golden/make_golden.py);
`mlaserve eval-logits` then runs it on each of DEVICES (default "cuda,cpu") and tools/compare_logits.py judges the
result (the CUDA tolerance of tools/device/cuda_run.sh). Prints one line per config and device, with how many
positions are off when one fails; exit status 1 if any fails. On the GPU, bf16 rounding flips near-tied expert
choices now and then (a few positions, and those attending to them, far off); `cuda_model_test
--gtest_filter=*GoldenCheckModels` with MLASERVE_CHECK_MODELS=OUT_DIR/fuzz0,... compares the GPU with the CPU's
routing forced, which tells a flip from a wrong op. (V2 configs keep norm_topk_prob false, as every V2 checkpoint
does: with it true, DeepSeek's V2 code, transformers 5 and SGLang / vLLM each weigh the experts differently.)
FUZZ_MORE=1 also varies tie_word_embeddings.
"""
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "golden"))
import make_golden as mg  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def random_config(rng):
    v3 = rng.random() < 0.5
    layers = rng.randint(1, 4)
    experts = rng.choice([4, 6, 8, 12, 16, 32, 64])
    groups = rng.choice([g for g in (1, 2, 4, 8) if experts % g == 0 and experts // g >= 2])
    top_k = rng.randint(1, min(8, experts))
    topk_group = rng.randint(1, groups)
    while topk_group * (experts // groups) < top_k:  # the kept groups must hold top_k experts
        topk_group += 1
    yarn = rng.random() < 0.5
    mscale = rng.choice([0.707, 1.0])
    cfg = dict(mg.BASE, architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
               model_type="deepseek_v3" if v3 else "deepseek_v2", shard="60KB",
               vocab_size=rng.choice([300, 500, 640, 1000]), hidden_size=rng.choice([32, 64, 80, 96, 128, 192]),
               intermediate_size=rng.choice([48, 96, 160, 256]), moe_intermediate_size=rng.choice([16, 24, 40, 64]),
               num_hidden_layers=layers, num_attention_heads=rng.choice([1, 2, 3, 4, 5, 8, 16]),
               n_shared_experts=rng.choice([1, 1, 2]), n_routed_experts=experts, num_experts_per_tok=top_k,
               kv_lora_rank=rng.choice([16, 32, 40, 64, 128]), q_lora_rank=rng.choice([None, 24, 48, 96]),
               qk_nope_head_dim=rng.choice([8, 16, 24, 32, 64]), qk_rope_head_dim=rng.choice([4, 8, 16, 32, 64]),
               v_head_dim=rng.choice([8, 16, 20, 32, 64]), first_k_dense_replace=rng.randint(0, min(2, layers)),
               moe_layer_freq=1, norm_topk_prob=(rng.random() < 0.5) and v3,  # (no V2 checkpoint sets it)
               routed_scaling_factor=rng.choice([1.0, 1.5, 2.5, 16.0]), n_group=groups, topk_group=topk_group,
               topk_method="noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"),
               scoring_func="sigmoid" if v3 else "softmax", max_position_embeddings=4096,
               rope_theta=rng.choice([10000.0, 50000.0]),
               rope_scaling={"type": "yarn", "factor": rng.choice([2.0, 4.0, 40.0]),
                             "original_max_position_embeddings": rng.choice([64, 128, 1024]), "beta_fast": 32,
                             "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale} if yarn else None)
    if not v3 and cfg["hidden_size"] % cfg["num_attention_heads"]:
        # transformers 5.17 refuses a V2 config whose hidden size is not a multiple of its heads (MLA does not need
        # it): a head count that divides it, drawn apart so that the seed's later configs stay what they were.
        fit = [h for h in (1, 2, 3, 4, 5, 8, 16) if cfg["hidden_size"] % h == 0]
        cfg["num_attention_heads"] = random.Random(cfg["hidden_size"] * 100 + cfg["num_attention_heads"]).choice(fit)
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if os.environ.get("FUZZ_MORE"):
        # The lm_head tied to the embeddings (no published checkpoint does it), drawn apart (from the config so far)
        # so that a seed gives the same configs otherwise. Not drawn, since transformers cannot be the reference:
        # moe_layer_freq (its DeepSeek ports put MoE on every layer from first_k_dense_replace, where DeepSeek's own
        # code, SGLang, vLLM and mlaserve keep every moe_layer_freq-th; 2026-12-06: the checkpoint it saved had MoE
        # weights where mlaserve reads a dense layer's) and no shared experts (5.17 refuses n_shared_experts null).
        more = random.Random(json.dumps(cfg, sort_keys=True))
        cfg["tie_word_embeddings"] = more.random() < 0.5
    return cfg


def main():
    binary, root = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    rng = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
    devices = (sys.argv[5] if len(sys.argv) > 5 else "cuda,cpu").split(",")
    mg.torch.backends.cuda.matmul.allow_tf32 = False  # (fp32 references, as make_golden.py's main sets)
    mg.torch.backends.cudnn.allow_tf32 = False
    mg.PROMPT_LENS = [1, 9, 70]
    mg.NUM_GREEDY = 12
    compare = os.path.join(HERE, "..", "compare_logits.py")
    only = {int(x) for x in os.environ.get("FUZZ_ONLY", "").split(",") if x}  # (these configs only)
    variants = [v.split() for v in os.environ.get("FUZZ_VARIANTS", "").split(";")]  # extra eval-logits flags, per run
    # FUZZ_PATCHES: JSON objects separated by ';', each a variant of every config run (its keys replaced): what
    # changes a failure into a pass.
    patches = [json.loads(p) if p.strip() else {} for p in os.environ.get("FUZZ_PATCHES", "").split(";")]
    fp8 = os.environ.get("FUZZ_FP8", "").split()
    deadline = time.time() + float(os.environ.get("FUZZ_SECONDS", "1e9"))
    failed = 0
    todo = []
    for k in range(n):
        cfg = random_config(rng)
        if only and k not in only:
            continue
        for j, patch in enumerate(patches):
            todo.append((f"fuzz{k}" + (f"p{j}" if patch else ""), dict(cfg, **patch), k))
    for name, cfg, k in todo:
        if time.time() > deadline:
            print(f"{name}: not started, FUZZ_SECONDS passed", flush=True)
            break
        mg.FAMILIES[name] = cfg
        if os.environ.get("FUZZ_VERBOSE"):
            print(name, {key: v for key, v in cfg.items() if key not in mg.BASE})
        brief = {key: cfg[key] for key in ("model_type", "hidden_size", "num_attention_heads", "kv_lora_rank",
                                           "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                           "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                                           "first_k_dense_replace", "num_hidden_layers")}
        try:
            with open(os.devnull, "w") as null:
                saved, sys.stdout = sys.stdout, null
                try:
                    mg.make_family(root, name, 1000 + k)
                finally:
                    sys.stdout = saved
        except Exception as e:  # noqa: BLE001 (a config transformers cannot build is skipped)
            print(f"{name}: skipped, transformers: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        d = os.path.join(root, name)
        if fp8:
            layout = fp8[0]
            blocks = fp8[1:] if layout != "block" or len(fp8) == 3 else \
                [str(random.Random(k).choice([16, 32, 64, 128])) for _ in range(2)]
            brief["fp8"] = " ".join([layout] + blocks)
            q = subprocess.run([sys.executable, os.path.join(HERE, "..", "golden", "make_fp8_golden.py"), d, d + "-fp8",
                                layout] + blocks + (["--dequantized-reference"] if os.environ.get("FUZZ_FP8_REF") ==
                                                    "dequantized" else []), capture_output=True, text=True)
            if q.returncode != 0:
                print(f"{name}: skipped, FP8 reference: {(q.stderr or q.stdout)[-300:]} {brief}", flush=True)
                continue
            d += "-fp8"
            print(f"{name}: " + " ".join(line for line in q.stdout.splitlines() if "max |d|" in line or "reference:"
                                         in line), flush=True)
        for dev, extra in [(dev, v) for dev in devices for v in variants]:
            out = os.path.join(d, f"ours_{dev}.safetensors")
            dev = " ".join([dev] + extra)
            r = subprocess.run([binary, "eval-logits", "--device"] + dev.split() + [
                                "--mem-fraction-static", "0.2", "--model-path",
                                d, "--prompts", os.path.join(d, "reference.safetensors"), "--out", out,
                                "--max-new-tokens", str(mg.NUM_GREEDY)], capture_output=True, text=True)
            if r.returncode != 0:
                failed += 1
                print(f"{name} {dev}: FAIL eval-logits rc {r.returncode}: {(r.stderr or r.stdout)[-300:]} {brief}",
                      flush=True)
                continue
            c = subprocess.run([sys.executable, compare, os.path.join(d, "reference.safetensors"), out, "--tol",
                                "0.06", "--near-tie", "0.1"], capture_output=True, text=True)
            failed += c.returncode != 0
            lines = " | ".join(c.stdout.strip().splitlines())
            if c.returncode:  # how many positions are off: a few (a routing flip in bf16) or all (a wrong op)
                ref, ours = load_file(os.path.join(d, "reference.safetensors")), load_file(out)
                counts = []
                for j in range(len(mg.PROMPT_LENS)):
                    rl, ol = ref[f"logits_{j}"], ours[f"logits_{j}"]
                    err = (rl - ol).abs().amax(dim=-1) / rl.std()
                    counts.append(f"{int((err > 0.06).sum())}/{err.numel()}")
                lines += " | positions off: " + " ".join(counts)
            print(f"{name} {dev}: {'ok' if c.returncode == 0 else 'FAIL'} {lines} {brief if c.returncode else ''}",
                  flush=True)
    print(f"configs: {n}, failures: {failed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
