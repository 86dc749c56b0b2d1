#include "engine/radix_cache.h"

#include <algorithm>
#include <queue>
#include <set>
#include <unordered_map>

#include "core/error.h"

namespace mlaserve {

struct RadixCache::Node {
  Node* parent = nullptr;
  std::vector<int32_t> key;    // tokens of this edge: pages.size() * page_size
  std::vector<int32_t> pages;
  // Children keyed by the tokens of their first page.
  std::map<std::vector<int32_t>, std::unique_ptr<Node>> children;
  int32_t lock_ref = 0;
  uint64_t last_access = 0;
};

RadixCache::RadixCache(int32_t page_size, PagePool& pool, bool enabled)
    : page_size_(page_size), pool_(pool), enabled_(enabled), root_(std::make_unique<Node>()) {
  MLA_CHECK(page_size > 0, "radix cache: page size must be positive");
}

RadixCache::~RadixCache() = default;

void RadixCache::touch(Node* n) {
  ++clock_;
  for (; n; n = n->parent) n->last_access = clock_;
}

RadixCache::Match RadixCache::match_prefix(std::span<const int32_t> tokens, int32_t max_tokens) {
  Match m;
  m.node = root_.get();
  if (!enabled_) return m;
  const size_t P = static_cast<size_t>(page_size_);
  const size_t limit = std::min(tokens.size(), static_cast<size_t>(std::max(0, max_tokens))) / P * P;
  Node* node = root_.get();
  size_t pos = 0;
  while (pos < limit) {
    std::vector<int32_t> first(tokens.begin() + pos, tokens.begin() + pos + P);
    auto it = node->children.find(first);
    if (it == node->children.end()) break;
    Node* child = it->second.get();
    size_t pages = 0;  // pages of this edge that match
    while (pages < child->pages.size() && pos + (pages + 1) * P <= limit &&
           std::equal(child->key.begin() + pages * P, child->key.begin() + (pages + 1) * P, tokens.begin() + pos + pages * P))
      ++pages;
    if (pages == 0) break;
    if (pages < child->pages.size()) child = split(child, pages);
    m.pages.insert(m.pages.end(), child->pages.begin(), child->pages.end());
    pos += pages * P;
    node = child;
  }
  m.tokens = static_cast<int32_t>(pos);
  m.node = node;
  touch(node);
  return m;
}

// Splits `node`'s edge after `pages_kept` pages; returns the new upper node (which keeps the node's parent link).
RadixCache::Node* RadixCache::split(Node* node, size_t pages_kept) {
  const size_t P = static_cast<size_t>(page_size_);
  Node* parent = node->parent;
  std::vector<int32_t> first(node->key.begin(), node->key.begin() + P);
  auto upper = std::make_unique<Node>();
  upper->parent = parent;
  upper->key.assign(node->key.begin(), node->key.begin() + pages_kept * P);
  upper->pages.assign(node->pages.begin(), node->pages.begin() + pages_kept);
  upper->lock_ref = node->lock_ref;
  upper->last_access = node->last_access;
  std::unique_ptr<Node> lower = std::move(parent->children[first]);
  lower->key.erase(lower->key.begin(), lower->key.begin() + pages_kept * P);
  lower->pages.erase(lower->pages.begin(), lower->pages.begin() + pages_kept);
  lower->parent = upper.get();
  std::vector<int32_t> lower_first(lower->key.begin(), lower->key.begin() + P);
  Node* up = upper.get();
  up->children[lower_first] = std::move(lower);
  parent->children[first] = std::move(upper);
  return up;
}

void RadixCache::lock(Node* node) {
  for (Node* n = node; n && n != root_.get(); n = n->parent) {
    if (n->lock_ref == 0) evictable_pages_ -= static_cast<int32_t>(n->pages.size());
    ++n->lock_ref;
  }
}

void RadixCache::unlock(Node* node) {
  for (Node* n = node; n && n != root_.get(); n = n->parent) {
    MLA_CHECK(n->lock_ref > 0, "radix cache: unlock of an unlocked node");
    --n->lock_ref;
    if (n->lock_ref == 0) evictable_pages_ += static_cast<int32_t>(n->pages.size());
  }
}

RadixCache::Node* RadixCache::insert(std::span<const int32_t> tokens, std::span<const int32_t> pages) {
  std::vector<int32_t> copy(pages.begin(), pages.end());
  return insert_shared(tokens, copy);
}

RadixCache::Node* RadixCache::insert_shared(std::span<const int32_t> tokens, std::span<int32_t> pages) {
  const size_t P = static_cast<size_t>(page_size_);
  MLA_CHECK(tokens.size() >= pages.size() * P, "radix cache: {} pages but only {} tokens", pages.size(), tokens.size());
  if (!enabled_) {
    pool_.free(std::vector<int32_t>(pages.begin(), pages.end()));
    return nullptr;
  }
  Node* node = root_.get();
  size_t pg = 0;  // pages consumed
  std::vector<int32_t> dup;
  while (pg < pages.size()) {
    std::vector<int32_t> first(tokens.begin() + pg * P, tokens.begin() + (pg + 1) * P);
    auto it = node->children.find(first);
    if (it == node->children.end()) {
      auto child = std::make_unique<Node>();
      child->parent = node;
      child->key.assign(tokens.begin() + pg * P, tokens.begin() + pages.size() * P);
      child->pages.assign(pages.begin() + pg, pages.end());
      evictable_pages_ += static_cast<int32_t>(child->pages.size());
      cached_pages_ += static_cast<int32_t>(child->pages.size());
      Node* c = child.get();
      node->children[first] = std::move(child);
      node = c;
      pg = pages.size();
      break;
    }
    Node* child = it->second.get();
    size_t k = 0;
    while (k < child->pages.size() && pg + k < pages.size() &&
           std::equal(child->key.begin() + k * P, child->key.begin() + (k + 1) * P, tokens.begin() + (pg + k) * P))
      ++k;
    if (k < child->pages.size()) child = split(child, k);
    for (size_t i = 0; i < k; ++i)
      if (child->pages[i] != pages[pg + i]) {
        dup.push_back(pages[pg + i]);
        pages[pg + i] = child->pages[i];
      }
    pg += k;
    node = child;
  }
  if (!dup.empty()) pool_.free(dup);
  touch(node);
  return node;
}

int32_t RadixCache::pages_unlocked_by(std::span<Node* const> nodes) const {
  std::unordered_map<const Node*, int32_t> paths;  // node -> how many of the paths run through it
  for (const Node* n : nodes)
    for (; n && n != root_.get(); n = n->parent) ++paths[n];
  int32_t pages = 0;
  for (const auto& [n, k] : paths)
    if (n->lock_ref == k) pages += static_cast<int32_t>(n->pages.size());
  return pages;
}

int32_t RadixCache::evict(int32_t num_pages) {
  if (!enabled_ || num_pages <= 0) return 0;
  // Min-heap of unlocked leaves by last access.
  auto cmp = [](Node* a, Node* b) { return a->last_access > b->last_access; };
  std::priority_queue<Node*, std::vector<Node*>, decltype(cmp)> heap(cmp);
  std::vector<Node*> stack{root_.get()};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (auto& [_, c] : n->children) stack.push_back(c.get());
    if (n != root_.get() && n->children.empty() && n->lock_ref == 0) heap.push(n);
  }
  int32_t freed = 0;
  while (freed < num_pages && !heap.empty()) {
    Node* n = heap.top();
    heap.pop();
    Node* parent = n->parent;
    const int32_t np = static_cast<int32_t>(n->pages.size());
    pool_.free(n->pages);
    freed += np;
    evictable_pages_ -= np;
    cached_pages_ -= np;
    std::vector<int32_t> first(n->key.begin(), n->key.begin() + page_size_);
    parent->children.erase(first);  // destroys n
    if (parent != root_.get() && parent->children.empty() && parent->lock_ref == 0) heap.push(parent);
  }
  return freed;
}

void RadixCache::free_subtree(Node* node) {
  for (auto& [_, c] : node->children) free_subtree(c.get());
  if (node != root_.get()) pool_.free(node->pages);
}

bool RadixCache::reset() {
  if (evictable_pages_ != cached_pages_) return false;  // something is locked
  free_subtree(root_.get());
  root_ = std::make_unique<Node>();
  evictable_pages_ = cached_pages_ = 0;
  return true;
}

void RadixCache::check_integrity() const {
  const size_t P = static_cast<size_t>(page_size_);
  std::set<int32_t> seen;
  int32_t evictable = 0, total = 0;
  std::vector<const Node*> stack{root_.get()};
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    int32_t child_locks = 0;
    for (const auto& [first, c] : n->children) {
      MLA_CHECK(c->parent == n, "radix cache: broken parent link");
      MLA_CHECK(!c->pages.empty() && c->key.size() == c->pages.size() * P, "radix cache: edge of {} tokens holds {} pages",
                c->key.size(), c->pages.size());
      MLA_CHECK(std::equal(first.begin(), first.end(), c->key.begin()), "radix cache: child key mismatch");
      child_locks = std::max(child_locks, c->lock_ref);
      stack.push_back(c.get());
    }
    if (n == root_.get()) continue;
    MLA_CHECK(n->lock_ref >= child_locks, "radix cache: a node is locked less than its child");
    for (int32_t p : n->pages) {
      MLA_CHECK(seen.insert(p).second, "radix cache: page {} cached twice", p);
      MLA_CHECK(p >= 0 && p < pool_.num_pages(), "radix cache: page {} out of range", p);
    }
    total += static_cast<int32_t>(n->pages.size());
    if (n->lock_ref == 0) evictable += static_cast<int32_t>(n->pages.size());
  }
  MLA_CHECK(total == cached_pages_, "radix cache: {} pages cached, counter says {}", total, cached_pages_);
  MLA_CHECK(evictable == evictable_pages_, "radix cache: {} pages evictable, counter says {}", evictable, evictable_pages_);
}

}  // namespace mlaserve
