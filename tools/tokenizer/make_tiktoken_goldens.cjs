#!/usr/bin/env node
// Golden data for mlaserve's tiktoken tests (tests/tokenizer/tiktoken_test.cpp), from tiktoken itself: the npm
// package `tiktoken` is its Rust core built to WebAssembly (installed in tests/npm by scripts/setup.sh). Nothing
// here is used by the product.
//
// Two fixtures, each a folder under tests/tokenizer/data/tiktoken/ holding what a checkpoint would hold next to
// tiktoken.model (a tokenization_*.py class file read, not run, by mlaserve; tokenizer_config.json) plus fixture.json
// (which of the package's vocabularies the test writes out as tiktoken.model) and the goldens:
//   kimi    o200k_base's ranks under Kimi-K2's pattern (class intersections, \p{Han}), its special-token layout, and
//           its encode's cuts (runs of 25,000 whitespace / non-whitespace characters)
//   cl100k  cl100k_base's ranks and pattern, one string literal, 4 special tokens, no cuts
// ids.jsonl: per text of tests/tokenizer/data/corpus.jsonl, the ids transformers' slow path gives for Kimi's class
// (split on the added tokens, then the class's encode on each piece between them); extra.jsonl: texts of its own.
//
// usage (repo root): node tools/tokenizer/make_tiktoken_goldens.cjs
"use strict";
const fs = require("fs");
const path = require("path");

const root = path.resolve(__dirname, "../..");
const npm = path.join(root, "tests/npm/node_modules/tiktoken");
const { Tiktoken } = require(path.join(npm, "lite/tiktoken.cjs"));
const dataDir = path.join(root, "tests/tokenizer/data");
const corpus = fs.readFileSync(path.join(dataDir, "corpus.jsonl"), "utf8").split("\n").filter((l) => l)
  .map((l) => JSON.parse(l).text);

// Kimi-K2's pattern, part by part (Rust regex syntax, as its class writes it).
const KIMI_PARTS = [
  String.raw`[\p{Han}]+`,
  String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*` +
    String.raw`[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
  String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+` +
    String.raw`[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?`,
  String.raw`\p{N}{1,3}`,
  String.raw` ?[^\s\p{L}\p{N}]+[\r\n]*`,
  String.raw`\s*[\r\n]+`,
  String.raw`\s+(?!\S)`,
  String.raw`\s+`,
];

// Kimi's named special ids (offsets from len(ranks)); the rest of the 256 are <|reserved_token_N|>.
const KIMI_NAMED = {
  0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
  7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
  12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
  15: "<|tool_call_end|>", 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]",
};

// Python's str.isspace.
function pyIsSpace(cp) {
  return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp === 0x85 || cp === 0xa0 || cp === 0x1680 ||
    (cp >= 0x2000 && cp <= 0x200a) || cp === 0x2028 || cp === 0x2029 || cp === 0x202f || cp === 0x205f ||
    cp === 0x3000;
}

// The class's encode: chunks of maxChars code points, each cut where a run of (non-)whitespace passes maxRun.
function cuts(text, maxChars, maxRun) {
  const cps = Array.from(text);
  const out = [];
  for (let c = 0; c < cps.length; c += maxChars) {
    const s = cps.slice(c, c + maxChars);
    let len = 0, isSpace = s.length ? pyIsSpace(s[0].codePointAt(0)) : false, start = 0;
    for (let i = 0; i < s.length; i++) {
      const now = pyIsSpace(s[i].codePointAt(0));
      if (isSpace !== now) {
        len = 1;
        isSpace = now;
      } else if (++len > maxRun) {
        out.push(s.slice(start, i).join(""));
        start = i;
        len = 1;
      }
    }
    out.push(s.slice(start).join(""));
  }
  return out;
}

function escapeRe(s) {
  return s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
}

function makeFixture(f) {
  const enc = JSON.parse(fs.readFileSync(path.join(npm, `encoders/${f.ranks}.json`), "utf8"));
  const fields = enc.bpe_ranks.split(" ");
  let n = 0;
  for (let i = 0; i < fields.length; i++) {
    if (fields[i] === "!") i++;
    else n++;
  }
  const specials = {};
  const decoder = {};
  for (let k = 0; k < f.numSpecial; k++) {
    const id = n + k;
    const name = f.named[k] ?? `<|reserved_token_${id}|>`;
    specials[name] = id;
    if (f.named[k]) decoder[String(id)] = { content: name, lstrip: false, normalized: false, rstrip: false,
      single_word: false, special: true };
  }
  const tk = new Tiktoken(enc.bpe_ranks, specials, f.pattern);
  // transformers' slow path: added tokens first (the longest at a position), then the class's encode between them.
  const names = Object.keys(specials).sort((a, b) => b.length - a.length);
  const splitter = new RegExp(names.map(escapeRe).join("|"), "gu");
  function encode(text) {
    const ids = [];
    let last = 0;
    const pieces = [];
    for (const m of text.matchAll(splitter)) {
      pieces.push([text.slice(last, m.index), null]);
      pieces.push([null, specials[m[0]]]);
      last = m.index + m[0].length;
    }
    pieces.push([text.slice(last), null]);
    for (const [t, id] of pieces) {
      if (id !== null) {
        ids.push(id);
        continue;
      }
      const parts = f.maxChars ? cuts(t, f.maxChars, f.maxRun) : [t];
      for (const p of parts) if (p.length) ids.push(...tk.encode_ordinary(p));
    }
    return ids;
  }

  const dir = path.join(dataDir, "tiktoken", f.name);
  fs.mkdirSync(dir, { recursive: true });
  fs.writeFileSync(path.join(dir, "fixture.json"), JSON.stringify({ ranks: f.ranks, num_ranks: n }) + "\n");
  fs.writeFileSync(path.join(dir, f.pyName), f.py);
  const cfg = { added_tokens_decoder: decoder, auto_map: { AutoTokenizer: [f.pyName.replace(".py", "") +
    ".TikTokenTokenizer", null] }, bos_token: f.bos, eos_token: f.eos, tokenizer_class: "TikTokenTokenizer" };
  fs.writeFileSync(path.join(dir, "tokenizer_config.json"), JSON.stringify(cfg, null, 2) + "\n");
  fs.writeFileSync(path.join(dir, "ids.jsonl"), corpus.map((t) => JSON.stringify({ ids: encode(t) })).join("\n") +
    "\n");
  fs.writeFileSync(path.join(dir, "extra.jsonl"), f.extra(n).map((t) => JSON.stringify({ text: t,
    ids: encode(t) })).join("\n") + "\n");
  tk.free();
  console.log(`${f.name}: ${n} ranks, ${corpus.length} corpus texts, ${f.extra(n).length} extra`);
}

const kimiPy = [
  "# The parts of a tiktoken tokenizer class that mlaserve reads (a test fixture written by",
  "# tools/tokenizer/make_tiktoken_goldens.cjs).",
  "class TikTokenTokenizer:",
  "    num_reserved_special_tokens = 256",
  "",
  '    pat_str = "|".join(',
  "        [",
  // Long parts as juxtaposed literals over two lines (Python concatenates them; so does mlaserve's reader).
  ...KIMI_PARTS.map((p) => p.length > 80 ? `            r"""${p.slice(0, 60)}"""\n            r"""${p.slice(60)}""",`
                                         : `            r"""${p}""",`),
  "        ]",
  "    )",
  "",
  "    def encode(self, text):",
  "        TIKTOKEN_MAX_ENCODE_CHARS = 400_000",
  "        MAX_NO_WHITESPACES_CHARS = 25_000",
  "",
  "    def apply_chat_template(self, conversation, tools=None):",
  "        tools = deep_sort_dict(tools)",
  "",
].join("\n");

const cl100k = JSON.parse(fs.readFileSync(path.join(npm, "encoders/cl100k_base.json"), "utf8"));
const cl100kPy = [
  "# A tiktoken tokenizer class file with cl100k_base's pattern (a test fixture written by",
  "# tools/tokenizer/make_tiktoken_goldens.cjs).",
  "class TikTokenTokenizer:",
  "    num_reserved_special_tokens = 4",
  `    pat_str = (r"${cl100k.pat_str.slice(0, 60)}"`,
  `               r"${cl100k.pat_str.slice(60)}")`,
  "",
].join("\n");

const letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ";
makeFixture({
  name: "kimi", ranks: "o200k_base", pattern: KIMI_PARTS.join("|"), numSpecial: 256, named: KIMI_NAMED,
  maxChars: 400000, maxRun: 25000, pyName: "tokenization_kimi.py", py: kimiPy, bos: "[BOS]", eos: "[EOS]",
  extra: (n) => [
    "x".repeat(25000), "x".repeat(25001), "y".repeat(60007) + " tail",
    " ".repeat(25003) + "z", "\n".repeat(30001), "ab " + "\t".repeat(26000) + "cd",
    "[BOS]hello<|im_end|><|im_user|>user<|im_middle|>Hi there!<|im_end|>",
    `a<|reserved_token_${n + 100}|>b<|reserved_token_${n + 5}|>`,
    "汉字和English混合MixedCase文本，HELLO'S World'D 你好",
    "ÉCOLE École é\u0301cole ǅungla ʰmodifier 𝒜𝒷𝒸 ١٢٣٤٥ 1234567 x²",
    letters.repeat(1200) + letters.toLowerCase().repeat(1200),
  ],
});
makeFixture({
  name: "cl100k", ranks: "cl100k_base", pattern: cl100k.pat_str, numSpecial: 4, named: { 0: "<|endoftext|>" },
  maxChars: 0, maxRun: 0, pyName: "tokenization_test.py", py: cl100kPy, bos: null, eos: "<|endoftext|>",
  extra: (n) => ["<|endoftext|>x<|endoftext|>", "x".repeat(30000), "Hello  world\n\n\tdone 12345"],
});
