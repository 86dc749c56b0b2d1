// PagePool: host-side allocator of latent-cache pages (fixed-size, `page_size` token slots each).
// It only hands out page ids; the KV memory lives in model/kv_cache. Pages are never leaked: the pool can check
// that every page is either free or accounted for by its holders.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace mlaserve {

class PagePool {
 public:
  explicit PagePool(int32_t num_pages);
  int32_t num_pages() const { return num_pages_; }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  // n pages, or nullopt (nothing taken) when fewer than n are free.
  std::optional<std::vector<int32_t>> alloc(int32_t n);
  void free(const std::vector<int32_t>& pages);
  // Throws if a page is double-freed or out of range (checked on free) or the free list has duplicates.
  void check_integrity() const;

 private:
  int32_t num_pages_;
  std::vector<int32_t> free_;
  std::vector<char> is_free_;
};

}  // namespace mlaserve
