#include "structured/token_constraint.h"

#include <algorithm>

#include "core/error.h"

namespace mlaserve::structured {

TokenVocab::TokenVocab(std::vector<std::string> bytes) : bytes_(std::move(bytes)) {
  // Sort the tokens by their bytes: a trie's depth-first order is then the order in which its nodes are first met.
  std::vector<int32_t> order;
  for (size_t id = 0; id < bytes_.size(); ++id)
    if (!bytes_[id].empty()) order.push_back(static_cast<int32_t>(id));
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return bytes_[static_cast<size_t>(a)] < bytes_[static_cast<size_t>(b)];
  });
  // Build node by node: path[d] is the node of the current token's first d bytes.
  struct Building {
    std::vector<std::pair<uint8_t, int32_t>> kids;
    std::vector<int32_t> ends;
  };
  std::vector<Building> nodes(1);
  std::vector<int32_t> path{0};
  std::string prev;
  for (int32_t id : order) {
    const std::string& t = bytes_[static_cast<size_t>(id)];
    size_t common = 0;
    while (common < prev.size() && common < t.size() && prev[common] == t[common]) ++common;
    path.resize(common + 1);
    for (size_t d = common; d < t.size(); ++d) {
      const auto child = static_cast<int32_t>(nodes.size());
      nodes[static_cast<size_t>(path.back())].kids.emplace_back(static_cast<uint8_t>(t[d]), child);
      nodes.emplace_back();
      path.push_back(child);
    }
    nodes[static_cast<size_t>(path.back())].ends.push_back(id);
    prev = t;
  }
  for (const Building& n : nodes) {
    trie_.kid_begin.push_back(static_cast<int32_t>(trie_.kid_node.size()));
    trie_.end_begin.push_back(static_cast<int32_t>(trie_.end_token.size()));
    for (const auto& [b, k] : n.kids) {
      trie_.kid_byte.push_back(b);
      trie_.kid_node.push_back(k);
    }
    trie_.end_token.insert(trie_.end_token.end(), n.ends.begin(), n.ends.end());
  }
  trie_.kid_begin.push_back(static_cast<int32_t>(trie_.kid_node.size()));
  trie_.end_begin.push_back(static_cast<int32_t>(trie_.end_token.size()));
}

RegexConstraint::RegexConstraint(std::shared_ptr<const TokenVocab> vocab, std::string_view pattern, size_t max_states)
    : RegexConstraint(std::move(vocab), compile_regex(pattern), max_states) {}

RegexConstraint::RegexConstraint(std::shared_ptr<const TokenVocab> vocab, Nfa nfa, size_t max_states)
    : vocab_(std::move(vocab)), dfa_(std::move(nfa), max_states) {
  MLA_CHECK(vocab_ != nullptr, "RegexConstraint: no vocabulary");
}

std::shared_ptr<const std::vector<uint32_t>> RegexConstraint::allowed(int32_t state) {
  std::lock_guard<std::mutex> lk(mu_);
  if (auto it = masks_.find(state); it != masks_.end()) return it->second;
  auto mask = std::make_shared<std::vector<uint32_t>>((static_cast<size_t>(vocab_->size()) + 31) / 32, 0u);
  if (state >= 0) {
    const TokenVocab::Trie& t = vocab_->trie();
    std::vector<std::pair<int32_t, int32_t>> stack{{0, state}};  // (trie node, DFA state after its bytes)
    while (!stack.empty()) {
      const auto [node, s] = stack.back();
      stack.pop_back();
      const auto n = static_cast<size_t>(node);
      for (int32_t e = t.end_begin[n]; e < t.end_begin[n + 1]; ++e) {
        const auto id = static_cast<size_t>(t.end_token[static_cast<size_t>(e)]);
        (*mask)[id / 32] |= 1u << (id % 32);
      }
      for (int32_t k = t.kid_begin[n + 1] - 1; k >= t.kid_begin[n]; --k) {  // pushed last first: popped in order
        const int32_t next = dfa_.step(s, t.kid_byte[static_cast<size_t>(k)]);
        if (next != Dfa::kDead) stack.emplace_back(t.kid_node[static_cast<size_t>(k)], next);
      }
    }
  }
  auto out = std::shared_ptr<const std::vector<uint32_t>>(std::move(mask));
  masks_.emplace(state, out);
  return out;
}

bool RegexConstraint::accepting(int32_t state) {
  std::lock_guard<std::mutex> lk(mu_);
  return dfa_.accepting(state);
}

int32_t RegexConstraint::next(int32_t state, int32_t token) {
  std::lock_guard<std::mutex> lk(mu_);
  if (state < 0 || token < 0 || token >= vocab_->size() || vocab_->bytes(token).empty()) return kDead;
  return dfa_.walk(state, vocab_->bytes(token));
}

}  // namespace mlaserve::structured
