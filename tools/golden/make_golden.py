#!/usr/bin/env python3
"""Golden data generator (runs on the GPU machine: torch + transformers 5.17).

Builds tiny random DeepSeek checkpoints in the original Hugging Face per-expert layout (bf16, sharded
safetensors + index), then computes fp32 reference logits and greedy continuations with the Hugging Face
implementation (eager attention) loaded back from those files. Output per family:
  DIR/config.json, DIR/model-0000k-of-0000n.safetensors, DIR/model.safetensors.index.json,
  DIR/reference.safetensors with prompt_j (int32 [len]), logits_j (f32 [len, vocab]),
  greedy_j (int32 [N]), margin_j (f32 [N], top1 - top2 logit at each greedy step).

The real-dims families (real16, real128: kv_lora_rank 512, rope 64, nope 128, v 128, 64 experts top-6, 16 or 128
heads; kimi64: 64 heads, 384 experts top-8) are too big to commit: they are generated on the GPU machine at test
time (the reference then runs on the GPU in fp32, TF32 off) and are not part of the default family list.

usage: make_golden.py OUT_DIR [family ...]
"""
import json, math, os, sys

import torch
import transformers
from safetensors.torch import save_file

NUM_GREEDY = 24
PROMPT_LENS = [1, 7, 33, 100, 257]

BASE = dict(
    hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    attention_bias=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
    initializer_range=0.02,
)

FAMILIES = {
    # V2-Lite-like: plain q_proj, greedy softmax routing, no rope scaling, one dense layer first.
    "v2lite": dict(BASE, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
        vocab_size=640, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=64, q_lora_rank=None,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, first_k_dense_replace=1, moe_layer_freq=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, n_group=1, topk_group=1, topk_method="greedy",
        scoring_func="softmax", max_position_embeddings=2048, rope_scaling=None),
    # V2-like: q LoRA, group-limited greedy, YaRN with mscale 0.707, routed_scaling_factor 16.
    "v2": dict(BASE, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
        vocab_size=640, hidden_size=128, intermediate_size=256, moe_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        n_shared_experts=2, n_routed_experts=16, num_experts_per_tok=4, kv_lora_rank=64, q_lora_rank=48,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, first_k_dense_replace=1, moe_layer_freq=1,
        norm_topk_prob=False, routed_scaling_factor=16.0, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", scoring_func="softmax", max_position_embeddings=5120,
        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # V3-like: sigmoid + correction bias, noaux_tc, norm_topk_prob, two dense layers, YaRN mscale 1.
    "v3": dict(BASE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        vocab_size=640, hidden_size=128, intermediate_size=256, moe_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, kv_lora_rank=64, q_lora_rank=48,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, first_k_dense_replace=2, moe_layer_freq=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, n_group=4, topk_group=2, topk_method="noaux_tc",
        scoring_func="sigmoid", max_position_embeddings=5120,
        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # Odd dims (the GoldenModel suite's generality check): V3 form with widths no kernel is tuned to, every layer
    # MoE, two groups of three experts (one kept), two shared experts, plain RoPE of base 50000.
    "odd-v3": dict(BASE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", shard="300KB",
        vocab_size=500, hidden_size=96, intermediate_size=160, moe_intermediate_size=40,
        num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
        n_shared_experts=2, n_routed_experts=6, num_experts_per_tok=3, kv_lora_rank=40, q_lora_rank=24,
        qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=20, first_k_dense_replace=0, moe_layer_freq=1,
        norm_topk_prob=True, routed_scaling_factor=1.5, n_group=2, topk_group=1, topk_method="noaux_tc",
        scoring_func="sigmoid", max_position_embeddings=4096, rope_theta=50000.0, rope_scaling=None),
    # ... and V2 form: five heads, plain q_proj of odd widths, YaRN factor 4 with mscale 0.707. (moe_layer_freq stays
    # 1: transformers 5 builds a MoE in every layer from first_k_dense_replace on whatever it says, while DeepSeek's
    # own code, SGLang, vLLM and mlaserve keep layers off the frequency dense.)
    "odd-v2": dict(BASE, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", shard="300KB",
        vocab_size=500, hidden_size=80, intermediate_size=144, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=5,
        n_shared_experts=1, n_routed_experts=10, num_experts_per_tok=3, kv_lora_rank=48, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, first_k_dense_replace=1, moe_layer_freq=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, n_group=1, topk_group=1, topk_method="greedy",
        scoring_func="softmax", max_position_embeddings=4096,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # Real MLA dims, V2-Lite-like: 16 heads, plain q_proj, greedy softmax top-6 of 64, YaRN as in V2-Lite.
    "real16": dict(BASE, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", shard="16MB",
        vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1, moe_layer_freq=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, n_group=1, topk_group=1, topk_method="greedy",
        scoring_func="softmax", max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # Real MLA dims, V3-like: 128 heads, q LoRA, noaux_tc sigmoid top-6 of 64 in 8 groups (4 kept), YaRN mscale 1.
    "real128": dict(BASE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", shard="16MB",
        vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=64, num_experts_per_tok=6, kv_lora_rank=512, q_lora_rank=384,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1, moe_layer_freq=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, n_group=8, topk_group=4, topk_method="noaux_tc",
        scoring_func="sigmoid", max_position_embeddings=163840,
        rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # Kimi-K2-like (a DeepseekV3ForCausalLM of Moonshot's): 384 experts top-8 in one group (more experts than a
    # block routes), sigmoid noaux_tc, routed_scaling_factor 2.827, YaRN factor 32 with beta 1 / 1, rope_theta 50000.
    "kimi": dict(BASE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        vocab_size=640, hidden_size=64, intermediate_size=128, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=384, num_experts_per_tok=8, kv_lora_rank=64, q_lora_rank=48,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, first_k_dense_replace=1, moe_layer_freq=1,
        norm_topk_prob=True, routed_scaling_factor=2.827, n_group=1, topk_group=1, topk_method="noaux_tc",
        scoring_func="sigmoid", max_position_embeddings=4096, rope_theta=50000.0,
        rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 128,
                      "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # ... with real MLA dims and Kimi-K2's 64 heads (generated on the device at test time, as real16 / real128).
    "kimi64": dict(BASE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", shard="16MB",
        vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=64, num_key_value_heads=64,
        n_shared_experts=1, n_routed_experts=384, num_experts_per_tok=8, kv_lora_rank=512, q_lora_rank=384,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1, moe_layer_freq=1,
        norm_topk_prob=True, routed_scaling_factor=2.827, n_group=1, topk_group=1, topk_method="noaux_tc",
        scoring_func="sigmoid", max_position_embeddings=131072, rope_theta=50000.0,
        rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
}
DEFAULT_FAMILIES = ["v2lite", "v2", "v3"]


def init_weights(model, cfg, seed):
    """Deterministic weights of a sensible scale: unit-variance activations, peaked-enough logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("e_score_correction_bias"):
                v = 0.1 * torch.randn(p.shape, generator=g)
            elif "norm" in name:
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=g)
            elif name.startswith("lm_head"):
                v = 2.0 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            elif p.dim() == 3:  # fused experts inside transformers: fan-in by role, not by layout
                fan_in = cfg["moe_intermediate_size"] if "down" in name else cfg["hidden_size"]
                v = torch.randn(p.shape, generator=g) / math.sqrt(fan_in)
            elif p.dim() == 2:
                v = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            else:
                v = 0.1 * torch.randn(p.shape, generator=g)
            p.copy_(v.to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_((0.1 * torch.randn(b.shape, generator=g)).to(b.dtype))


def make_family(out_root, fam, seed):
    cfg_dict = dict(FAMILIES[fam])
    shard = cfg_dict.pop("shard", "600KB")
    dev = "cuda" if shard != "600KB" and torch.cuda.is_available() else "cpu"
    d = os.path.join(out_root, fam)
    os.makedirs(d, exist_ok=True)
    cfg_cls = transformers.AutoConfig.for_model(cfg_dict["model_type"]).__class__
    config = cfg_cls(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(model, cfg_dict, seed)
    print(fam, [(n, tuple(p.shape)) for n, p in model.named_parameters() if 'layers.%d.' % (cfg_dict['num_hidden_layers'] - 1) in n], flush=True)
    model = model.to(torch.bfloat16)
    model.save_pretrained(d, max_shard_size=shard)
    # Write config.json in the original checkpoint format (rope_scaling, not transformers 5's rope_parameters).
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=1)
    for extra in ("generation_config.json",):
        p = os.path.join(d, extra)
        if os.path.exists(p):
            os.remove(p)
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    names = sorted(index["weight_map"])
    if cfg_dict["num_hidden_layers"] > cfg_dict.get("first_k_dense_replace", 0):  # (a dense-only model has none)
        assert any(".mlp.experts.0.gate_proj.weight" in n for n in names), "expected per-expert layout"
    assert len(set(index["weight_map"].values())) >= 2, "expected a sharded checkpoint"

    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(k), f"{fam}: {k} = {info.get(k)}"
    ref.eval()
    ref.to(dev)
    print(fam, "rope:", getattr(ref.config, "rope_parameters", None), flush=True)

    g = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(2, cfg_dict["vocab_size"], (n,), generator=g, dtype=torch.int64) for n in PROMPT_LENS]
    save_file(reference_tensors(ref, prompts, dev, fam), os.path.join(d, "reference.safetensors"))


def reference_tensors(ref, prompts, dev, tag):
    """prompt_j, logits_j (fp32 [len, vocab]), greedy_j and margin_j of the Hugging Face model `ref`."""
    tensors = {}
    with torch.no_grad():
        for j, prompt in enumerate(prompts):
            n = len(prompt)
            out = ref(prompt[None].to(dev), use_cache=True)
            logits = out.logits[0].float().cpu()
            past = out.past_key_values
            greedy, margins = [], []
            last = logits[-1]
            for _ in range(NUM_GREEDY):
                top2 = torch.topk(last, 2)
                tok = int(top2.indices[0])
                greedy.append(tok)
                margins.append(float(top2.values[0] - top2.values[1]))
                o = ref(torch.tensor([[tok]], device=dev), past_key_values=past, use_cache=True)
                past = o.past_key_values
                last = o.logits[0, -1].float().cpu()
            tensors[f"prompt_{j}"] = prompt.to(torch.int32).contiguous()
            tensors[f"logits_{j}"] = logits.contiguous()
            tensors[f"greedy_{j}"] = torch.tensor(greedy, dtype=torch.int32)
            tensors[f"margin_{j}"] = torch.tensor(margins, dtype=torch.float32)
            print(f"{tag} prompt {j}: len {n} logits std {logits.std():.3f} min margin {min(margins):.4f}",
                  flush=True)
    return tensors


def main():
    out_root = sys.argv[1]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    fams = sys.argv[2:] or DEFAULT_FAMILIES
    print("transformers", transformers.__version__, "torch", torch.__version__)
    for fam in fams:
        make_family(out_root, fam, 1234 + 17 * list(FAMILIES).index(fam))


if __name__ == "__main__":
    main()
