// A Hugging Face `tokenizer.json` tokenizer, read generically: added tokens (matched before pre-tokenization,
// with lstrip / rstrip / single_word / normalized), normalizer, pre-tokenizer, BPE model, post-processor
// (ByteLevel, TemplateProcessing, BertProcessing, RobertaProcessing, Sequence) and decoder. Encoding gives the
// same ids as `tokenizers.Tokenizer.from_file(path).encode(text).ids`; decoding the same text as `.decode(ids)`.
//
// Thread safety: encode/decode are const and may run concurrently (the BPE word cache is locked).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace mlaserve::tok {

class Normalizer;
class PreTokenizer;
class BpeModel;
class Decoder;

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

// Adds special tokens around a single sequence (add_special_tokens=true).
class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  virtual void process(std::vector<int32_t>& ids) const = 0;
};

// TemplateProcessing for one sequence: `prefix` ids, the sequence, `suffix` ids.
std::unique_ptr<PostProcessor> make_template_processor(std::vector<int32_t> prefix, std::vector<int32_t> suffix);

class Tokenizer {
 public:
  // `path` is a tokenizer.json file.
  static std::unique_ptr<Tokenizer> from_file(const std::string& path);
  // `where` names the source in error messages.
  static std::unique_ptr<Tokenizer> from_json(const nlohmann::json& j, const std::string& where);
  // A tiktoken vocabulary (`ranks[id]`: the bytes of the token of rank id, read_tiktoken_ranks) encoding as
  // tiktoken's Encoding does with allowed_special="all": `specials` (given ids) are matched anywhere in the text,
  // the rest is cut by `pattern` (Rust regex syntax; text it does not match is dropped) and each piece merged by
  // rank (BpeModel::from_byte_ranks). When `max_chars` > 0, text between specials is first cut as
  // make_long_run_split(max_chars, max_run) does (Kimi's encode). Decoding joins the tokens' bytes.
  static std::unique_ptr<Tokenizer> from_tiktoken(const std::vector<std::string>& ranks, const std::string& where,
                                                  const std::string& pattern, const std::vector<AddedToken>& specials,
                                                  size_t max_chars = 0, size_t max_run = 0);
  ~Tokenizer();

  // Throws mlaserve::Error for text that is not valid UTF-8.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
  // Unknown ids are skipped (as HF does). skip_special_tokens drops added tokens marked special.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;
  // The bytes a model-vocabulary token stands for in generated text (not necessarily UTF-8 on its own: a byte-level
  // token may hold part of a character); nullopt for added tokens and unknown ids.
  std::optional<std::string> token_bytes(int32_t id) const;
  // One more than the largest id of the model vocab and the added tokens.
  size_t vocab_size() const;
  const std::vector<AddedToken>& added_tokens() const { return added_; }

  // Replaces tokenizer.json's post-processor (transformers' LlamaTokenizerFast does this from add_bos_token).
  void set_post_processor(std::unique_ptr<PostProcessor> p);

 private:
  Tokenizer();
  // The pipeline of tokenizer.json `j` around `model`; stored_ids: added tokens keep the ids `j` gives them.
  static std::unique_ptr<Tokenizer> assemble(const nlohmann::json& j, const std::string& where,
                                             std::unique_ptr<BpeModel> model, bool stored_ids = false);
  struct Segment {
    std::string text;  // when id < 0
    int32_t id = -1;   // an added token
    bool at_origin = false;
  };
  class Matcher;
  void split_added(const Matcher& m, const std::string& text, bool at_origin, std::vector<Segment>& out) const;

  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<PostProcessor> post_processor_;
  std::unique_ptr<Decoder> decoder_;
  std::vector<AddedToken> added_;                     // in tokenizer.json order
  std::unordered_map<int32_t, size_t> added_by_id_;   // id -> index in added_
  std::unordered_map<std::string, int32_t> added_by_content_;
  std::unique_ptr<Matcher> raw_matcher_, normalized_matcher_;
  size_t vocab_size_ = 0;
};

}  // namespace mlaserve::tok
