// Constrained decoding over a vocabulary: each token's bytes in a trie (TokenVocab, shared by every constraint built
// on it) and RegexConstraint, the engine's TokenConstraint for a regex (structured/regex.h): a token is allowed in a
// DFA state when its bytes keep the DFA alive; the allowed set of a state is found by walking the trie once and kept.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/engine_api.h"
#include "structured/regex.h"

namespace mlaserve::structured {

class TokenVocab {
 public:
  // bytes[i]: token i's bytes as generated text; empty: never allowed (special tokens, unused ids).
  explicit TokenVocab(std::vector<std::string> bytes);
  int32_t size() const { return static_cast<int32_t>(bytes_.size()); }
  const std::string& bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }

  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> kids;  // by byte
    std::vector<int32_t> ends;                      // tokens whose bytes end here
  };
  const std::vector<Node>& trie() const { return trie_; }

 private:
  std::vector<std::string> bytes_;
  std::vector<Node> trie_;
};

class RegexConstraint : public TokenConstraint {
 public:
  // Throws mlaserve::Error for a pattern compile_regex rejects.
  RegexConstraint(std::shared_ptr<const TokenVocab> vocab, std::string_view pattern);
  std::shared_ptr<const std::vector<uint32_t>> allowed(int32_t state) override;
  int32_t next(int32_t state, int32_t token) override;
  bool accepting(int32_t state) override { return dfa_.accepting(state); }

 private:
  std::shared_ptr<const TokenVocab> vocab_;
  Dfa dfa_;
  std::unordered_map<int32_t, std::shared_ptr<const std::vector<uint32_t>>> masks_;
};

}  // namespace mlaserve::structured
