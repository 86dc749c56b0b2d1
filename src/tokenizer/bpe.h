// BPE model of tokenizer.json ("model": {"type": "BPE"}): vocab, merges (as "a b" strings or ["a", "b"] pairs),
// unk_token / fuse_unk, byte_fallback, continuing_subword_prefix, end_of_word_suffix, ignore_merges.
// Words (pre-tokenized pieces) are merged lowest-rank-first, leftmost on ties, like Hugging Face's Word::merge_all;
// results are cached per word.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

namespace mlaserve::tok {

// Transparent string hash so maps keyed by std::string can be probed with string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using Vocab = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  BpeModel(const nlohmann::json& spec, const std::string& where);

  // tiktoken's byte-level BPE from its ranks: `bytes_by_id[id]` is the token's bytes ("" where no token has the
  // id; a rank is the id). Adjacent parts whose concatenation is a token merge lowest rank first, leftmost on ties,
  // and a word that is itself a token is that token, which is tiktoken's byte_pair_encode. Tokens are kept as GPT-2
  // byte characters, so words come from the ByteLevel pre-tokenizer and ids decode through the ByteLevel decoder.
  // Every single byte must be a token (`where` names the file in errors).
  static std::unique_ptr<BpeModel> from_byte_ranks(const std::vector<std::string>& bytes_by_id,
                                                   const std::string& where);

  // Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(int32_t id) const;
  size_t vocab_size() const { return vocab_.size(); }
  const Vocab& vocab() const { return vocab_; }

 private:
  BpeModel() = default;
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  void tokenize_uncached(std::string_view word, std::vector<int32_t>& out) const;
  void merge_word(std::vector<int32_t>& syms) const;

  Vocab vocab_;
  std::vector<std::string> id_to_token_;  // "" for ids no token has
  std::vector<bool> has_id_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<std::string> unk_token_;
  std::string prefix_, suffix_;
  bool fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
  int32_t byte_ids_[256];  // <0xXX> ids for byte fallback, -1 if absent

  // Word -> ids cache (bounded; cleared when full). Guarded for concurrent encoders.
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
  static constexpr size_t kCacheCapacity = 200000;
  static constexpr size_t kMaxCachedWordBytes = 256;
};

}  // namespace mlaserve::tok
