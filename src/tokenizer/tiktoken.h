// Checkpoints whose tokenizer is tiktoken's (Kimi-K2, Moonlight: DeepseekV3ForCausalLM with `tiktoken.model` and a
// remote-code `tokenization_*.py` instead of tokenizer.json). The Python class is read, not run: its `pat_str`
// (the pre-tokenization pattern), `num_reserved_special_tokens` and the range of special ids it builds, the cuts of
// its encode (TIKTOKEN_MAX_ENCODE_CHARS / MAX_NO_WHITESPACES_CHARS) and whether its apply_chat_template sorts the
// tools' keys (deep_sort_dict). Names of the special ids come from tokenizer_config.json's added_tokens_decoder,
// the others are `<|reserved_token_{id}|>`, as the class names them. Without a readable class file, Kimi's class
// is assumed (its pattern, 256 specials, the cuts, sorted tool keys), with a warning.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"

namespace mlaserve::tok {

struct TiktokenTokenizer {
  std::unique_ptr<Tokenizer> tokenizer;
  bool sort_tool_keys = false;  // apply_chat_template sorts the keys of `tools` at every depth first
  std::string pattern;          // the pattern in Rust syntax, as the class gives it
};

// tiktoken's load_tiktoken_bpe: lines "base64(token bytes) rank"; by_rank[rank] = bytes ("" for unused ranks).
// `count` gets the number of ranks (len(mergeable_ranks)). Errors name the file and line.
std::vector<std::string> read_tiktoken_ranks(const std::string& path, size_t* count = nullptr);

// What the class file `py_source` says (exposed for tests); `where` names it in errors.
struct TiktokenClassInfo {
  std::string pattern;                  // empty when the file has no pat_str
  int64_t num_special = 256;            // special ids from len(ranks) on
  size_t max_chars = 0, max_run = 0;    // encode's cuts; 0 when the file makes none
  bool sort_tool_keys = false;
};
TiktokenClassInfo read_tiktoken_class(const std::string& py_source, const std::string& where);

// Kimi's TikTokenTokenizer, as assumed when the class file cannot be read.
TiktokenClassInfo kimi_tiktoken_class();

// `dir` holds tiktoken.model; `config` is its tokenizer_config.json (an object, maybe empty) read from config_path.
TiktokenTokenizer load_tiktoken_dir(const std::string& dir, const nlohmann::ordered_json& config,
                                    const std::string& config_path);

}  // namespace mlaserve::tok
