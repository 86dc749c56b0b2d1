// RadixCache: the prefix cache over the paged latent KV cache. A radix tree keyed by token ids in units of whole
// pages (page_size tokens); each edge holds the pages that cache its tokens. Requests lock the path they use
// (reference counts up to the root); unlocked leaves are evicted least-recently-used when pages are needed.
//
// Invariants (check_integrity): every edge's key length = pages * page_size; a node's lock_ref >= the sum of
// its children's... (locks propagate to the root); pages in the tree are never on the pool's free list and
// appear once; evictable_pages = pages of nodes with lock_ref == 0.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "engine/page_pool.h"

namespace mlaserve {

class RadixCache {
 public:
  struct Node;

  struct Match {
    std::vector<int32_t> pages;  // pages caching tokens [0, tokens)
    int32_t tokens = 0;
    Node* node = nullptr;        // deepest node of the match (lock it while the pages are in use)
  };

  // enabled = false: a cache that never matches and never keeps anything (--disable-radix-cache).
  RadixCache(int32_t page_size, PagePool& pool, bool enabled);
  ~RadixCache();

  bool enabled() const { return enabled_; }
  // Longest cached prefix of `tokens` in whole pages, at most `max_tokens` long. Touches the path (LRU).
  Match match_prefix(std::span<const int32_t> tokens, int32_t max_tokens);
  void lock(Node* node);    // null: no-op
  void unlock(Node* node);  // null: no-op
  // Caches tokens[0, pages.size() * page_size) held in `pages`. Pages of positions the tree already caches with
  // a different page are duplicates and go back to the pool. Returns the node ending the inserted path. When the
  // cache is disabled, every page goes back to the pool and null is returned.
  Node* insert(std::span<const int32_t> tokens, std::span<const int32_t> pages);
  // The same for pages a request goes on using: afterwards `pages` holds the tree's page at every position (each
  // duplicate replaced by the page the tree already had). The returned node ends exactly at the last page.
  Node* insert_shared(std::span<const int32_t> tokens, std::span<int32_t> pages);
  // Frees up to `num_pages` pages from unlocked leaves, least recently used first. Returns pages freed.
  int32_t evict(int32_t num_pages);
  int32_t evictable_pages() const { return evictable_pages_; }
  // Pages that would become evictable if every node in `nodes` (each a request's locked path; null: none) were
  // unlocked once: those of the nodes on these paths that no other lock holds.
  int32_t pages_unlocked_by(std::span<Node* const> nodes) const;
  int32_t cached_pages() const { return cached_pages_; }
  // Drops everything; requires that nothing is locked (returns false otherwise).
  bool reset();
  void check_integrity() const;

 private:
  Node* split(Node* node, size_t pages_kept);
  void free_subtree(Node* node);
  void touch(Node* node);

  int32_t page_size_;
  PagePool& pool_;
  bool enabled_;
  std::unique_ptr<Node> root_;
  uint64_t clock_ = 0;
  int32_t evictable_pages_ = 0;
  int32_t cached_pages_ = 0;
};

}  // namespace mlaserve
