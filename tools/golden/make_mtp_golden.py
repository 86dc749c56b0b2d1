#!/usr/bin/env python3
"""MTP golden data (runs on the GPU machine: torch + transformers 5.17).

A tiny V3-like checkpoint with one MTP layer (num_nextn_predict_layers 1), laid out as DeepSeek-V3's: the MTP layer
is model.layers.{N} (N = num_hidden_layers), a decoder layer plus enorm, hnorm, eh_proj [H, 2H], shared_head.norm,
and copies of the embedding and lm_head (embed_tokens, shared_head.head). Hugging Face has no MTP module, so its
reference is composed from Hugging Face parts:
  h_t      = the model's final hidden state at position t (last_hidden_state: after the final norm)
  x_t      = eh_proj([rmsnorm(embed(next_t)) * enorm; rmsnorm(h_t) * hnorm])
  logits_t = a one-layer DeepseekV3ForCausalLM whose layer is the MTP's decoder layer, whose final norm is
             shared_head.norm and whose lm_head is the model's, run on inputs_embeds x at positions 0..n-1
next_t is the prompt's token t + 1, and after the last position the model's greedy token.
Chained drafts (SGLang's --speculative-num-steps above 1) go on from the last position: draft c (the greedy token of
the previous MTP logits) and the previous MTP output at the last position (after shared_head.norm, as SGLang chains
it) make one more position of the one-layer model's input:
  x_{n-1+c} = eh_proj([rmsnorm(embed(draft_c)) * enorm; rmsnorm(shared_head.norm(out_{n-2+c})) * hnorm])
Output DIR/v3mtp: config.json, the shards + index, reference.safetensors with the model's prompt_j, logits_j,
greedy_j, margin_j (as make_golden.py) and mtp_next_j (int32 [len]), mtp_logits_j (f32 [len, vocab]), and for
CHAIN chained steps mtp_chain_ids_j (int32 [CHAIN]: the drafts fed) and mtp_chain_logits_j (f32 [CHAIN, vocab]).

usage: make_mtp_golden.py OUT_DIR
"""
import json, os, sys

import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden as mg  # noqa: E402

PROMPT_LENS = [1, 7, 33, 100]
CHAIN = 3


def rmsnorm(x, w, eps):
    x = x.float()
    return w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def main():
    out_root = sys.argv[1]
    torch.backends.cuda.matmul.allow_tf32 = False
    fam, seed = "v3mtp", 4321
    cfg_dict = dict(mg.FAMILIES["v3"])
    n_layers, H, eps = cfg_dict["num_hidden_layers"], cfg_dict["hidden_size"], cfg_dict["rms_norm_eps"]
    d = os.path.join(out_root, fam)
    os.makedirs(d, exist_ok=True)
    cfg_cls = transformers.AutoConfig.for_model(cfg_dict["model_type"]).__class__

    def config_of(**over):
        c = dict(cfg_dict, **over)
        return cfg_cls(**{k: v for k, v in c.items() if k not in ("architectures", "model_type")})

    # N + 1 layers: the last one is the MTP layer's decoder layer (model.layers.N.* as in the checkpoint).
    full = transformers.AutoModelForCausalLM.from_config(config_of(num_hidden_layers=n_layers + 1),
                                                         dtype=torch.float32)
    mg.init_weights(full, cfg_dict, seed)
    full = full.to(torch.bfloat16)
    full.save_pretrained(d, max_shard_size="600KB")
    g = torch.Generator().manual_seed(seed + 7)
    extra = {
        f"model.layers.{n_layers}.enorm.weight": 1.0 + 0.1 * torch.randn(H, generator=g),
        f"model.layers.{n_layers}.hnorm.weight": 1.0 + 0.1 * torch.randn(H, generator=g),
        f"model.layers.{n_layers}.eh_proj.weight": torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5,
        f"model.layers.{n_layers}.shared_head.norm.weight": 1.0 + 0.1 * torch.randn(H, generator=g),
    }
    extra = {k: v.to(torch.bfloat16).contiguous() for k, v in extra.items()}
    sd = full.state_dict()
    # The copies DeepSeek-V3's checkpoint holds (the engine uses the model's own embedding and lm_head).
    extra[f"model.layers.{n_layers}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone().contiguous()
    extra[f"model.layers.{n_layers}.shared_head.head.weight"] = sd["lm_head.weight"].clone().contiguous()
    save_file(extra, os.path.join(d, "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(index_path))
    for k in extra:
        index["weight_map"][k] = "model-mtp.safetensors"
    json.dump(index, open(index_path, "w"), indent=1)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(dict(cfg_dict, num_nextn_predict_layers=1), f, indent=1)
    gen = os.path.join(d, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)

    # The model (N layers) from the files; the MTP tensors are extra keys to it.
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info.get("missing_keys"), info.get("missing_keys")
    assert ref.config.num_hidden_layers == n_layers
    ref.eval()

    # The MTP's decoder layer as a one-layer model (MoE like layer N of the checkpoint), its final norm
    # shared_head.norm, its lm_head the model's.
    first_dense = 0 if n_layers >= cfg_dict["first_k_dense_replace"] else 1
    mtp = transformers.AutoModelForCausalLM.from_config(
        config_of(num_hidden_layers=1, first_k_dense_replace=first_dense), dtype=torch.float32,
        attn_implementation="eager")
    msd = {}
    prefix = f"model.layers.{n_layers}."
    for k, v in sd.items():
        if k.startswith(prefix):
            msd["model.layers.0." + k[len(prefix):]] = v.float()
    msd["model.norm.weight"] = extra[prefix + "shared_head.norm.weight"].float()
    msd["lm_head.weight"] = sd["lm_head.weight"].float()
    msd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"].float()
    missing, unexpected = mtp.load_state_dict(msd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    mtp.eval()

    gp = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(2, cfg_dict["vocab_size"], (n,), generator=gp, dtype=torch.int64) for n in PROMPT_LENS]
    tensors = mg.reference_tensors(ref, prompts, "cpu", fam)
    embed = sd["model.embed_tokens.weight"].float()
    eh = extra[prefix + "eh_proj.weight"].float()

    def run_mtp(inputs):  # the one-layer model's logits and hidden state (after shared_head.norm) at the last position
        hs = mtp.model(inputs_embeds=inputs[None], position_ids=torch.arange(inputs.shape[0])[None],
                       use_cache=False).last_hidden_state[0, -1]
        return mtp.lm_head(hs).float(), hs.float()

    with torch.no_grad():
        for j, prompt in enumerate(prompts):
            n = len(prompt)
            h = ref.model(prompt[None]).last_hidden_state[0].float()
            nxt = torch.cat([prompt[1:], tensors[f"greedy_{j}"][:1].to(torch.int64)])
            e = embed[nxt]
            x = torch.cat([rmsnorm(e, extra[prefix + "enorm.weight"], eps),
                           rmsnorm(h, extra[prefix + "hnorm.weight"], eps)], dim=-1) @ eh.t()
            out = mtp(inputs_embeds=x[None], position_ids=torch.arange(n)[None], use_cache=False)
            logits = out.logits[0].float()
            tensors[f"mtp_next_{j}"] = nxt.to(torch.int32).contiguous()
            tensors[f"mtp_logits_{j}"] = logits.contiguous()
            chain_ids, chain_logits = [], []
            last_logits, last_hidden = run_mtp(x)
            for c in range(CHAIN):
                draft = int(last_logits.argmax())
                xc = torch.cat([rmsnorm(embed[draft], extra[prefix + "enorm.weight"], eps),
                                rmsnorm(last_hidden, extra[prefix + "hnorm.weight"], eps)], dim=-1) @ eh.t()
                x = torch.cat([x, xc[None]])
                last_logits, last_hidden = run_mtp(x)
                chain_ids.append(draft)
                chain_logits.append(last_logits)
            tensors[f"mtp_chain_ids_{j}"] = torch.tensor(chain_ids, dtype=torch.int32)
            tensors[f"mtp_chain_logits_{j}"] = torch.stack(chain_logits).contiguous()
            print(f"{fam} prompt {j}: len {n} MTP logits std {logits.std():.3f}", flush=True)
    save_file(tensors, os.path.join(d, "reference.safetensors"))


if __name__ == "__main__":
    main()
