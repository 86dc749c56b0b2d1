#include "structured/token_constraint.h"

#include <algorithm>

#include "core/error.h"

namespace mlaserve::structured {

TokenVocab::TokenVocab(std::vector<std::string> bytes) : bytes_(std::move(bytes)) {
  trie_.emplace_back();
  for (size_t id = 0; id < bytes_.size(); ++id) {
    int32_t node = 0;
    for (char c : bytes_[id]) {
      const auto b = static_cast<uint8_t>(c);
      auto& kids = trie_[static_cast<size_t>(node)].kids;
      auto it = std::find_if(kids.begin(), kids.end(), [b](const auto& k) { return k.first == b; });
      if (it != kids.end()) {
        node = it->second;
      } else {
        const auto child = static_cast<int32_t>(trie_.size());
        trie_[static_cast<size_t>(node)].kids.emplace_back(b, child);
        trie_.emplace_back();
        node = child;
      }
    }
    if (node != 0) trie_[static_cast<size_t>(node)].ends.push_back(static_cast<int32_t>(id));
  }
}

RegexConstraint::RegexConstraint(std::shared_ptr<const TokenVocab> vocab, std::string_view pattern)
    : vocab_(std::move(vocab)), dfa_(compile_regex(pattern)) {
  MLA_CHECK(vocab_ != nullptr, "RegexConstraint: no vocabulary");
}

std::shared_ptr<const std::vector<uint32_t>> RegexConstraint::allowed(int32_t state) {
  if (auto it = masks_.find(state); it != masks_.end()) return it->second;
  auto mask = std::make_shared<std::vector<uint32_t>>((static_cast<size_t>(vocab_->size()) + 31) / 32, 0u);
  if (state >= 0) {
    const auto& trie = vocab_->trie();
    std::vector<std::pair<int32_t, int32_t>> stack{{0, state}};  // (trie node, DFA state after its bytes)
    while (!stack.empty()) {
      const auto [node, s] = stack.back();
      stack.pop_back();
      const TokenVocab::Node& n = trie[static_cast<size_t>(node)];
      for (int32_t id : n.ends) (*mask)[static_cast<size_t>(id) / 32] |= 1u << (id % 32);
      for (const auto& [b, kid] : n.kids) {
        const int32_t t = dfa_.step(s, b);
        if (t != Dfa::kDead) stack.emplace_back(kid, t);
      }
    }
  }
  auto out = std::shared_ptr<const std::vector<uint32_t>>(std::move(mask));
  masks_.emplace(state, out);
  return out;
}

int32_t RegexConstraint::next(int32_t state, int32_t token) {
  if (state < 0 || token < 0 || token >= vocab_->size() || vocab_->bytes(token).empty()) return kDead;
  return dfa_.walk(state, vocab_->bytes(token));
}

}  // namespace mlaserve::structured
