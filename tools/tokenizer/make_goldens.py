#!/usr/bin/env python3
"""Golden data for mlaserve's tokenizer tests, from Hugging Face `tokenizers` and transformers (run on the device
machine, which has them; nothing here is used by the product).

Writes to OUT:
  deepseek_v3.jsonl       per corpus text: ids (no special tokens); decoded / decoded_skip when they differ from text
  families.tar            tokenizer.json files of other families (trained here) + their goldens, one .jsonl each
  chat.jsonl              per chat case: rendered text (or error) and, for DeepSeek's template, the ids of the text
  hf_bench.json           single-thread encode speed of `tokenizers` on --bench (when given)

usage: make_goldens.py --corpus C --chat CASES --templates DIR --deepseek DIR --out OUT [--bench FILE]
"""
import argparse
import io
import json
import os
import sys
import tarfile
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def golden_line(tok, text, special_ids_differ=True):
    enc = tok.encode(text, add_special_tokens=False).ids
    row = {"ids": enc}
    with_special = tok.encode(text, add_special_tokens=True).ids
    if with_special != enc:
        row["ids_special"] = with_special
    dec = tok.decode(enc, skip_special_tokens=False)
    if dec != text:
        row["decoded"] = dec
    dec_skip = tok.decode(enc, skip_special_tokens=True)
    if dec_skip != dec:
        row["decoded_skip"] = dec_skip
    return row


# ---------------------------------------------------------------------------------------------- other families
def train_families(texts, train_texts):
    """Tokenizers of other families: each (name, json string). Built by training small BPE models and then
    swapping normalizers / pre-tokenizers / post-processors / decoders in the JSON."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    fams = []
    # A: byte-level BPE, NFKC + Lowercase, Digits + ByteLevel(prefix space), TemplateProcessing, added tokens.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=3000, special_tokens=["[CLS]", "[SEP]"], show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train_texts, tr)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.add_tokens([AddedToken("hello world", single_word=True, normalized=True),
                    AddedToken("<|x|>", rstrip=True, normalized=False),
                    AddedToken("ABC", lstrip=True, normalized=False),
                    AddedToken("ing", single_word=False, normalized=True)])
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True),
                            AddedToken("[MASK]", single_word=True, rstrip=True, special=True)])
    base = json.loads(tok.to_str())
    fams.append(("bytelevel_nfkc_lower", json.dumps(base, ensure_ascii=False)))

    def variant(name, normalizer="keep", pre="keep", post="keep", decoder="keep", model_edit=None):
        j = json.loads(json.dumps(base))
        if normalizer != "keep":
            j["normalizer"] = normalizer
        if pre != "keep":
            j["pre_tokenizer"] = pre
        if post != "keep":
            j["post_processor"] = post
        if decoder != "keep":
            j["decoder"] = decoder
        if model_edit:
            model_edit(j["model"])
        fams.append((name, json.dumps(j, ensure_ascii=False)))

    bl_plain = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}

    def split(pattern, behavior, invert=False, regex=True):
        return {"type": "Split", "pattern": {"Regex" if regex else "String": pattern}, "behavior": behavior,
                "invert": invert}

    def seq(*ps):
        return {"type": "Sequence", "pretokenizers": list(ps)}

    variant("gpt2_ignore_merges", normalizer=None,
            pre={"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            post={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            model_edit=lambda m: m.update(ignore_merges=True))
    variant("split_removed_ws", normalizer=None, pre=seq(split(r"\s+", "Removed"), bl_plain))
    variant("split_string_isolated", normalizer={"type": "NFC"},
            pre=seq(split(" ", "Isolated", regex=False), split("-", "Removed", regex=False), bl_plain))
    variant("split_merged_prev", normalizer=None, pre=seq(split(r"[\p{P}\s]", "MergedWithPrevious"), bl_plain))
    variant("split_merged_next", normalizer=None, pre=seq(split(r"\s", "MergedWithNext"), bl_plain))
    variant("split_contiguous", normalizer=None, pre=seq(split(r"\p{L}", "Contiguous"), bl_plain))
    variant("split_invert", normalizer=None,
            pre=seq(split(r"\p{L}+", "Removed", invert=True), split(r"\d", "MergedWithNext", invert=True), bl_plain))
    variant("split_empty_matches", normalizer=None, pre=seq(split(r"a*", "Isolated"), split(r"(?=\s)", "MergedWithNext"),
                                                            bl_plain))
    variant("replace_nfc_digits", normalizer={"type": "Sequence", "normalizers": [
        {"type": "NFC"}, {"type": "Replace", "pattern": {"String": "``"}, "content": "\""},
        {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}, {"type": "Lowercase"}]},
            pre=seq({"type": "Digits", "individual_digits": False},
                    {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}),
            post={"type": "Sequence", "processors": [
                {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
                base["post_processor"]]})

    # B: Llama-style: Metaspace-trained BPE with byte fallback tokens, unk, and the legacy normalizer pipeline.
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tr = trainers.BpeTrainer(vocab_size=2500, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=300,
                             show_progress=False)
    tok.train_from_iterator(train_texts, tr)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    meta = json.loads(tok.to_str())
    vocab = meta["model"]["vocab"]
    for b in range(256):  # byte-fallback tokens live in the model vocabulary, as in Llama
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    # Keep added-token ids consistent: they sit inside the vocab already (trainer specials).
    fams.append(("metaspace_bytefallback", json.dumps(meta, ensure_ascii=False)))
    j = json.loads(json.dumps(meta))
    j["model"]["byte_fallback"] = False
    j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": False}
    j["decoder"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": False}
    fams.append(("metaspace_unk_always", json.dumps(j, ensure_ascii=False)))
    j = json.loads(json.dumps(meta))
    j["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                           {"type": "Replace", "pattern": {"String": " "},
                                                            "content": "▁"}]}
    j["pre_tokenizer"] = None
    j["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    fams.append(("llama_legacy", json.dumps(j, ensure_ascii=False)))

    # C: word-suffix BPE with a continuing-subword prefix, BERT-like normalization, Whitespace pre-tokenizer.
    tok = Tokenizer(models.BPE(unk_token="[UNK]", continuing_subword_prefix="##", end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    tr = trainers.BpeTrainer(vocab_size=2000, special_tokens=["[UNK]", "[CLS]", "[SEP]"], limit_alphabet=200,
                             continuing_subword_prefix="##", end_of_word_suffix="</w>", show_progress=False)
    tok.train_from_iterator(train_texts, tr)
    fams.append(("suffix_prefix_whitespace", tok.to_str()))
    j = json.loads(tok.to_str())
    j["pre_tokenizer"] = {"type": "WhitespaceSplit"}
    j["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFKD"}, {"type": "Strip", "strip_left": True,
                                                                              "strip_right": True}]}
    fams.append(("whitespacesplit_nfkd_strip", json.dumps(j, ensure_ascii=False)))
    return fams


# ---------------------------------------------------------------------------------------------- chat templates
def make_renderer(deepseek_dir):
    """Returns render(template_source_or_None, messages, add_generation_prompt, vars) -> str, and a description.
    Prefers transformers' apply_chat_template on PreTrainedTokenizerFast (HF's own jinja environment)."""
    try:
        from transformers import PreTrainedTokenizerFast
        tok = PreTrainedTokenizerFast.from_pretrained(deepseek_dir)

        def render(src, messages, agp, vars):
            kw = dict(vars)
            if src is not None:
                kw["chat_template"] = src
            r = tok.apply_chat_template(messages, add_generation_prompt=agp, tokenize=False, **kw)
            if not isinstance(r, str):
                raise TypeError(f"apply_chat_template returned {type(r).__name__}")
            return r
        return render, "transformers.apply_chat_template"
    except Exception as e:  # noqa: BLE001
        log("transformers unavailable, using jinja2 with HF's settings:", repr(e))
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    cfg = json.load(open(os.path.join(deepseek_dir, "tokenizer_config.json"), encoding="utf-8"))

    def tokstr(v):
        return v["content"] if isinstance(v, dict) else v
    special = {k: tokstr(cfg[k]) for k in ("bos_token", "eos_token", "pad_token", "unk_token") if cfg.get(k)}

    def render(src, messages, agp, vars):
        t = env.from_string(src if src is not None else cfg["chat_template"])
        kw = dict(special)
        kw.update(vars)
        kw.setdefault("tools", None)
        kw.setdefault("documents", None)
        return t.render(messages=messages, add_generation_prompt=agp, **kw)
    return render, "jinja2 (HF settings)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--chat", required=True)
    ap.add_argument("--templates", required=True)
    ap.add_argument("--deepseek", required=True, help="folder with tokenizer.json + tokenizer_config.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bench")
    ap.add_argument("--family-random", type=int, default=500, help="random corpus texts per other family")
    ap.add_argument("--skip-goldens", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="benchmark repetitions (best reported)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import tokenizers
    from tokenizers import Tokenizer
    log("tokenizers", tokenizers.__version__)
    texts = [r["text"] for r in read_jsonl(args.corpus)]
    ds = Tokenizer.from_file(os.path.join(args.deepseek, "tokenizer.json"))

    if not args.skip_goldens:
        t0 = time.time()
        with open(os.path.join(args.out, "deepseek_v3.jsonl"), "w", encoding="utf-8") as f:
            for t in texts:
                f.write(json.dumps(golden_line(ds, t), ensure_ascii=False) + "\n")
        log(f"deepseek goldens: {len(texts)} texts, {time.time() - t0:.1f}s")

        n_hand = next(i for i, t in enumerate(texts) if i > 100 and t == "end with combining e\u0301") + 1
        subset = texts[: n_hand + args.family_random]
        train_texts = texts + (open(args.bench, encoding="utf-8").read(2_000_000).split("\n") if args.bench else [])
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            def add(name, data):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            for name, js in train_families(texts, train_texts):
                tok = Tokenizer.from_str(js)
                rows = [json.dumps(golden_line(tok, t), ensure_ascii=False) for t in subset]
                add(f"{name}.tokenizer.json", json.dumps(json.loads(tok.to_str()), ensure_ascii=False).encode())
                add(f"{name}.jsonl", ("\n".join(rows) + "\n").encode())
                log(f"family {name}: {len(subset)} texts")
        with open(os.path.join(args.out, "families.tar"), "wb") as f:
            f.write(buf.getvalue())

        render, how = make_renderer(args.deepseek)
        log("chat renderer:", how)
        with open(os.path.join(args.out, "chat.jsonl"), "w", encoding="utf-8") as f:
            for i, c in enumerate(read_jsonl(args.chat)):
                src = None
                if c["template"] != "deepseek_v3":
                    src = open(os.path.join(args.templates, c["template"]), encoding="utf-8").read()
                row = {"case": i}
                try:
                    row["text"] = render(src, c["messages"], c["add_generation_prompt"], c["vars"])
                    if src is None:
                        row["ids"] = ds.encode(row["text"], add_special_tokens=False).ids
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {e}"
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.write(json.dumps({"renderer": how}) + "\n")

    if args.bench:
        # One document per line, split on "\n" only (as `mlaserve tokenize --benchmark` does): no universal
        # newlines, so "\r" inside documents stays text. Best of --repeat runs, single thread.
        with open(args.bench, encoding="utf-8", newline="") as f:
            lines = f.read().split("\n")
        nbytes = sum(len(l.encode()) for l in lines)
        res = {"tokenizers": tokenizers.__version__, "bytes": nbytes, "lines": len(lines), "repeat": args.repeat}
        ds.encode("warm up " * 100)
        best = 1e30
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            ntok = 0
            for l in lines:
                ntok += len(ds.encode(l, add_special_tokens=False).ids)
            best = min(best, time.perf_counter() - t0)
        res.update(encode_loop_s=best, encode_loop_MBps=nbytes / best / 1e6, tokens=ntok)
        best = 1e30
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            encs = ds.encode_batch_fast(lines, add_special_tokens=False)
            best = min(best, time.perf_counter() - t0)
        res.update(encode_batch_fast_s=best, encode_batch_fast_MBps=nbytes / best / 1e6,
                   tokens_batch=sum(len(e.ids) for e in encs), id_sum=sum(sum(e.ids) for e in encs))
        log(json.dumps(res))
        with open(os.path.join(args.out, "hf_bench.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
