#include "engine/radix_cache.h"

#include <algorithm>
#include <queue>
#include <set>
#include <unordered_map>

#include "core/error.h"

namespace mlaserve {

struct RadixCache::Node {
  Node* parent = nullptr;
  std::vector<int32_t> key;    // tokens of this edge: num_pages() * page_size
  std::vector<int32_t> pages;  // on the device: its pages; else empty and
  std::vector<int32_t> host;   // on the host tier: its slots
  // Children keyed by the tokens of their first page.
  std::map<std::vector<int32_t>, std::unique_ptr<Node>> children;
  int32_t lock_ref = 0;
  uint64_t last_access = 0;
  std::string salt;  // a salted tree's root: its salt
  bool on_device() const { return !pages.empty(); }
  size_t num_pages() const { return pages.empty() ? host.size() : pages.size(); }
  bool has_device_child() const {
    return std::any_of(children.begin(), children.end(), [](const auto& c) { return c.second->on_device(); });
  }
};

namespace {

struct OlderFirst {
  bool operator()(const RadixCache::Node* a, const RadixCache::Node* b) const {
    return a->last_access > b->last_access;
  }
};
using LruHeap = std::priority_queue<RadixCache::Node*, std::vector<RadixCache::Node*>, OlderFirst>;

// The nodes under `roots` (themselves included) that `pick` chooses, as a heap: least recently used on top.
template <typename Pick>
std::vector<RadixCache::Node*> lru_nodes(std::vector<RadixCache::Node*> roots, const Pick& pick) {
  std::vector<RadixCache::Node*> picked, stack = std::move(roots);
  while (!stack.empty()) {
    RadixCache::Node* n = stack.back();
    stack.pop_back();
    for (auto& [_, c] : n->children) stack.push_back(c.get());
    if (pick(n)) picked.push_back(n);
  }
  std::make_heap(picked.begin(), picked.end(), OlderFirst{});
  return picked;
}
template <typename Pick>
LruHeap lru_heap(std::vector<RadixCache::Node*> roots, const Pick& pick) {
  return LruHeap(OlderFirst{}, lru_nodes(std::move(roots), pick));
}

}  // namespace

RadixCache::RadixCache(int32_t page_size, PagePool& pool, bool enabled)
    : page_size_(page_size), pool_(pool), enabled_(enabled), root_(std::make_unique<Node>()) {
  MLA_CHECK(page_size > 0, "radix cache: page size must be positive");
}

RadixCache::~RadixCache() = default;

std::vector<RadixCache::Node*> RadixCache::roots() const {
  std::vector<Node*> out{root_.get()};
  for (const auto& [_, r] : salted_) out.push_back(r.get());
  return out;
}

void RadixCache::drop_if_empty_root(Node* node) {
  if (node->parent || node == root_.get() || !node->children.empty()) return;
  const std::string salt = node->salt;  // (erasing destroys the node)
  salted_.erase(salt);
}

void RadixCache::touch(Node* n) {
  ++clock_;
  for (; n; n = n->parent) n->last_access = clock_;
}

RadixCache::Match RadixCache::match_prefix(std::span<const int32_t> tokens, int32_t max_tokens,
                                            std::string_view salt) {
  Match m;
  if (!enabled_) return m;
  Node* node = root_.get();
  if (!salt.empty()) {
    const auto it = salted_.find(salt);
    if (it == salted_.end()) return m;  // nothing cached under this salt
    node = it->second.get();
  }
  const size_t P = static_cast<size_t>(page_size_);
  const size_t limit = std::min(tokens.size(), static_cast<size_t>(std::max(0, max_tokens))) / P * P;
  size_t pos = 0;
  std::vector<Node*> on_host;  // the matched edges past the device part, top down
  while (pos < limit) {
    std::vector<int32_t> first(tokens.begin() + pos, tokens.begin() + pos + P);
    auto it = node->children.find(first);
    if (it == node->children.end()) break;
    Node* child = it->second.get();
    size_t pages = 0;  // pages of this edge that match
    while (pages < child->num_pages() && pos + (pages + 1) * P <= limit &&
           std::equal(child->key.begin() + pages * P, child->key.begin() + (pages + 1) * P, tokens.begin() + pos + pages * P))
      ++pages;
    if (pages == 0) break;
    if (pages < child->num_pages()) child = split(child, pages);
    if (child->on_device() && on_host.empty()) {
      m.pages.insert(m.pages.end(), child->pages.begin(), child->pages.end());
      m.tokens = static_cast<int32_t>(pos + pages * P);
      m.node = child;
    } else {
      on_host.push_back(child);
    }
    pos += pages * P;
    node = child;
  }
  if (!on_host.empty() && load(on_host)) {
    for (Node* n : on_host) m.pages.insert(m.pages.end(), n->pages.begin(), n->pages.end());
    m.loaded_tokens = static_cast<int32_t>(pos) - m.tokens;
    m.tokens = static_cast<int32_t>(pos);
    m.node = on_host.back();
  }
  touch(m.node);
  return m;
}

std::vector<int32_t> RadixCache::device_prefix(std::span<const int32_t> tokens, std::string_view salt) const {
  std::vector<int32_t> pages;
  if (!enabled_) return pages;
  const Node* node = root_.get();
  if (!salt.empty()) {
    const auto it = salted_.find(salt);
    if (it == salted_.end()) return pages;
    node = it->second.get();
  }
  const size_t P = static_cast<size_t>(page_size_), limit = tokens.size() / P * P;
  for (size_t pos = 0; pos < limit;) {
    const auto it = node->children.find(std::vector<int32_t>(tokens.begin() + pos, tokens.begin() + pos + P));
    if (it == node->children.end() || !it->second->on_device()) break;
    const Node* child = it->second.get();
    size_t k = 1;  // (its first page matched: the key)
    while (k < child->num_pages() && pos + (k + 1) * P <= limit &&
           std::equal(child->key.begin() + k * P, child->key.begin() + (k + 1) * P, tokens.begin() + pos + k * P))
      ++k;
    pages.insert(pages.end(), child->pages.begin(), child->pages.begin() + static_cast<int64_t>(k));
    pos += k * P;
    if (k < child->num_pages()) break;
    node = child;
  }
  return pages;
}

bool RadixCache::load(const std::vector<Node*>& path) {
  int32_t need = 0;
  for (Node* n : path) need += static_cast<int32_t>(n->num_pages());
  // The path's lock keeps it (and the device part above it) from being evicted for its own pages.
  lock(path.back());
  if (pool_.num_free() < need) evict(need - pool_.num_free());
  auto got = pool_.num_free() >= need ? pool_.alloc(need) : std::nullopt;
  if (!got) {
    unlock(path.back());
    return false;
  }
  size_t at = 0;
  for (Node* n : path) {
    MLA_CHECK(!n->on_device(), "radix cache: loading an edge that is on the device");
    const size_t np = n->host.size();
    n->pages.assign(got->begin() + static_cast<int64_t>(at), got->begin() + static_cast<int64_t>(at + np));
    for (size_t i = 0; i < np; ++i) {
      pending_.loads.push_back(n->host[i]);
      pending_.loads.push_back(n->pages[i]);
    }
    slots_after_step_.insert(slots_after_step_.end(), n->host.begin(), n->host.end());
    n->host.clear();
    cached_pages_ += static_cast<int32_t>(np);  // locked: not evictable yet
    at += np;
  }
  pins_.push_back(path.back());  // the step that loads them unpins them
  return true;
}

void RadixCache::enable_host_tier(int32_t host_slots) {
  MLA_CHECK(cached_pages_ == 0 && root_->children.empty() && salted_.empty(),
            "radix cache: the host tier is enabled before caching");
  if (!enabled_ || host_slots <= 0) return;
  host_pool_ = std::make_unique<PagePool>(host_slots);
}

int32_t RadixCache::host_slots() const { return host_pool_ ? host_pool_->num_pages() : 0; }

int32_t RadixCache::host_cached_slots() const {
  return host_pool_ ? host_pool_->num_pages() - host_pool_->num_free() : 0;
}

RadixCache::Copies RadixCache::take_copies() {
  Copies out = std::move(pending_);
  pending_ = Copies{};
  for (Node* n : pins_) unlock(n);
  pins_.clear();
  if (host_pool_ && !slots_after_step_.empty()) host_pool_->free(slots_after_step_);
  slots_after_step_.clear();
  return out;
}

bool RadixCache::host_droppable(const Node* x) const {
  return x->parent && !x->on_device() && x->children.empty() && x->lock_ref == 0;
}

bool RadixCache::free_host_slots(int32_t n) {
  if (!host_pool_) return false;
  if (host_pool_->num_free() >= n) return true;
  // Every edge on the host can be dropped (none is locked, and all below one are on the host too); the slots the
  // pending loads read cannot. Too few: keep what is there.
  if (n > host_pool_->num_pages() - static_cast<int32_t>(slots_after_step_.size())) return false;
  if (!host_drops_found_) {
    host_drops_ = lru_nodes(roots(), [&](const Node* x) { return host_droppable(x); });
    host_drops_found_ = true;
  }
  while (host_pool_->num_free() < n && !host_drops_.empty()) {
    std::pop_heap(host_drops_.begin(), host_drops_.end(), OlderFirst{});
    Node* x = host_drops_.back();
    host_drops_.pop_back();
    Node* parent = x->parent;
    host_pool_->free(x->host);
    std::vector<int32_t> first(x->key.begin(), x->key.begin() + page_size_);
    parent->children.erase(first);  // destroys x
    if (host_droppable(parent)) {
      host_drops_.push_back(parent);
      std::push_heap(host_drops_.begin(), host_drops_.end(), OlderFirst{});
    }
    drop_if_empty_root(parent);
  }
  return host_pool_->num_free() >= n;
}

// Splits `node`'s edge after `pages_kept` pages; returns the new upper node (which keeps the node's parent link).
RadixCache::Node* RadixCache::split(Node* node, size_t pages_kept) {
  const size_t P = static_cast<size_t>(page_size_);
  Node* parent = node->parent;
  std::vector<int32_t> first(node->key.begin(), node->key.begin() + P);
  auto upper = std::make_unique<Node>();
  upper->parent = parent;
  upper->key.assign(node->key.begin(), node->key.begin() + pages_kept * P);
  std::vector<int32_t>& held = node->on_device() ? node->pages : node->host;
  (node->on_device() ? upper->pages : upper->host).assign(held.begin(), held.begin() + pages_kept);
  upper->lock_ref = node->lock_ref;
  upper->last_access = node->last_access;
  std::unique_ptr<Node> lower = std::move(parent->children[first]);
  lower->key.erase(lower->key.begin(), lower->key.begin() + pages_kept * P);
  held.erase(held.begin(), held.begin() + pages_kept);
  lower->parent = upper.get();
  std::vector<int32_t> lower_first(lower->key.begin(), lower->key.begin() + P);
  Node* up = upper.get();
  up->children[lower_first] = std::move(lower);
  parent->children[first] = std::move(upper);
  return up;
}

void RadixCache::lock(Node* node) {
  for (Node* n = node; n && n->parent; n = n->parent) {
    if (n->lock_ref == 0) evictable_pages_ -= static_cast<int32_t>(n->pages.size());
    ++n->lock_ref;
  }
}

void RadixCache::unlock(Node* node) {
  for (Node* n = node; n && n->parent; n = n->parent) {
    MLA_CHECK(n->lock_ref > 0, "radix cache: unlock of an unlocked node");
    --n->lock_ref;
    if (n->lock_ref == 0) evictable_pages_ += static_cast<int32_t>(n->pages.size());
  }
}

RadixCache::Node* RadixCache::insert(std::span<const int32_t> tokens, std::span<const int32_t> pages,
                                     std::string_view salt) {
  std::vector<int32_t> copy(pages.begin(), pages.end());
  return insert_shared(tokens, copy, salt);
}

RadixCache::Node* RadixCache::insert_shared(std::span<const int32_t> tokens, std::span<int32_t> pages,
                                            std::string_view salt) {
  const size_t P = static_cast<size_t>(page_size_);
  MLA_CHECK(tokens.size() >= pages.size() * P, "radix cache: {} pages but only {} tokens", pages.size(), tokens.size());
  if (!enabled_) {
    pool_.free(std::vector<int32_t>(pages.begin(), pages.end()));
    return nullptr;
  }
  if (pages.empty()) return nullptr;
  Node* node = root_.get();
  if (!salt.empty()) {
    auto it = salted_.find(salt);
    if (it == salted_.end()) {
      it = salted_.emplace(std::string(salt), std::make_unique<Node>()).first;
      it->second->salt = it->first;
    }
    node = it->second.get();
  }
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
    while (k < child->num_pages() && pg + k < pages.size() &&
           std::equal(child->key.begin() + k * P, child->key.begin() + (k + 1) * P, tokens.begin() + (pg + k) * P))
      ++k;
    if (k < child->num_pages()) child = split(child, k);
    if (!child->on_device()) {  // on the host tier: the request's pages (computed anew) take its place
      child->pages.assign(pages.begin() + static_cast<int64_t>(pg), pages.begin() + static_cast<int64_t>(pg + k));
      slots_after_step_.insert(slots_after_step_.end(), child->host.begin(), child->host.end());
      child->host.clear();
      cached_pages_ += static_cast<int32_t>(k);
      if (child->lock_ref == 0) evictable_pages_ += static_cast<int32_t>(k);
    }
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
    for (; n && n->parent; n = n->parent) ++paths[n];
  int32_t pages = 0;
  for (const auto& [n, k] : paths)
    if (n->lock_ref == k) pages += static_cast<int32_t>(n->pages.size());
  return pages;
}

int32_t RadixCache::evict(int32_t num_pages) {
  if (!enabled_ || num_pages <= 0) return 0;
  // Leaves of the device part: unlocked, no child on the device (children on the host tier stay below them).
  const auto evictable = [&](const Node* x) {
    return x->parent && x->on_device() && x->lock_ref == 0 && !x->has_device_child();
  };
  LruHeap heap = lru_heap(roots(), evictable);
  int32_t freed = 0;
  host_drops_found_ = false;
  while (freed < num_pages && !heap.empty()) {
    Node* n = heap.top();
    heap.pop();
    Node* parent = n->parent;
    const int32_t np = static_cast<int32_t>(n->pages.size());
    if (free_host_slots(np)) {  // to the host tier: saved, its pages free
      n->host = *host_pool_->alloc(np);
      for (int32_t i = 0; i < np; ++i) {
        pending_.saves.push_back(n->pages[static_cast<size_t>(i)]);
        pending_.saves.push_back(n->host[static_cast<size_t>(i)]);
      }
      pool_.free(n->pages);
      n->pages.clear();
      if (host_drops_found_ && host_droppable(n)) {  // (a leaf now on the host: droppable by later evictions)
        host_drops_.push_back(n);
        std::push_heap(host_drops_.begin(), host_drops_.end(), OlderFirst{});
      }
    } else {  // dropped, with what it leads to on the host tier (host_drops_ may name some of it: found again)
      free_subtree(n);
      std::vector<int32_t> first(n->key.begin(), n->key.begin() + page_size_);
      parent->children.erase(first);  // destroys n
      host_drops_found_ = false;
    }
    freed += np;
    evictable_pages_ -= np;
    cached_pages_ -= np;
    if (evictable(parent)) heap.push(parent);
    drop_if_empty_root(parent);
  }
  host_drops_.clear();
  host_drops_found_ = false;
  return freed;
}

void RadixCache::free_subtree(Node* node) {
  for (auto& [_, c] : node->children) free_subtree(c.get());
  if (!node->parent) return;
  if (node->on_device()) pool_.free(node->pages);
  else if (host_pool_) host_pool_->free(node->host);
}

bool RadixCache::reset() {
  if (evictable_pages_ != cached_pages_) return false;  // something is locked
  for (Node* r : roots()) free_subtree(r);
  root_ = std::make_unique<Node>();
  salted_.clear();
  evictable_pages_ = cached_pages_ = 0;
  pending_.saves.clear();  // (what they would write belongs to nothing now)
  return true;
}

void RadixCache::check_integrity() const {
  const size_t P = static_cast<size_t>(page_size_);
  std::set<int32_t> seen, seen_host;
  int32_t evictable = 0, total = 0;
  std::vector<const Node*> stack;
  for (const Node* r : roots()) {
    MLA_CHECK(r == root_.get() || (!r->children.empty() && salted_.count(r->salt)),
              "radix cache: the root of salt '{}' holds nothing", r->salt);
    stack.push_back(r);
  }
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    int32_t child_locks = 0;
    for (const auto& [first, c] : n->children) {
      MLA_CHECK(c->parent == n, "radix cache: broken parent link");
      MLA_CHECK(c->num_pages() > 0 && c->key.size() == c->num_pages() * P,
                "radix cache: edge of {} tokens holds {} pages", c->key.size(), c->num_pages());
      MLA_CHECK(c->pages.empty() || c->host.empty(), "radix cache: an edge both on the device and on the host");
      MLA_CHECK(!c->on_device() || !n->parent || n->on_device(),
                "radix cache: an edge on the device below one on the host");
      MLA_CHECK(std::equal(first.begin(), first.end(), c->key.begin()), "radix cache: child key mismatch");
      child_locks = std::max(child_locks, c->lock_ref);
      stack.push_back(c.get());
    }
    if (!n->parent) continue;
    MLA_CHECK(n->lock_ref >= child_locks, "radix cache: a node is locked less than its child");
    for (int32_t p : n->pages) {
      MLA_CHECK(seen.insert(p).second, "radix cache: page {} cached twice", p);
      MLA_CHECK(p >= 0 && p < pool_.num_pages(), "radix cache: page {} out of range", p);
    }
    for (int32_t h : n->host) {
      MLA_CHECK(host_pool_ && h >= 0 && h < host_pool_->num_pages(), "radix cache: host slot {} out of range", h);
      MLA_CHECK(seen_host.insert(h).second, "radix cache: host slot {} cached twice", h);
    }
    total += static_cast<int32_t>(n->pages.size());
    if (n->lock_ref == 0) evictable += static_cast<int32_t>(n->pages.size());
  }
  MLA_CHECK(total == cached_pages_, "radix cache: {} pages cached, counter says {}", total, cached_pages_);
  MLA_CHECK(evictable == evictable_pages_, "radix cache: {} pages evictable, counter says {}", evictable, evictable_pages_);
  if (host_pool_) {
    host_pool_->check_integrity();
    for (int32_t h : slots_after_step_)
      MLA_CHECK(seen_host.insert(h).second, "radix cache: host slot {} held by an edge and by a load", h);
    MLA_CHECK(static_cast<int32_t>(seen_host.size()) + host_pool_->num_free() == host_pool_->num_pages(),
              "radix cache: {} host slots held + {} free != {}", seen_host.size(), host_pool_->num_free(),
              host_pool_->num_pages());
  }
}

}  // namespace mlaserve
