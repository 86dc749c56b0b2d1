# A tiktoken tokenizer class file with cl100k_base's pattern (a test fixture written by
# tools/tokenizer/make_tiktoken_goldens.cjs).
class TikTokenTokenizer:
    num_reserved_special_tokens = 4
    pat_str = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{"
               r"1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
