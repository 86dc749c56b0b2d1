#include "engine/page_pool.h"

#include "core/error.h"

namespace mlaserve {

PagePool::PagePool(int32_t num_pages) : num_pages_(num_pages), is_free_(static_cast<size_t>(num_pages), 1) {
  MLA_CHECK(num_pages > 0, "page pool needs at least one page");
  free_.reserve(static_cast<size_t>(num_pages));
  for (int32_t p = num_pages - 1; p >= 0; --p) free_.push_back(p);
}

std::optional<std::vector<int32_t>> PagePool::alloc(int32_t n) {
  if (n < 0 || n > num_free()) return std::nullopt;
  std::vector<int32_t> out(free_.end() - n, free_.end());
  free_.resize(free_.size() - static_cast<size_t>(n));
  for (int32_t p : out) is_free_[static_cast<size_t>(p)] = 0;
  return out;
}

void PagePool::free(const std::vector<int32_t>& pages) {
  for (int32_t p : pages) {
    MLA_CHECK(p >= 0 && p < num_pages_, "page pool: freeing page {} outside [0, {})", p, num_pages_);
    MLA_CHECK(!is_free_[static_cast<size_t>(p)], "page pool: page {} freed twice", p);
    is_free_[static_cast<size_t>(p)] = 1;
    free_.push_back(p);
  }
}

void PagePool::check_integrity() const {
  std::vector<char> seen(static_cast<size_t>(num_pages_), 0);
  for (int32_t p : free_) {
    MLA_CHECK(p >= 0 && p < num_pages_ && !seen[static_cast<size_t>(p)], "page pool: corrupt free list at page {}", p);
    MLA_CHECK(is_free_[static_cast<size_t>(p)], "page pool: page {} on the free list is marked used", p);
    seen[static_cast<size_t>(p)] = 1;
  }
  int32_t marked = 0;
  for (char f : is_free_) marked += f ? 1 : 0;
  MLA_CHECK(marked == num_free(), "page pool: {} pages marked free but {} on the free list", marked, num_free());
}

}  // namespace mlaserve
