#!/usr/bin/env python3
"""Final hidden states of the golden models (runs on the GPU machine: torch + transformers).

For each family directory made by make_golden.py (its checkpoint and reference.safetensors), loads the Hugging Face
model in fp32 and writes DIR/hidden.safetensors with hidden_j (f32 [len_j + N - 1, hidden]): the model's last hidden
state (after the final norm, what lm_head reads) at every position of prompt_j followed by greedy_j's first N - 1
tokens: the rows SGLang's return_hidden_states gives for that prompt and its N greedy tokens. Checks on the way that
lm_head of the prompt rows gives reference.safetensors' logits_j.

usage: make_hidden_golden.py DATA_DIR OUT_DIR [family ...]   (writes OUT_DIR/<family>/hidden.safetensors)
"""
import os, sys

import torch
import transformers
from safetensors.torch import load_file, save_file


def main():
    data, out_root = sys.argv[1], sys.argv[2]
    fams = sys.argv[3:] or ["v2lite", "v2", "v3"]
    torch.backends.cuda.matmul.allow_tf32 = False
    print("transformers", transformers.__version__, "torch", torch.__version__, flush=True)
    for fam in fams:
        d = os.path.join(data, fam)
        ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        ref.eval()
        gold = load_file(os.path.join(d, "reference.safetensors"))
        tensors = {}
        with torch.no_grad():
            j = 0
            while f"prompt_{j}" in gold:
                prompt, greedy = gold[f"prompt_{j}"].long(), gold[f"greedy_{j}"].long()
                ids = torch.cat([prompt, greedy[:-1]])
                hidden = ref.model(ids[None]).last_hidden_state[0].float()
                logits = ref.lm_head(hidden[: len(prompt)]).float()
                err = (logits - gold[f"logits_{j}"]).abs().max().item()
                scale = gold[f"logits_{j}"].std().item()
                assert err < 1e-3 * max(scale, 1.0), f"{fam} prompt {j}: lm_head(hidden) is {err} off the logits"
                tensors[f"hidden_{j}"] = hidden.contiguous()
                print(f"{fam} prompt {j}: {tuple(hidden.shape)} std {hidden.std():.3f}, logits within {err:.2e}",
                      flush=True)
                j += 1
        os.makedirs(os.path.join(out_root, fam), exist_ok=True)
        save_file(tensors, os.path.join(out_root, fam, "hidden.safetensors"))


if __name__ == "__main__":
    main()
