#include "engine/page_pool.h"

#include <algorithm>

#include "core/error.h"

namespace mlaserve {

PagePool::PagePool(int32_t num_pages, int32_t run)
    : num_pages_(num_pages), run_(run), pos_(static_cast<size_t>(std::max(num_pages, 0)), -1) {
  MLA_CHECK(num_pages > 0, "page pool needs at least one page");
  MLA_CHECK(run >= 1, "page pool: run must be at least 1 page, got {}", run);
  block_free_.assign(static_cast<size_t>((num_pages + run - 1) / run), 0);
  stack_.reserve(static_cast<size_t>(num_pages));
  for (int32_t p = num_pages - 1; p >= 0; --p) push(p);  // the top of the stack: page 0
  whole_.clear();                                         // (the highest block on top)
  if (run_ > 1)
    for (int32_t b = 0; b < static_cast<int32_t>(block_free_.size()); ++b)
      if (block_free_[static_cast<size_t>(b)] == run_) whole_.push_back(b);
}

void PagePool::push(int32_t p) {
  pos_[static_cast<size_t>(p)] = static_cast<int32_t>(stack_.size());
  stack_.push_back(p);
  ++num_free_;
  if (run_ > 1 && ++block_free_[static_cast<size_t>(p / run_)] == run_) {
    whole_.push_back(p / run_);
    if (whole_.size() > 2 * block_free_.size() + 64) {  // (entries of blocks taken from since: rebuilt)
      whole_.clear();
      for (int32_t b = 0; b < static_cast<int32_t>(block_free_.size()); ++b)
        if (block_free_[static_cast<size_t>(b)] == run_) whole_.push_back(b);
    }
  }
}

void PagePool::take(int32_t p) {
  const int32_t i = pos_[static_cast<size_t>(p)];
  pos_[static_cast<size_t>(p)] = -1;
  --num_free_;
  if (run_ > 1) --block_free_[static_cast<size_t>(p / run_)];
  if (i == static_cast<int32_t>(stack_.size()) - 1) stack_.pop_back();  // (else its entry goes stale)
  if (stack_.size() > 2 * static_cast<size_t>(num_free_) + 64) compact();
}

int32_t PagePool::pop_top() {
  while (pos_[static_cast<size_t>(stack_.back())] != static_cast<int32_t>(stack_.size()) - 1) stack_.pop_back();
  return stack_.back();
}

void PagePool::compact() {
  size_t n = 0;
  for (size_t i = 0; i < stack_.size(); ++i) {
    const int32_t p = stack_[i];
    if (pos_[static_cast<size_t>(p)] != static_cast<int32_t>(i)) continue;
    pos_[static_cast<size_t>(p)] = static_cast<int32_t>(n);
    stack_[n++] = p;
  }
  stack_.resize(n);
}

std::optional<std::vector<int32_t>> PagePool::alloc(int32_t n) {
  if (n < 0 || n > num_free()) return std::nullopt;
  // From the top of the stack down, so a fresh pool (and a run freed as a whole) hands out ascending consecutive ids:
  // a sequence's pages then lie in consecutive cache rows.
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(n));
  for (int32_t k = 0; k < n; ++k) {
    out.push_back(pop_top());
    take(out.back());
  }
  return out;
}

std::optional<std::vector<int32_t>> PagePool::alloc_after(const std::vector<int32_t>& held, int32_t n) {
  if (n < 0 || n > num_free()) return std::nullopt;
  if (run_ == 1 || n == 0) return alloc(n);
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(n));
  auto take_from = [&](int32_t first) {
    for (int32_t k = 0; k < n; ++k) {
      take(first + k);
      out.push_back(first + k);
    }
    return out;
  };
  // The pages right after the last one, if free.
  const int32_t after = held.empty() ? -1 : held.back();
  bool next_free = after >= 0 && after <= num_pages_ - 1 - n;
  for (int32_t k = 1; k <= n && next_free; ++k) next_free = is_free(after + k);
  // Within a tile (the sequence's page index not a multiple of run) the next pages keep it consecutive.
  const int32_t off = static_cast<int32_t>(held.size() % static_cast<size_t>(run_));
  if (off > 0 && next_free) return take_from(after + 1);
  // Else a wholly free block, the pages at the offsets of their page indices (the tile within one block).
  if (off + n <= run_)
    while (!whole_.empty()) {
      const int32_t b = whole_.back();
      whole_.pop_back();
      if (block_free_[static_cast<size_t>(b)] == run_) return take_from(b * run_ + off);
    }  // (a block taken from since it was whole is dropped)
  if (next_free) return take_from(after + 1);
  return alloc(n);
}

void PagePool::free(const std::vector<int32_t>& pages) {
  for (auto it = pages.rbegin(); it != pages.rend(); ++it) {  // the first page ends on top (alloc's order)
    const int32_t p = *it;
    MLA_CHECK(p >= 0 && p < num_pages_, "page pool: freeing page {} outside [0, {})", p, num_pages_);
    MLA_CHECK(!is_free(p), "page pool: page {} freed twice", p);
    push(p);
  }
}

void PagePool::check_integrity() const {
  int32_t live = 0;
  std::vector<int32_t> per_block(block_free_.size(), 0);
  for (size_t i = 0; i < stack_.size(); ++i) {
    const int32_t p = stack_[i];
    MLA_CHECK(p >= 0 && p < num_pages_, "page pool: corrupt free stack at index {}", i);
    if (pos_[static_cast<size_t>(p)] != static_cast<int32_t>(i)) continue;
    ++live;
    ++per_block[static_cast<size_t>(p / run_)];
  }
  int32_t marked = 0;
  for (int32_t p = 0; p < num_pages_; ++p) {
    const int32_t i = pos_[static_cast<size_t>(p)];
    if (i < 0) continue;
    MLA_CHECK(i < static_cast<int32_t>(stack_.size()) && stack_[static_cast<size_t>(i)] == p,
              "page pool: page {} marked free but not on the free stack", p);
    ++marked;
  }
  MLA_CHECK(live == num_free_ && marked == num_free_,
            "page pool: {} pages marked free, {} on the free stack, {} counted", marked, live, num_free_);
  MLA_CHECK(run_ == 1 || per_block == block_free_, "page pool: a block's free count is off");
}

}  // namespace mlaserve
