// PagePool: host-side allocator of latent-cache pages (fixed-size, `page_size` token slots each).
// It only hands out page ids; the KV memory lives in model/kv_cache. Pages are never leaked: the pool can check
// that every page is either free or accounted for by its holders.
//
// Placement: a sequence's pages are kept consecutive where it costs nothing (the decode kernel of 64-head groups
// copies a tile of consecutive pages' rows as one box, docs/cuda.md). `alloc` takes the top of a free stack, which a
// fresh pool (and a run freed as a whole) holds in ascending order; `alloc_after` grows a sequence past its last
// page: the pages right after it when free, else pages of a wholly free block of `run` pages taken from the high end
// (far from where `alloc` takes), so that its next growth finds the rest of the block free.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace mlaserve {

class PagePool {
 public:
  // run: the block of consecutive pages alloc_after aims for (1: no preference).
  explicit PagePool(int32_t num_pages, int32_t run = 1);
  int32_t num_pages() const { return num_pages_; }
  int32_t num_free() const { return num_free_; }
  // n pages, or nullopt (nothing taken) when fewer than n are free. A fresh pool gives 0, 1, 2, ...; pages freed
  // together come back in the order they were freed in.
  std::optional<std::vector<int32_t>> alloc(int32_t n);
  // n more pages for a sequence that holds `held` (placed as the header says: block offsets follow the sequence's
  // page indices, so a tile of `run` of its pages lies in one block); nullopt as alloc.
  std::optional<std::vector<int32_t>> alloc_after(const std::vector<int32_t>& held, int32_t n);
  void free(const std::vector<int32_t>& pages);
  // Throws if a page is double-freed or out of range (checked on free) or the free structures disagree.
  void check_integrity() const;

 private:
  bool is_free(int32_t p) const { return pos_[static_cast<size_t>(p)] >= 0; }
  void take(int32_t p);  // p (free) leaves the free structures
  void push(int32_t p);  // p joins them
  int32_t pop_top();     // the top live entry of the stack
  void compact();

  int32_t num_pages_, run_, num_free_ = 0;
  // The free stack; an entry is live iff pos_ of its page is its index (pages taken out of the middle leave stale
  // entries behind, dropped when they reach the top or by compact()).
  std::vector<int32_t> stack_;
  std::vector<int32_t> pos_;          // [num_pages] index of the page's live entry, -1 when the page is in use
  std::vector<int32_t> block_free_;   // [blocks] free pages of each block of run_ pages
  std::vector<int32_t> whole_;        // blocks once wholly free, highest on top (checked when popped)
};

}  // namespace mlaserve
