#!/usr/bin/env python3
"""Differential check of `mlaserve tokenize`'s chat template against transformers' apply_chat_template.

usage: chat_template_fuzz.py TOKENIZER_DIR MLASERVE_BINARY [N] [SEED]

Random conversations (system / user / assistant turns, assistant tool calls and tool results, reasoning text,
multi-line and non-ASCII content), with and without the generation prompt, rendered by both; the texts and ids are
compared (the ids against tokenizer.json applied by `tokenizers`). Conversations transformers refuses are counted,
not compared. Exit status 1 on any difference.
"""
import json
import random
import subprocess
import sys

from tokenizers import Tokenizer
from transformers import AutoTokenizer

WORDS = ["hello", "world", "Paris", "天气", "😀", "x = 1\ny = 2", "  spaced  ", "<think>hm</think>", "a\n\nb",
         "naïve", "{\"k\": [1, 2]}", "", "What's up?", "tab\there", "<｜User｜>", "end."]


def text(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))


def conversation(rng):
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": text(rng)})
    for _ in range(rng.randint(1, 4)):
        msgs.append({"role": "user", "content": text(rng)})
        if rng.random() < 0.3:
            calls = [{"type": "function", "function": {"name": rng.choice(["get_weather", "search", "f"]),
                                                         "arguments": json.dumps({"q": text(rng)})}}
                     for _ in range(rng.randint(1, 2))]
            msgs.append({"role": "assistant", "content": rng.choice([None, "", text(rng)]), "tool_calls": calls})
            for _ in calls:
                msgs.append({"role": "tool", "content": text(rng)})
            if rng.random() < 0.7:
                msgs.append({"role": "assistant", "content": text(rng)})
        elif rng.random() < 0.8:
            msgs.append({"role": "assistant", "content": text(rng)})
    return msgs


def main():
    tok_dir, binary = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
    rng = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
    hf = AutoTokenizer.from_pretrained(tok_dir)
    # The ids: tokenizer.json applied by `tokenizers` (transformers 5's Llama tokenizer class, which DeepSeek's
    # tokenizer_config names, splits whitespace otherwise).
    raw = Tokenizer.from_file(tok_dir + "/tokenizer.json")
    cases, want = [], []
    refused = 0
    for _ in range(n):
        msgs, agp = conversation(rng), rng.random() < 0.6
        try:
            want.append(hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp))
        except Exception:  # noqa: BLE001 (a conversation the template refuses)
            refused += 1
            continue
        cases.append({"messages": msgs, "add_generation_prompt": agp})
    inp = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in cases)
    out = subprocess.run([binary, "tokenize", "--tokenizer-path", tok_dir], input=inp.encode(), capture_output=True,
                         check=True).stdout.decode().splitlines()
    bad, bad_ids = [], []
    for c, w, line in zip(cases, want, out):
        got = json.loads(line)
        ids = raw.encode(w, add_special_tokens=False).ids
        if got.get("text") != w:
            bad.append((c, got, w))
        elif got.get("ids") != ids:
            bad_ids.append((w, got.get("ids"), ids))
    print(f"chat template: {len(bad)} texts and {len(bad_ids)} id lists of {len(cases)} differ ({refused} refused by "
          "transformers)")
    for c, got, w in bad[:5]:
        print("CASE", json.dumps(c, ensure_ascii=False), "\n  ours", repr(got.get("text", got)), "\n  hf  ", repr(w))
    for w, ours, ids in bad_ids[:3]:
        k = next((i for i, (a, b) in enumerate(zip(ours or [], ids)) if a != b), min(len(ours or []), len(ids)))
        print("IDS", repr(w), "\n  at", k, "ours", (ours or [])[max(0, k - 3):k + 5], "hf", ids[max(0, k - 3):k + 5],
              len(ours or []), len(ids))
    sys.exit(1 if bad or bad_ids else 0)


if __name__ == "__main__":
    main()
