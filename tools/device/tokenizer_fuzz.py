#!/usr/bin/env python3
"""Differential check of `mlaserve tokenize` against Hugging Face's `tokenizers` on random texts (run where both are).

usage: tokenizer_fuzz.py TOKENIZER_DIR MLASERVE_BINARY [N] [SEED]

Random texts mix scripts, digit runs, whitespace kinds, contractions, emoji sequences, control and zero-width
characters and special-token strings; each is encoded by both (no special tokens added) and the ids compared. Random id
sequences (special tokens among them) are decoded by both and the texts compared. Prints the mismatch counts and the
first few of each; exit status 1 if any.
"""
import json
import random
import subprocess
import sys

from tokenizers import Tokenizer

POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    "0123456789" * 3 + ".,-+eE%$",
    " ", "  ", "\t", "\n", "\r\n", "\n\n", " \n ", "\u00a0", "\u3000", "\u2009", "\u200b", "\u200d", "\ufeff",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'LL n't",
    "的一是不了人我在有他这为之大来以个中上们到说国和地也子时道出而要于就下得可你年生自会那后能对着事其里所去行过",
    "あいうえおかきくけこアイウエオカキクケコーッ",
    "한국어텍스트입니다가나다라",
    "العربيةمرحبا",
    "עבריתשלום",
    "हिन्दीनमस्ते",
    "ภาษาไทยสวัสดี",
    "Русскийтекстпривет",
    "ελληνικά",
    "éèêëàâäôöûüçñÉÈÀ",
    "e\u0301a\u0300o\u0308\u0301",  # combining marks
    "😀😃😄👍🏽👨‍👩‍👧‍👦🇫🇷🏳️‍🌈❤️‍🔥",
    "∑∫√∞≈≠≤≥→⇒∀∃∈",
    "ＡＢＣ１２３！？",
    "\x00\x01\x07\x0b\x0c\x1b\x7f",
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
    "<｜tool▁calls▁begin｜>", "<｜fim▁hole｜>", "<|im_start|>", "<s>", "</s>", "<|endoftext|>",
    "def f(x):\n    return x ** 2\n", "http://example.com/a?b=c&d=e", "user@example.com", "#include <vector>\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 𝄞",
]


def random_text(rng):
    parts = []
    for _ in range(rng.randint(1, 12)):
        pool = rng.choice(POOLS)
        if len(pool) > 12 and rng.random() < 0.7:
            k = rng.randint(1, 12)
            parts.append("".join(rng.choice(pool) for _ in range(k)))
        else:
            parts.append(pool * rng.randint(1, 3))
        if rng.random() < 0.3:
            parts.append(rng.choice([" ", "  ", "\n", ""]))
    return "".join(parts)


def run_cli(binary, tok_dir, rows):
    inp = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    out = subprocess.run([binary, "tokenize", "--tokenizer-path", tok_dir], input=inp.encode(), capture_output=True,
                         check=True).stdout.decode()
    return [json.loads(line) for line in out.splitlines()]


def main():
    tok_dir, binary = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 20000
    rng = random.Random(int(sys.argv[4]) if len(sys.argv) > 4 else 1)
    hf = Tokenizer.from_file(tok_dir + "/tokenizer.json")
    texts = [random_text(rng) for _ in range(n)]
    ours = run_cli(binary, tok_dir, [{"text": t} for t in texts])
    bad = [(t, o.get("ids", o), hf.encode(t, add_special_tokens=False).ids)
           for t, o in zip(texts, ours) if o.get("ids") != hf.encode(t, add_special_tokens=False).ids]
    vocab = hf.get_vocab_size()
    seqs = [[rng.randrange(vocab) if rng.random() < 0.95 else rng.randrange(128798, 128815)
             for _ in range(rng.randint(1, 40))] for _ in range(n // 4)]
    seqs = [[i for i in s if hf.id_to_token(i) is not None] or [1] for s in seqs]
    ours_dec = run_cli(binary, tok_dir, [{"ids": s} for s in seqs])
    bad_dec = [(s, o.get("text", o), hf.decode(s, skip_special_tokens=False))
               for s, o in zip(seqs, ours_dec) if o.get("text") != hf.decode(s, skip_special_tokens=False)]
    print(f"encode: {len(bad)} of {n} differ; decode: {len(bad_dec)} of {len(seqs)} differ")
    for t, o, h in bad[:8]:
        print("ENCODE", repr(t), "\n  ours", o, "\n  hf  ", h)
    for s, o, h in bad_dec[:8]:
        print("DECODE", s, "\n  ours", repr(o), "\n  hf  ", repr(h))
    sys.exit(1 if bad or bad_dec else 0)


if __name__ == "__main__":
    main()
