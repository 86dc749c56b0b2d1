// PagePool: every page handed out once, the free structures consistent after random traffic, and the placement
// (a sequence's pages consecutive in tiles of `run` pages) under interleaved decode growth.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>

#include "engine/page_pool.h"

using namespace mlaserve;

namespace {

// Full tiles (`run` consecutive page indices of a sequence) whose pages are not consecutive ids.
int broken_tiles(const std::vector<int32_t>& pages, int32_t run) {
  int broken = 0;
  for (size_t t = 0; t + static_cast<size_t>(run) <= pages.size(); t += static_cast<size_t>(run))
    for (size_t k = 1; k < static_cast<size_t>(run); ++k)
      if (pages[t + k] != pages[t] + static_cast<int32_t>(k)) {
        ++broken;
        break;
      }
  return broken;
}

TEST(PagePool, HandsOutAscendingRunsAndTakesThemBackInOrder) {
  PagePool pool(10);
  EXPECT_EQ(*pool.alloc(4), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(*pool.alloc(2), (std::vector<int32_t>{4, 5}));
  pool.free({0, 1, 2, 3});
  EXPECT_EQ(*pool.alloc(3), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(pool.num_free(), 5);
  EXPECT_FALSE(pool.alloc(6).has_value());
  EXPECT_EQ(pool.num_free(), 5);  // (nothing taken)
  EXPECT_THROW(pool.free({4, 4}), std::exception);
  pool.check_integrity();
}

TEST(PagePool, GrowsASequenceAfterItsLastPageOrIntoAFreeBlock) {
  PagePool pool(64, 4);
  std::vector<int32_t> a = *pool.alloc_after({}, 6);  // more than a block: the stack's top
  EXPECT_EQ(a, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  const std::vector<int32_t> b = *pool.alloc_after(a, 1);  // right after a's last page
  EXPECT_EQ(b, (std::vector<int32_t>{6}));
  a.push_back(6);
  const std::vector<int32_t> other = *pool.alloc(2);  // 7, 8: a cannot go on after 6
  EXPECT_EQ(other, (std::vector<int32_t>{7, 8}));
  // a holds 7 pages: its 8th page (index 7, offset 3 in a tile of 4) goes to offset 3 of the highest whole block.
  EXPECT_EQ(*pool.alloc_after(a, 1), (std::vector<int32_t>{63}));
  a.push_back(63);
  EXPECT_EQ(*pool.alloc_after(a, 1), (std::vector<int32_t>{56}));  // (no page after 63) index 8: offset 0
  // A sequence of 2 pages (offset 2) whose next pages are taken asks for 2: the next whole block, offsets 2 and 3.
  EXPECT_EQ(*pool.alloc_after({0, 1}, 2), (std::vector<int32_t>{54, 55}));
  // Wanting more than the rest of a block: from the stack.
  EXPECT_EQ(*pool.alloc_after({0, 1, 2}, 3), (std::vector<int32_t>{9, 10, 11}));
  pool.check_integrity();
  EXPECT_EQ(pool.num_free(), 64 - 6 - 1 - 2 - 1 - 1 - 2 - 3);
}

// Sequences prefilled one after the other, then decoding in lockstep one token at a time (each taking a page every
// 16 tokens, as the scheduler does): with the placement every full tile but at most the one where a prompt's pages
// end is consecutive pages; without it (run 1) the decode pages interleave across sequences.
TEST(PagePool, DecodeGrowthKeepsTilesConsecutive) {
  constexpr int32_t kPs = 16, kRun = 4, kSeqs = 24;
  for (int32_t run : {kRun, 1}) {
    PagePool pool(4096, run);
    std::mt19937 rng(7);
    std::vector<std::vector<int32_t>> seqs(kSeqs);
    std::vector<int32_t> len(kSeqs);
    for (int32_t s = 0; s < kSeqs; ++s) {
      len[static_cast<size_t>(s)] = static_cast<int32_t>(rng() % 900) + 1;
      seqs[static_cast<size_t>(s)] = *pool.alloc_after({}, (len[static_cast<size_t>(s)] + kPs - 1) / kPs);
    }
    for (int step = 0; step < 1500; ++step)
      for (int32_t s = 0; s < kSeqs; ++s) {
        auto& pages = seqs[static_cast<size_t>(s)];
        const int32_t n = ++len[static_cast<size_t>(s)];
        if ((n + kPs - 1) / kPs > static_cast<int32_t>(pages.size())) {
          const std::vector<int32_t> got = *pool.alloc_after(pages, 1);
          pages.insert(pages.end(), got.begin(), got.end());
        }
      }
    int broken = 0, tiles = 0;
    std::set<int32_t> all;
    for (const auto& pages : seqs) {
      const int b = broken_tiles(pages, kRun);
      if (run == kRun) {
        EXPECT_LE(b, 1);
      }
      broken += b;
      tiles += static_cast<int>(pages.size()) / kRun;
      all.insert(pages.begin(), pages.end());
    }
    EXPECT_EQ(static_cast<int32_t>(all.size()) + pool.num_free(), 4096);  // each page held once
    pool.check_integrity();
    if (run == 1) {
      EXPECT_GT(broken, tiles / 2);
    }
  }
}

// Random traffic (whole and partial frees, growth, plain allocations) against a set of held pages.
TEST(PagePool, RandomTrafficKeepsEveryPageOnce) {
  for (int32_t run : {1, 4, 8}) {
    PagePool pool(301, run);
    std::mt19937 rng(11 + static_cast<uint32_t>(run));
    std::vector<std::vector<int32_t>> held;
    std::set<int32_t> out;
    for (int op = 0; op < 20000; ++op) {
      const uint32_t what = rng() % 10;
      if (what < 4 && !held.empty()) {  // grow a sequence
        auto& s = held[rng() % held.size()];
        const int32_t n = static_cast<int32_t>(rng() % 3) + 1;
        const auto got = pool.alloc_after(s, n);
        if (!got) {
          EXPECT_GT(n, pool.num_free());
          continue;
        }
        ASSERT_EQ(static_cast<int32_t>(got->size()), n);
        for (int32_t p : *got) ASSERT_TRUE(out.insert(p).second) << "page " << p << " handed out twice";
        s.insert(s.end(), got->begin(), got->end());
      } else if (what < 7) {  // a new sequence
        const int32_t n = static_cast<int32_t>(rng() % 12);
        const auto got = rng() % 2 ? pool.alloc(n) : pool.alloc_after({}, n);
        if (!got) continue;
        for (int32_t p : *got) ASSERT_TRUE(out.insert(p).second) << "page " << p << " handed out twice";
        held.push_back(*got);
      } else if (!held.empty()) {  // free a sequence, or its tail (a retraction)
        const size_t i = rng() % held.size();
        auto& s = held[i];
        const size_t keep = what == 9 ? rng() % (s.size() + 1) : 0;
        std::vector<int32_t> gone(s.begin() + static_cast<int64_t>(keep), s.end());
        pool.free(gone);
        for (int32_t p : gone) out.erase(p);
        s.resize(keep);
        if (s.empty()) held.erase(held.begin() + static_cast<int64_t>(i));
      }
      ASSERT_EQ(static_cast<int32_t>(out.size()) + pool.num_free(), 301);
      if (op % 97 == 0) pool.check_integrity();
    }
    pool.check_integrity();
  }
}

}  // namespace
