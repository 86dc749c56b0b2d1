// RadixCache: the prefix cache over the paged latent KV cache. A radix tree keyed by token ids in units of whole
// pages (page_size tokens); each edge holds the pages that cache its tokens. Requests lock the path they use
// (reference counts up to the root); unlocked leaves are evicted least-recently-used when pages are needed.
//
// With a host tier (enable_host_tier: SGLang's hierarchical cache, --enable-hierarchical-cache) an edge evicted from
// the device keeps its tokens in host slots instead of being dropped: its pages are copied to the host (a save) and
// go back to the pool. A later match that runs into such an edge takes device pages for it (evicting others) and
// copies it back (a load). An edge lives in one tier at a time: device pages or host slots. The copies are recorded
// here and carried out by the next step that runs (take_copies: its saves first, then its loads, then its forward);
// until then an edge being loaded stays pinned (not evictable) and the slots it left stay taken, so no copy of the
// same step reads what another writes.
//
// Cache salts (vLLM's cache_salt, SGLang's extra_key): each salt has a tree of its own (a root per salt, made by its
// first insert and gone once its last edge is), so requests share cached prefixes only with requests of the same salt;
// eviction ranks the edges of all trees together.
//
// Invariants (check_integrity): every edge's key length = its pages (device or host) * page_size; a node's lock_ref >=
// its children's (locks propagate to the root); a node on the device has its parent on the device (or the root);
// pages in the tree are never on the pool's free list and appear once, host slots likewise; evictable_pages = device
// pages of nodes with lock_ref == 0.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/page_pool.h"

namespace mlaserve {

class RadixCache {
 public:
  struct Node;

  struct Match {
    std::vector<int32_t> pages;  // pages caching tokens [0, tokens)
    int32_t tokens = 0;
    Node* node = nullptr;        // deepest node of the match (lock it while the pages are in use); null: none
    int32_t loaded_tokens = 0;   // of `tokens`, those copied back from the host tier for this match
  };
  // Copies between device pages and host slots that the next step must carry out, before its forward.
  struct Copies {
    std::vector<int32_t> saves;  // pairs (device page, host slot): device to host
    std::vector<int32_t> loads;  // pairs (host slot, device page): host to device, after the saves
    bool empty() const { return saves.empty() && loads.empty(); }
  };

  // enabled = false: a cache that never matches and never keeps anything (--disable-radix-cache).
  RadixCache(int32_t page_size, PagePool& pool, bool enabled);
  ~RadixCache();

  bool enabled() const { return enabled_; }
  // A host tier of `host_slots` slots (page-sized), before anything is cached.
  void enable_host_tier(int32_t host_slots);
  bool has_host_tier() const { return host_pool_ != nullptr; }
  // Longest cached prefix of `tokens` in whole pages, at most `max_tokens` long. Touches the path (LRU). With a host
  // tier, the part of it on the host is loaded when device pages can be had for it (else the match ends before it).
  // `salt`: the tree of that cache salt ("" none).
  Match match_prefix(std::span<const int32_t> tokens, int32_t max_tokens, std::string_view salt = {});
  // The device pages of the longest cached prefix of `tokens` whose pages are all on the device, in whole pages; reads
  // only (no touch, no split, no load). Prefill / decode disaggregation reads them out.
  std::vector<int32_t> device_prefix(std::span<const int32_t> tokens, std::string_view salt = {}) const;
  // The copies recorded since the last call, for the step about to run (releases the pins of the loaded edges).
  Copies take_copies();
  bool copies_pending() const { return !pending_.empty(); }
  void lock(Node* node);    // null: no-op
  void unlock(Node* node);  // null: no-op
  // Caches tokens[0, pages.size() * page_size) held in `pages`. Pages of positions the tree already caches with
  // a different page are duplicates and go back to the pool. Returns the node ending the inserted path (null for no
  // pages). When the cache is disabled, every page goes back to the pool and null is returned.
  Node* insert(std::span<const int32_t> tokens, std::span<const int32_t> pages, std::string_view salt = {});
  // The same for pages a request goes on using: afterwards `pages` holds the tree's page at every position (each
  // duplicate replaced by the page the tree already had). The returned node ends exactly at the last page.
  Node* insert_shared(std::span<const int32_t> tokens, std::span<int32_t> pages, std::string_view salt = {});
  // Frees up to `num_pages` pages from unlocked leaves, least recently used first. Returns pages freed.
  int32_t evict(int32_t num_pages);
  int32_t evictable_pages() const { return evictable_pages_; }
  // Pages that would become evictable if every node in `nodes` (each a request's locked path; null: none) were
  // unlocked once: those of the nodes on these paths that no other lock holds.
  int32_t pages_unlocked_by(std::span<Node* const> nodes) const;
  int32_t cached_pages() const { return cached_pages_; }
  int32_t host_slots() const;         // 0 without a host tier
  int32_t host_cached_slots() const;  // slots holding edges (or freed by this step's loads)
  // Drops everything; requires that nothing is locked (returns false otherwise).
  bool reset();
  void check_integrity() const;

 private:
  Node* split(Node* node, size_t pages_kept);
  // Every tree's root (the unsalted one first).
  std::vector<Node*> roots() const;
  // A salted tree's root goes once its last edge has (the unsalted one stays).
  void drop_if_empty_root(Node* node);
  void free_subtree(Node* node);
  void touch(Node* node);
  // Makes `n` host slots free, dropping unlocked host-only leaves least recently used first; false if it cannot.
  // Within one evict() the leaves are found once (host_drops_), not by a walk of the tree per evicted edge.
  bool free_host_slots(int32_t n);
  bool host_droppable(const Node* x) const;
  // Copies the host-only edges of `path` (top down, on the device from its first node's parent) back to new device
  // pages, when the pool (after evictions) has them; true if it did.
  bool load(const std::vector<Node*>& path);

  int32_t page_size_;
  PagePool& pool_;
  bool enabled_;
  std::unique_ptr<Node> root_;                                   // the unsalted tree's
  std::map<std::string, std::unique_ptr<Node>, std::less<>> salted_;  // the salted trees' roots
  uint64_t clock_ = 0;
  int32_t evictable_pages_ = 0;
  int32_t cached_pages_ = 0;
  std::unique_ptr<PagePool> host_pool_;  // the host tier's slots; null without one
  Copies pending_;                       // for the next step
  std::vector<Node*> pins_;              // edges loaded for the next step: locked until take_copies
  std::vector<int32_t> slots_after_step_;  // host slots the pending loads read: free again after take_copies
  std::vector<Node*> host_drops_;  // during evict(): droppable host-only leaves, a heap, least recently used on top
  bool host_drops_found_ = false;  // host_drops_ holds every droppable leaf (found on first need in an evict())
};

}  // namespace mlaserve
