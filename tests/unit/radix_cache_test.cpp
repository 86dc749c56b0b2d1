// RadixCache against a naive model (a map from every cached page-prefix to its page), with random inserts,
// matches, locks and evictions; plus the LRU order and flush.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "engine/radix_cache.h"

using namespace mlaserve;

namespace {

constexpr int32_t P = 4;

std::vector<int32_t> random_seq(std::mt19937& rng, int max_pages) {
  // Few distinct tokens so sequences share prefixes often.
  std::uniform_int_distribution<int> len(1, max_pages * P + 3), tok(0, 2);
  std::vector<int32_t> s(static_cast<size_t>(len(rng)));
  for (auto& t : s) t = tok(rng);
  return s;
}

}  // namespace

TEST(RadixCache, MatchesNaiveModelUnderRandomInsertsAndLocks) {
  std::mt19937 rng(123);
  PagePool pool(4096);
  RadixCache cache(P, pool, true);
  std::map<std::vector<int32_t>, int32_t> naive;  // page-aligned prefix -> page caching its last page
  std::vector<RadixCache::Node*> locked;
  for (int iter = 0; iter < 3000; ++iter) {
    auto seq = random_seq(rng, 6);
    if (rng() % 2) {
      // Insert as a finishing request would: reuse the matched prefix pages, allocate the rest.
      auto m = cache.match_prefix(seq, static_cast<int32_t>(seq.size()));
      const int32_t full = static_cast<int32_t>(seq.size()) / P;
      std::vector<int32_t> pages = m.pages;
      auto fresh = pool.alloc(full - static_cast<int32_t>(pages.size()));
      ASSERT_TRUE(fresh.has_value());
      pages.insert(pages.end(), fresh->begin(), fresh->end());
      RadixCache::Node* n = cache.insert(seq, pages);
      for (int32_t k = 1; k <= full; ++k) {
        std::vector<int32_t> pre(seq.begin(), seq.begin() + k * P);
        naive.emplace(pre, pages[k - 1]);  // existing entries keep their page
      }
      if (rng() % 4 == 0) {
        cache.lock(n);
        locked.push_back(n);
      }
    } else {
      const int32_t limit = static_cast<int32_t>(seq.size()) - 1;
      auto m = cache.match_prefix(seq, limit);
      int32_t expect = 0;
      for (int32_t k = 1; k * P <= limit; ++k) {
        std::vector<int32_t> pre(seq.begin(), seq.begin() + k * P);
        if (!naive.count(pre)) break;
        expect = k * P;
      }
      ASSERT_EQ(m.tokens, expect);
      ASSERT_EQ(static_cast<int32_t>(m.pages.size()), expect / P);
      for (int32_t k = 1; k * P <= expect; ++k)
        ASSERT_EQ(m.pages[k - 1], naive.at(std::vector<int32_t>(seq.begin(), seq.begin() + k * P)));
    }
    if (iter % 100 == 0) cache.check_integrity();
    ASSERT_EQ(pool.num_free() + cache.cached_pages(), pool.num_pages());
  }
  cache.check_integrity();
  ASSERT_EQ(static_cast<int32_t>(naive.size()), cache.cached_pages());

  // Evict everything evictable: locked paths must survive intact.
  const int32_t locked_pages = cache.cached_pages() - cache.evictable_pages();
  cache.evict(1 << 30);
  cache.check_integrity();
  EXPECT_EQ(cache.cached_pages(), locked_pages);
  EXPECT_EQ(cache.evictable_pages(), 0);
  EXPECT_FALSE(cache.reset());  // still locked
  for (auto* n : locked) cache.unlock(n);
  EXPECT_EQ(cache.evictable_pages(), cache.cached_pages());
  EXPECT_TRUE(cache.reset());
  EXPECT_EQ(pool.num_free(), pool.num_pages());
  pool.check_integrity();
}

TEST(RadixCache, EvictsLeastRecentlyUsedLeavesFirst) {
  PagePool pool(64);
  RadixCache cache(P, pool, true);
  auto put = [&](std::vector<int32_t> seq) {
    auto pages = *pool.alloc(static_cast<int32_t>(seq.size()) / P);
    cache.insert(seq, pages);
  };
  put({1, 1, 1, 1, 2, 2, 2, 2});  // shared first page, then [2..]
  put({1, 1, 1, 1, 3, 3, 3, 3});
  put({5, 5, 5, 5});
  EXPECT_EQ(cache.cached_pages(), 4);
  // Touch [1,1,1,1,2,...] so [3,...] and [5,...] are older.
  EXPECT_EQ(cache.match_prefix(std::vector<int32_t>{1, 1, 1, 1, 2, 2, 2, 2, 9}, 8).tokens, 8);
  EXPECT_EQ(cache.evict(1), 1);  // the older of the leaves [3..] / [5..]
  EXPECT_EQ(cache.match_prefix(std::vector<int32_t>{1, 1, 1, 1, 3, 3, 3, 3, 0}, 8).tokens, 4);
  EXPECT_EQ(cache.match_prefix(std::vector<int32_t>{1, 1, 1, 1, 2, 2, 2, 2, 0}, 8).tokens, 8);
  // Once its children are gone, an inner node becomes a leaf and can go too.
  EXPECT_EQ(cache.evict(10), 3);
  EXPECT_EQ(cache.cached_pages(), 0);
  EXPECT_EQ(pool.num_free(), 64);
  cache.check_integrity();
}

TEST(RadixCache, DuplicatePagesReturnToThePoolAndDisabledKeepsNothing) {
  PagePool pool(16);
  RadixCache cache(P, pool, true);
  std::vector<int32_t> seq{7, 7, 7, 7, 8, 8, 8, 8};
  cache.insert(seq, *pool.alloc(2));
  // A second request computed the same tokens in its own pages: those are duplicates.
  cache.insert(seq, *pool.alloc(2));
  EXPECT_EQ(cache.cached_pages(), 2);
  EXPECT_EQ(pool.num_free(), 14);
  cache.check_integrity();
  // A third one that goes on using its pages: they become the tree's (one more page of its own stays its own).
  std::vector<int32_t> seq3 = seq;
  seq3.insert(seq3.end(), {9, 9, 9, 9});
  std::vector<int32_t> mine = *pool.alloc(3);
  const int32_t own = mine[2];
  RadixCache::Node* end = cache.insert_shared(seq3, mine);
  const RadixCache::Match m = cache.match_prefix(seq3, 12);
  EXPECT_EQ(mine, m.pages);
  EXPECT_EQ(mine[2], own);
  EXPECT_EQ(m.node, end);
  EXPECT_EQ(pool.num_free(), 13);  // its two duplicates back, its third page cached
  cache.check_integrity();

  PagePool pool2(8);
  RadixCache off(P, pool2, false);
  EXPECT_EQ(off.insert(seq, *pool2.alloc(2)), nullptr);
  EXPECT_EQ(pool2.num_free(), 8);
  EXPECT_EQ(off.match_prefix(seq, 8).tokens, 0);
}

// pages_unlocked_by: the pages of the given locked paths that no other lock holds, counted once however many of the
// paths share them; the check is the evictable pages after unlocking them.
TEST(RadixCache, PagesUnlockedByCountsOnlyPagesNoOtherLockHolds) {
  PagePool pool(64);
  RadixCache cache(P, pool, true);
  auto seq = [](int32_t shared_pages, int32_t own_pages, int32_t tag) {
    std::vector<int32_t> s(static_cast<size_t>((shared_pages + own_pages) * P), 7);
    for (size_t i = static_cast<size_t>(shared_pages * P); i < s.size(); ++i) s[i] = tag;
    return s;
  };
  auto insert = [&](const std::vector<int32_t>& s) {
    auto m = cache.match_prefix(s, static_cast<int32_t>(s.size()));
    std::vector<int32_t> pages = m.pages;
    auto fresh = pool.alloc(static_cast<int32_t>(s.size()) / P - static_cast<int32_t>(pages.size()));
    pages.insert(pages.end(), fresh->begin(), fresh->end());
    RadixCache::Node* n = cache.insert(s, pages);
    cache.lock(n);
    return n;
  };
  // a, b, c share 3 pages; a and b own 2 each, c owns 1.
  RadixCache::Node* a = insert(seq(3, 2, 1));
  RadixCache::Node* b = insert(seq(3, 2, 2));
  RadixCache::Node* c = insert(seq(3, 1, 3));
  EXPECT_EQ(cache.evictable_pages(), 0);
  EXPECT_EQ(cache.pages_unlocked_by(std::vector<RadixCache::Node*>{a}), 2);
  EXPECT_EQ(cache.pages_unlocked_by(std::vector<RadixCache::Node*>{a, b}), 4);
  EXPECT_EQ(cache.pages_unlocked_by(std::vector<RadixCache::Node*>{a, b, c}), 8);
  EXPECT_EQ(cache.pages_unlocked_by(std::vector<RadixCache::Node*>{a, nullptr}), 2);
  EXPECT_EQ(cache.pages_unlocked_by(std::vector<RadixCache::Node*>{}), 0);
  for (const auto& [nodes, want] : std::vector<std::pair<std::vector<RadixCache::Node*>, int32_t>>{
           {{a}, 2}, {{a, b}, 4}, {{a, b, c}, 8}}) {
    for (RadixCache::Node* n : nodes) cache.unlock(n);
    EXPECT_EQ(cache.evictable_pages(), want) << nodes.size();
    for (RadixCache::Node* n : nodes) cache.lock(n);
  }
  cache.check_integrity();
}
