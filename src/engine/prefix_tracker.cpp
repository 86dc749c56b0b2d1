#include "engine/prefix_tracker.h"

#include <algorithm>
#include <utility>

namespace mlaserve {

namespace {
size_t common(const std::vector<int32_t>& key, std::span<const int32_t> rest) {
  const size_t n = std::min(key.size(), rest.size());
  size_t c = 0;
  while (c < n && key[c] == rest[c]) ++c;
  return c;
}
}  // namespace

PrefixTracker::~PrefixTracker() = default;

int32_t PrefixTracker::match(std::string_view salt, std::span<const int32_t> tokens) const {
  const auto r = roots_.find(std::string(salt));
  if (r == roots_.end()) return 0;
  const Node* node = r->second.get();
  size_t i = 0;
  while (i < tokens.size()) {
    const auto k = node->kids.find(tokens[i]);
    if (k == node->kids.end()) break;
    const size_t c = common(k->second->key, tokens.subspan(i));
    i += c;
    if (c < k->second->key.size()) break;
    node = k->second.get();
  }
  return static_cast<int32_t>(i);
}

void PrefixTracker::insert(std::string_view salt, std::span<const int32_t> tokens) {
  if (capacity_ <= 0 || tokens.empty()) return;
  const uint64_t now = ++clock_;
  auto& root = roots_[std::string(salt)];
  if (!root) root = std::make_unique<Node>();
  Node* node = root.get();
  node->used = now;
  size_t i = 0;
  while (i < tokens.size()) {
    const auto rest = tokens.subspan(i);
    auto k = node->kids.find(rest[0]);
    if (k == node->kids.end() && node->parent && node->kids.empty()) {  // a leaf extended: its edge grows
      node->key.insert(node->key.end(), rest.begin(), rest.end());
      size_ += static_cast<int64_t>(rest.size());
      break;
    }
    if (k == node->kids.end()) {
      auto leaf = std::make_unique<Node>();
      leaf->key.assign(rest.begin(), rest.end());
      leaf->parent = node;
      leaf->used = now;
      size_ += static_cast<int64_t>(rest.size());
      node->kids.emplace(rest[0], std::move(leaf));
      break;
    }
    Node* kid = k->second.get();
    const size_t c = common(kid->key, rest);
    if (c < kid->key.size()) {  // split the edge where the sequences part
      auto mid = std::make_unique<Node>();
      mid->key.assign(kid->key.begin(), kid->key.begin() + static_cast<std::ptrdiff_t>(c));
      mid->parent = node;
      kid->key.erase(kid->key.begin(), kid->key.begin() + static_cast<std::ptrdiff_t>(c));
      kid->parent = mid.get();
      mid->kids.emplace(kid->key[0], std::move(k->second));
      k->second = std::move(mid);
      kid = k->second.get();
    }
    kid->used = now;
    node = kid;
    i += c;
  }
  if (size_ > capacity_) evict();
}

void PrefixTracker::evict() {
  // Down to 90% of the capacity, so that the walk over the leaves is paid once per tenth of it.
  const int64_t target = capacity_ - capacity_ / 10;
  while (size_ > target) {
    std::vector<Node*> leaves;
    std::vector<Node*> stack;
    for (auto& [salt, root] : roots_) stack.push_back(root.get());
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      if (n->kids.empty() && n->parent) leaves.push_back(n);
      for (auto& [t, kid] : n->kids) stack.push_back(kid.get());
    }
    if (leaves.empty()) break;
    std::sort(leaves.begin(), leaves.end(), [](const Node* a, const Node* b) { return a->used < b->used; });
    for (Node* leaf : leaves) {  // (a parent left without children waits for the next pass)
      if (size_ <= target) break;
      size_ -= static_cast<int64_t>(leaf->key.size());
      leaf->parent->kids.erase(leaf->key[0]);
    }
  }
  std::erase_if(roots_, [](const auto& r) { return r.second->kids.empty(); });
}

void PrefixTracker::clear() {
  roots_.clear();
  size_ = 0;
}

}  // namespace mlaserve
