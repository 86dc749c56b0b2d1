#!/usr/bin/env python3
"""FP8 golden data (runs on the GPU machine: torch + transformers 5.17).

Quantizes a golden family's linear weights (not the embedding, lm_head, norms or router) to F8_E4M3 and writes the
checkpoint in one of the two layouts mlaserve loads:
  block (DeepSeek-V3's): `weight_scale_inv` F32 per BR x BC block, quantization_config weight_block_size [BR, BC];
  tensor (AutoFP8's):    one `weight_scale` per tensor (+ an unused static `input_scale`), no weight_block_size.
Scales are powers of two (the dequantized weights are exact in bf16). Then loads it back with Hugging Face
(FineGrainedFP8Config(dequantize=True) for the block layout: the weights dequantized to the model dtype, fp32 here)
and writes reference.safetensors for the golden family's prompts, in make_golden.py's format: the golden tests
(tests/golden/data/v3-fp8, v2-fp8-tensor) and `mlaserve eval-logits` + tools/compare_logits.py use it.
The tensor layout has no Hugging Face loader here; its reference is the same model dequantized in torch.

With --dequantized-reference the block layout's reference is made as the tensor layout's (Hugging Face on the
torch-dequantized weights): DeepSeek's block reading without Hugging Face's FP8 loader, which fuses the experts'
gate and up weights and their scales (so a block that does not divide the expert width is read by its own rules).

usage: make_fp8_golden.py SRC_FAMILY_DIR OUT_DIR block BR BC | tensor [--dequantized-reference]
"""
import json, os, sys

import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden  # noqa: E402
from make_golden import reference_tensors  # noqa: E402

FP8_MAX = 448.0


def quantizable(name, t):
    return (t.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name and "lm_head" not in name
            and "norm" not in name and not name.endswith("mlp.gate.weight"))


def quantize(w, br, bc):
    """(fp8 weight, scale [ceil(R/br), ceil(C/bc)], dequantized fp32 weight)."""
    w = w.float()
    R, C = w.shape
    sr, sc = -(-R // br), -(-C // bc)
    pad = torch.zeros(sr * br, sc * bc)
    pad[:R, :C] = w
    blocks = pad.view(sr, br, sc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    # Powers of two, so the dequantized weights are exact in bf16 (mlaserve's CPU backend holds bf16 weights and
    # computes in fp32 like the fp32 reference; arbitrary scales are covered by tests/golden/loader_test.cpp).
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX))), torch.ones_like(amax))
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:R, :C]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def main():
    deq_ref = "--dequantized-reference" in sys.argv
    sys.argv = [a for a in sys.argv if a != "--dequantized-reference"]
    src, out, layout = sys.argv[1], sys.argv[2], sys.argv[3]
    br, bc = (int(sys.argv[4]), int(sys.argv[5])) if layout == "block" else (None, None)
    os.makedirs(out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    weights = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors") and f.startswith("model"):
            weights.update(load_file(os.path.join(src, f)))
    fp8, deq = {}, {}
    for n, t in weights.items():
        if not quantizable(n, t):
            fp8[n] = t
            deq[n] = t
            continue
        R, C = t.shape
        q, s, d = quantize(t, br or R, bc or C)
        stem = n[: -len(".weight")]
        fp8[n] = q
        if layout == "block":
            fp8[stem + ".weight_scale_inv"] = s.contiguous()
        else:
            fp8[stem + ".weight_scale"] = s.reshape(()).contiguous()
            fp8[stem + ".input_scale"] = torch.tensor(1.0)
        deq[n] = d
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [br, bc]}
        if layout == "block" else {"quant_method": "fp8", "activation_scheme": "static"})
    save_file(fp8, os.path.join(out, "model.safetensors"))
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)

    srcref = load_file(os.path.join(src, "reference.safetensors"))
    prompts = [srcref[f"prompt_{j}"].long() for j in range(len([k for k in srcref if k.startswith("prompt_")]))]
    make_golden.NUM_GREEDY = srcref["greedy_0"].numel()  # (as many greedy tokens as the source family's reference)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if layout == "block" and not deq_ref:
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, attn_implementation="eager",
            quantization_config=transformers.FineGrainedFP8Config(weight_block_size=(br, bc), dequantize=True))
        how = "Hugging Face FineGrainedFP8 (dequantize=True)"
        # The loaded weights are the dequantized ones (checked against the torch dequantization).
        sd = ref.state_dict()
        worst = max((sd[n].float().cpu() - deq[n]).abs().max().item() for n in deq if n in sd and n in fp8
                    and fp8[n].dtype == torch.float8_e4m3fn)
        print(f"Hugging Face dequantized weights vs torch: max |d| {worst:.3e}", flush=True)
    else:
        tmp = os.path.join(out, "dequantized")
        os.makedirs(tmp, exist_ok=True)
        plain = {k: v for k, v in cfg.items() if k != "quantization_config"}
        json.dump(plain, open(os.path.join(tmp, "config.json"), "w"))
        save_file({k: v.contiguous() for k, v in deq.items()}, os.path.join(tmp, "model.safetensors"))
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
        how = "Hugging Face on the torch-dequantized weights"
    ref.eval()
    ref.to(dev)
    print("reference:", how, flush=True)
    save_file(reference_tensors(ref, prompts, dev, f"fp8-{layout}"), os.path.join(out, "reference.safetensors"))


if __name__ == "__main__":
    main()
