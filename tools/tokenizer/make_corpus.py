#!/usr/bin/env python3
"""Writes the tokenizer test corpus (tests/tokenizer/data/corpus.jsonl) and, with --bench, a benchmark text.

The corpus is hand-written cases (code, scripts, emoji, whitespace, special tokens, repeats) plus seeded random
Unicode strings. Random code points are drawn only from characters assigned in this Python's Unicode database
(Python 3.11 = Unicode 14, the version of Debian 12's PCRE2), so the regex engines of both sides agree on every
character's properties. Deterministic: the same seed gives the same files.

usage: tools/tokenizer/make_corpus.py [--out tests/tokenizer/data/corpus.jsonl] [--bench FILE --bench-mb N]
"""
import argparse
import json
import random
import sys
import unicodedata

HAND = [
    "", " ", "  ", "\n", "\r\n", "\t", "a", "Hello, world!", "Hello world", " Hello world", "hello   world  ",
    "The quick brown fox jumps over the lazy dog.", "I'm sure you'll see they've done it; we'd know, won't we?",
    "HELLO World hElLo", "e-mail: someone@example.com, url: https://example.org/path?q=1&r=2#frag",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "#include <vector>\nint main() {\n\tstd::vector<int> v{1, 2, 3};\n\treturn v.size() > 2 ? 0 : 1;\n}\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }",
    '{"key": "value", "list": [1, 2.5, -3e10, true, null], "nested": {"a": "\\u00e9"}}',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    "    indented\n\n\n    lines\r\n\r\nwith \t tabs\t\t and   spaces   \n",
    "trailing spaces    ", "   leading spaces", "\n\n\n\n", "\r\n\r\n\r\n", " \n \n ", "\t\n\t\n",
    "12345678901234567890", "3.14159265358979", "1,000,000 and 2.000.000", "version 1.2.3-rc4", "0x1F 0b1010 1e-9",
    "٠١٢٣٤٥٦٧٨٩ and ０１２３４５", "Ⅻ ½ ¾ ² ³", "2024-01-31T23:59:59Z",
    "我们今天去公园散步，天气非常好。", "深度求索（DeepSeek）是一家人工智能公司。", "中文English混合mixed文本123个字",
    "日本語のテキストです。ひらがなとカタカナ、漢字。", "カタカナだけのテキスト", "ｶﾀｶﾅ半角", "ひらがな",
    "한국어 텍스트입니다. 안녕하세요!", "조선말 ㄱㄴㄷ ㅏㅑㅓ",
    "مرحبا بالعالم! هذا نص عربي.", "שלום עולם", "Привет, мир! Это русский текст.", "Ελληνικά κείμενα ΣΊΣΥΦΟΣ",
    "हिन्दी पाठ नमस्ते", "ภาษาไทย สวัสดี", "Tiếng Việt có dấu: Đường phố Hà Nội",
    "👋🌍 emoji!", "👨‍👩‍👧‍👦 family", "👍🏽👍🏿👋🏻", "🏳️‍🌈 flag", "🇺🇸🇯🇵 flags", "❤️‍🔥 heart on fire", "🧑🏾‍💻 coder",
    "e\u0301 vs \u00e9", "a\u0300\u0301\u0302\u0303 stacked", "Z\u0351\u0352\u0353a\u0354\u0355lgo", "ñ n\u0303",
    "Å\u212b \u1e9b\u0323", "ﬁ ﬂ ﬀ ligatures", "ｆｕｌｌｗｉｄｔｈ ＡＢＣ", "㎏ ㎞ ℃ ™ №",
    "\u00a0non-breaking\u00a0space", "zero\u200bwidth\u200cjoiner\u200d", "line\u2028separator\u2029para",
    "nel\u0085char", "soft\u00adhyphen", "\u3000ideographic space\u3000",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "ab" * 200, "的" * 150, "😀" * 60, " " * 300, "\n" * 100, "-" * 120, "=" * 80 + "\n" + "=" * 80,
    "1" * 100, "123 " * 50, "hello " * 100,
    "<｜begin▁of▁sentence｜>Hello<｜end▁of▁sentence｜>", "text <｜User｜>question<｜Assistant｜>answer",
    "<｜User｜><｜Assistant｜>", "<｜begin▁of▁sentence｜><｜begin▁of▁sentence｜>", "a<｜end▁of▁sentence｜>b c",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{}\n```<｜tool▁call▁end｜>",
    "<｜begin▁of▁sentence｜", "｜>partial special｜", "<think>\nreasoning\n</think>\n\nanswer", "<|im_start|>user",
    "[CLS] [SEP] [MASK] <mask> <s></s>", "hello world hello_world helloworld", "<|x|>  tail", "x<|x|>y",
    "¡Hola! ¿Qué tal? «citation» “quotes” ‘single’ — dash – en … ellipsis",
    "Mixed: Ärger über Öl, straße, ÇA ÇAVA, İstanbul ıi", "ǅ ǈ ǋ titlecase", "ΣΑΣ σας ς",
    "Tab\tseparated\tvalues\n1\t2\t3", "   \t   \n   ", "a\rb\rc", "'s 're 've 'm 'll 'd 'S 'RE",
    "don't DON'T it's IT'S", "!!!???...,,,;;;", "@@@ ### $$$ %%% ^^^ &&& ***", "(((nested)))[[[]]]{{{}}}",
    "https://github.com/deepseek-ai/DeepSeek-V3/blob/main/README.md",
    "path/to/file_name-v2.final.tar.gz", "CamelCaseIdentifier snake_case_identifier kebab-case-identifier",
    "x = [i**2 for i in range(100) if i % 3 == 0]", "λx.x → ∀x∈ℝ: x² ≥ 0 ∧ ¬(x < 0)", "∑_{i=1}^{n} i = n(n+1)/2",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 𝒮𝒸𝓇𝒾𝓅𝓉", "𐍈 gothic 𓀀 hieroglyph 𠀀 ext-B", "\U0001F9D1\u200D\U0001F91D\u200D\U0001F9D1",
    "ﷺ ﷽", "ﾃｽﾄ", "①②③ ⑴⑵⑶", "Ａ１　Ｂ２", "\ufeffBOM at start", "end with combining e\u0301",
]


def assigned_chars():
    """All assigned, non-surrogate, non-private code points, grouped by rough class for weighting."""
    groups = {"ascii": [], "latin": [], "cjk": [], "kana": [], "hangul": [], "arabic": [], "cyrillic": [],
              "emoji": [], "mark": [], "space": [], "digit": [], "other": []}
    for cp in range(0x110000):
        c = chr(cp)
        cat = unicodedata.category(c)
        if cat in ("Cn", "Cs", "Co"):
            continue
        if cp < 0x80:
            groups["ascii"].append(c)
        elif cat.startswith("M"):
            groups["mark"].append(c)
        elif cat in ("Zs", "Zl", "Zp") or cp in (0x85, 0x0b, 0x0c, 0x1c, 0x1d, 0x1e, 0x1f):
            groups["space"].append(c)
        elif cat == "Nd" or cat == "No" or cat == "Nl":
            groups["digit"].append(c)
        elif cp < 0x250 or 0x1E00 <= cp < 0x1F00:
            groups["latin"].append(c)
        elif 0x4E00 <= cp < 0xA000 or 0x3400 <= cp < 0x4DC0 or 0x20000 <= cp < 0x2A6E0:
            groups["cjk"].append(c)
        elif 0x3040 <= cp < 0x3100 or 0xFF65 <= cp < 0xFFA0:
            groups["kana"].append(c)
        elif 0xAC00 <= cp < 0xD7A4 or 0x1100 <= cp < 0x1200 or 0x3130 <= cp < 0x3190:
            groups["hangul"].append(c)
        elif 0x600 <= cp < 0x700 or 0xFB50 <= cp < 0xFE00 or 0xFE70 <= cp < 0xFF00:
            groups["arabic"].append(c)
        elif 0x400 <= cp < 0x530:
            groups["cyrillic"].append(c)
        elif 0x1F000 <= cp < 0x1FB00 or 0x2600 <= cp < 0x2800 or cp in (0x200D, 0xFE0F):
            groups["emoji"].append(c)
        else:
            groups["other"].append(c)
    return groups


WEIGHTS = {"ascii": 30, "latin": 6, "cjk": 8, "kana": 5, "hangul": 5, "arabic": 4, "cyrillic": 5, "emoji": 6,
           "mark": 4, "space": 5, "digit": 5, "other": 10}


def random_string(rng, groups, names, weights):
    n = rng.choice([0, 1, 2, 3, 5, 8, 13, 21, 34, 55]) + rng.randrange(4)
    out = []
    for _ in range(n):
        g = rng.choices(names, weights)[0]
        if g == "ascii" and rng.random() < 0.3:
            out.append(rng.choice(" \n\r\t"))
        elif g == "emoji" and rng.random() < 0.3:
            out.append(rng.choice(["\u200d", "\ufe0f", "\U0001F3FB", "\U0001F3FF", "\U0001F469\u200D\U0001F4BB"]))
        else:
            out.append(rng.choice(groups[g]))
    return "".join(out)


SYLLABLES = ["th", "e", "an", "re", "in", "on", "at", "er", "st", "ou", "ing", "ion", "ed", "al", "ar", "s", "t",
             "con", "pro", "ver", "ment", "ly", "ex", "com", "de", "ble", "ty", "qu", "y", "o", "a", "i"]


def pseudo_word(rng):
    """English-looking words so the benchmark has many distinct words, as real text does."""
    w = "".join(rng.choice(SYLLABLES) for _ in range(rng.choice([1, 1, 2, 2, 2, 3, 3, 4])))
    r = rng.random()
    if r < 0.1:
        w = w.capitalize()
    elif r < 0.15:
        w += rng.choice([",", ".", ";", ":", "!", "?", "'s", ")"])
    elif r < 0.17:
        w = str(rng.randrange(100000))
    return w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/tokenizer/data/corpus.jsonl")
    ap.add_argument("--random", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=8)
    ap.add_argument("--bench", help="also write a benchmark text file (one document per line)")
    ap.add_argument("--bench-mb", type=float, default=6.0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    groups = assigned_chars()
    names = list(WEIGHTS)
    weights = [WEIGHTS[n] for n in names]
    texts = list(HAND) + [random_string(rng, groups, names, weights) for _ in range(args.random)]
    with open(args.out, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    print(f"{args.out}: {len(texts)} texts", file=sys.stderr)
    if args.bench:
        # Documents built from the hand-written cases' words (a Zipf-like reuse, as in real text) plus some
        # random Unicode lines, each document one line of a few KB, escaped newlines kept as real '\n' inside.
        words = " ".join(HAND[:140]).split(" ")
        words = [w for w in words if w]
        target = int(args.bench_mb * 1e6)
        size = 0
        with open(args.bench, "w", encoding="utf-8") as f:
            while size < target:
                r = rng.random()
                if r < 0.1:
                    doc = " ".join(random_string(rng, groups, names, weights) for _ in range(40))
                elif r < 0.5:
                    doc = " ".join(pseudo_word(rng) for _ in range(500))
                else:
                    doc = " ".join(rng.choice(words[: rng.randrange(10, len(words))]) for _ in range(500))
                doc = doc.replace("\n", "\\n")  # one document per line; '\n' stays as two chars
                f.write(doc + "\n")
                size += len(doc.encode()) + 1
        print(f"{args.bench}: {size / 1e6:.1f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
