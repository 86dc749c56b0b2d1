// Constrained decoding over a vocabulary: each token's bytes in a trie (TokenVocab, shared by every constraint built
// on it) and RegexConstraint, the engine's TokenConstraint for a regex (structured/regex.h): a token is allowed in a
// DFA state when its bytes keep the DFA alive; the allowed set of a state is found by walking the trie once and kept.
// A RegexConstraint holds no request state (the engine keeps each request's), so requests with the same regex may
// share one, and its automaton and masks (thread-safe).
#pragma once

#include <memory>
#include <mutex>
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

  // The trie in flat arrays, nodes numbered in depth-first order (a walk reads them nearly in sequence): node n's
  // children are kid_byte / kid_node [kid_begin[n], kid_begin[n + 1]), the tokens ending at it
  // end_token[end_begin[n], end_begin[n + 1]). Node 0 is the root (the empty prefix).
  struct Trie {
    std::vector<int32_t> kid_begin, end_begin, kid_node, end_token;
    std::vector<uint8_t> kid_byte;
    size_t size() const { return kid_begin.empty() ? 0 : kid_begin.size() - 1; }
  };
  const Trie& trie() const { return trie_; }

 private:
  std::vector<std::string> bytes_;
  Trie trie_;
};

class RegexConstraint : public TokenConstraint {
 public:
  // Throws mlaserve::Error for a pattern compile_regex rejects; allowed() / next() throw it when the DFA would need
  // more than max_states states.
  RegexConstraint(std::shared_ptr<const TokenVocab> vocab, std::string_view pattern,
                  size_t max_states = Dfa::kMaxStates);
  // The same from the pattern's compile_regex already made.
  RegexConstraint(std::shared_ptr<const TokenVocab> vocab, Nfa nfa, size_t max_states = Dfa::kMaxStates);
  std::shared_ptr<const std::vector<uint32_t>> allowed(int32_t state) override;
  int32_t next(int32_t state, int32_t token) override;
  bool accepting(int32_t state) override;

 private:
  std::shared_ptr<const TokenVocab> vocab_;
  std::mutex mu_;  // requests of several engine threads may share one constraint (the server caches them)
  Dfa dfa_;
  std::unordered_map<int32_t, std::shared_ptr<const std::vector<uint32_t>>> masks_;
};

}  // namespace mlaserve::structured
