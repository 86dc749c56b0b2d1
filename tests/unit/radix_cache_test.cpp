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

// Salted: each sequence under one of a few cache salts ("" among them), whose trees share nothing.
class RadixCacheRandom : public ::testing::TestWithParam<bool> {
 protected:
  std::string salt(std::mt19937& rng) const {
    static const char* const kSalts[] = {"", "tenant-a", "tenant-b"};
    return GetParam() ? kSalts[rng() % 3] : "";
  }
};

}  // namespace

TEST_P(RadixCacheRandom, MatchesNaiveModelUnderRandomInsertsAndLocks) {
  std::mt19937 rng(123);
  PagePool pool(4096);
  RadixCache cache(P, pool, true);
  // (salt, page-aligned prefix) -> page caching its last page
  std::map<std::pair<std::string, std::vector<int32_t>>, int32_t> naive;
  std::vector<RadixCache::Node*> locked;
  for (int iter = 0; iter < 3000; ++iter) {
    auto seq = random_seq(rng, 6);
    const std::string sa = salt(rng);
    if (rng() % 2) {
      // Insert as a finishing request would: reuse the matched prefix pages, allocate the rest.
      auto m = cache.match_prefix(seq, static_cast<int32_t>(seq.size()), sa);
      const int32_t full = static_cast<int32_t>(seq.size()) / P;
      std::vector<int32_t> pages = m.pages;
      auto fresh = pool.alloc(full - static_cast<int32_t>(pages.size()));
      ASSERT_TRUE(fresh.has_value());
      pages.insert(pages.end(), fresh->begin(), fresh->end());
      RadixCache::Node* n = cache.insert(seq, pages, sa);
      for (int32_t k = 1; k <= full; ++k) {
        std::vector<int32_t> pre(seq.begin(), seq.begin() + k * P);
        naive.emplace(std::make_pair(sa, pre), pages[k - 1]);  // existing entries keep their page
      }
      if (rng() % 4 == 0) {
        cache.lock(n);
        locked.push_back(n);
      }
    } else {
      const int32_t limit = static_cast<int32_t>(seq.size()) - 1;
      auto m = cache.match_prefix(seq, limit, sa);
      int32_t expect = 0;
      for (int32_t k = 1; k * P <= limit; ++k) {
        std::vector<int32_t> pre(seq.begin(), seq.begin() + k * P);
        if (!naive.count({sa, pre})) break;
        expect = k * P;
      }
      ASSERT_EQ(m.tokens, expect);
      ASSERT_EQ(static_cast<int32_t>(m.pages.size()), expect / P);
      for (int32_t k = 1; k * P <= expect; ++k)
        ASSERT_EQ(m.pages[k - 1], naive.at({sa, std::vector<int32_t>(seq.begin(), seq.begin() + k * P)}));
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

INSTANTIATE_TEST_SUITE_P(Salts, RadixCacheRandom, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Salted" : "Unsalted"; });

// The same tokens under different salts: separate pages, no match across; eviction ranks every tree's leaves together
// and a salted tree's root goes with its last edge.
TEST(RadixCache, SaltsShareNothingAndEvictTogether) {
  PagePool pool(64);
  RadixCache cache(P, pool, true);
  const std::vector<int32_t> seq{1, 1, 1, 1, 2, 2, 2, 2, 9};
  auto put = [&](const std::string& salt) {
    auto pages = *pool.alloc(2);
    cache.insert(std::span<const int32_t>(seq.data(), 8), pages, salt);
    return pages;
  };
  const auto plain = put(""), a = put("a");
  EXPECT_EQ(cache.cached_pages(), 4);  // no page shared
  EXPECT_EQ(cache.match_prefix(seq, 8).pages, plain);
  EXPECT_EQ(cache.match_prefix(seq, 8, "a").pages, a);
  const auto none = cache.match_prefix(seq, 8, "b");
  EXPECT_EQ(none.tokens, 0);
  EXPECT_EQ(none.node, nullptr);
  cache.check_integrity();
  // "" is the most recently used now: "a"'s edge goes first, and its tree with it.
  EXPECT_EQ(cache.match_prefix(seq, 8).tokens, 8);
  EXPECT_EQ(cache.evict(1), 2);
  cache.check_integrity();
  EXPECT_EQ(cache.match_prefix(seq, 8, "a").tokens, 0);
  EXPECT_EQ(cache.match_prefix(seq, 8).tokens, 8);
  const auto again = put("a");  // a new tree for "a"
  EXPECT_EQ(cache.match_prefix(seq, 8, "a").pages, again);
  cache.check_integrity();
  EXPECT_TRUE(cache.reset());
  EXPECT_EQ(pool.num_free(), 64);
  cache.check_integrity();
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

// The host tier (hierarchical cache) with the KV data simulated: a page's content is the id of the token prefix it
// ends (what the model would have written there). Every iteration is a step: a request matches (loading what is on
// the host), takes fresh pages for the rest (evicting: saves), then the step's copies run (saves, then loads) and its
// forward reads its prefix pages (each must hold its prefix's content) and writes the new ones; afterwards its pages
// go to the tree. With a device pool far too small for everything, most hits come back from the host.
TEST_P(RadixCacheRandom, HostTierKeepsEvictedPrefixesWithTheirContent) {
  std::mt19937 rng(7);
  constexpr int32_t kPages = 24, kSlots = 40;
  PagePool pool(kPages);
  RadixCache cache(P, pool, true);
  cache.enable_host_tier(kSlots);
  std::map<std::pair<std::string, std::vector<int32_t>>, int64_t> ids;  // (salt, token prefix) -> content id
  std::string sa;  // this iteration's salt
  auto content = [&](const std::vector<int32_t>& seq, int32_t k) {  // of page k (0-based)
    return ids
        .emplace(std::make_pair(sa, std::vector<int32_t>(seq.begin(), seq.begin() + (k + 1) * P)),
                 static_cast<int64_t>(ids.size()))
        .first->second;
  };
  std::vector<int64_t> device(kPages, -1), host(kSlots, -1);
  int64_t loaded = 0, hits = 0, saves = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    auto seq = random_seq(rng, 5);
    sa = salt(rng);
    const int32_t full = static_cast<int32_t>(seq.size()) / P;
    auto m = cache.match_prefix(seq, static_cast<int32_t>(seq.size()) - 1, sa);
    cache.lock(m.node);
    loaded += m.loaded_tokens;
    hits += m.tokens;
    std::vector<int32_t> pages = m.pages;
    const int32_t need = full - static_cast<int32_t>(pages.size());
    if (pool.num_free() < need) cache.evict(need - pool.num_free());
    auto fresh = pool.alloc(need);
    ASSERT_TRUE(fresh.has_value()) << iter;  // nothing else holds pages: evicting always frees enough
    pages.insert(pages.end(), fresh->begin(), fresh->end());
    // The step: its copies, then its forward.
    const RadixCache::Copies c = cache.take_copies();
    ASSERT_FALSE(cache.copies_pending());
    const auto at = [](const std::vector<int32_t>& v, size_t i) { return static_cast<size_t>(v[i]); };
    for (size_t i = 0; i < c.saves.size(); i += 2) host[at(c.saves, i + 1)] = device[at(c.saves, i)];
    for (size_t i = 0; i < c.loads.size(); i += 2) device[at(c.loads, i + 1)] = host[at(c.loads, i)];
    saves += static_cast<int64_t>(c.saves.size() / 2);
    for (int32_t k = 0; k < static_cast<int32_t>(m.pages.size()); ++k)
      ASSERT_EQ(device[static_cast<size_t>(pages[static_cast<size_t>(k)])], content(seq, k)) << iter << " page " << k;
    for (int32_t k = static_cast<int32_t>(m.pages.size()); k < full; ++k)
      device[static_cast<size_t>(pages[static_cast<size_t>(k)])] = content(seq, k);
    cache.insert(seq, pages, sa);
    cache.unlock(m.node);
    if (iter % 50 == 0) cache.check_integrity();
    ASSERT_EQ(pool.num_free() + cache.cached_pages(), pool.num_pages());
  }
  cache.check_integrity();
  EXPECT_GT(saves, 100);
  EXPECT_GT(loaded, 100 * P);  // hits served from the host tier
  EXPECT_GT(hits, loaded);
  EXPECT_GT(cache.host_cached_slots(), 0);
  EXPECT_TRUE(cache.reset());
  EXPECT_EQ(cache.host_cached_slots(), 0);
  EXPECT_EQ(pool.num_free(), kPages);
}

// Without room on the host, or with a host tier too small, eviction drops edges (and what hangs below them on the
// host); an edge being loaded is pinned until its step takes the copies; a hit on the host that cannot get device
// pages ends the match at the device part.
TEST(RadixCache, HostTierPinsLoadsAndFallsBackToDropping) {
  PagePool pool(4);
  RadixCache cache(P, pool, true);
  cache.enable_host_tier(2);
  auto put = [&](const std::vector<int32_t>& seq) {
    auto m = cache.match_prefix(seq, static_cast<int32_t>(seq.size()));
    std::vector<int32_t> pages = m.pages;
    const int32_t need = static_cast<int32_t>(seq.size()) / P - static_cast<int32_t>(pages.size());
    if (pool.num_free() < need) cache.evict(need - pool.num_free());
    auto fresh = pool.alloc(need);
    pages.insert(pages.end(), fresh->begin(), fresh->end());
    cache.insert(seq, pages);
    (void)cache.take_copies();
  };
  const std::vector<int32_t> a{1, 1, 1, 1, 2, 2, 2, 2}, b{3, 3, 3, 3, 4, 4, 4, 4};
  put(a);
  put(b);  // the pool is full: a and b on the device
  EXPECT_EQ(cache.cached_pages(), 4);
  EXPECT_EQ(cache.evict(2), 2);  // a (older) to the host
  RadixCache::Copies cp = cache.take_copies();
  EXPECT_EQ(cp.saves.size(), 4u);
  EXPECT_EQ(cache.host_cached_slots(), 2);
  EXPECT_EQ(cache.evict(2), 2);  // b: the host is full of a, which is older: a is dropped, b saved
  cp = cache.take_copies();
  EXPECT_EQ(cp.saves.size(), 4u);
  EXPECT_EQ(cache.match_prefix(a, 8).tokens, 0);
  cache.check_integrity();
  // b comes back (a load into two fresh pages), pinned until the copies are taken.
  RadixCache::Match m = cache.match_prefix(b, 8);
  EXPECT_EQ(m.tokens, 8);
  EXPECT_EQ(m.loaded_tokens, 8);
  EXPECT_EQ(cache.evict(4), 0);  // pinned
  cp = cache.take_copies();
  EXPECT_EQ(cp.loads.size(), 4u);
  EXPECT_EQ(cp.loads[1], m.pages[0]);
  EXPECT_EQ(cache.host_cached_slots(), 0);  // the slots b left are free once its step has them
  EXPECT_EQ(cache.evict(4), 2);
  (void)cache.take_copies();
  // With the whole device pool held by a locked path, a hit on the host stays on the host.
  std::vector<int32_t> d{8, 8, 8, 8, 9, 9, 9, 9, 8, 8, 8, 8, 9, 9, 9, 9};
  auto held = *pool.alloc(4);
  RadixCache::Node* dn = cache.insert(d, held);
  cache.lock(dn);
  m = cache.match_prefix(b, 8);
  EXPECT_EQ(m.tokens, 0);
  EXPECT_EQ(m.loaded_tokens, 0);
  EXPECT_FALSE(cache.copies_pending());
  cache.check_integrity();
  cache.unlock(dn);
  EXPECT_TRUE(cache.reset());
  EXPECT_EQ(pool.num_free(), 4);

  // An edge longer than the whole host tier is dropped without emptying the tier first.
  cache.enable_host_tier(2);
  put(b);
  EXPECT_EQ(cache.evict(2), 2);
  (void)cache.take_copies();
  put(d);  // four pages: b is on the host; d takes the pool
  EXPECT_EQ(cache.host_cached_slots(), 2);
  EXPECT_EQ(cache.evict(4), 4);  // d (4 pages > 2 slots) is dropped; b stays on the host
  EXPECT_FALSE(cache.copies_pending());
  EXPECT_EQ(cache.host_cached_slots(), 2);
  EXPECT_EQ(cache.match_prefix(b, 8).loaded_tokens, 8);
  cache.check_integrity();
  EXPECT_FALSE(cache.reset());  // the load pins b
  (void)cache.take_copies();
  EXPECT_TRUE(cache.reset());
}

// device_prefix (what prefill / decode disaggregation reads out): the pages of the longest prefix held on the device,
// whole pages, inside an edge too, per salt; it stops where an edge is on the host tier, and changes nothing (no
// split, no load, no LRU touch).
TEST(RadixCache, DevicePrefixReadsOnlyTheDevicePart) {
  PagePool pool(8);
  RadixCache cache(P, pool, true);
  cache.enable_host_tier(4);
  const std::vector<int32_t> a{1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}, b{7, 7, 7, 7, 6, 6, 6, 6};
  const std::vector<int32_t> pa = *pool.alloc(3), pb = *pool.alloc(2);
  cache.insert(a, pa);
  cache.insert(b, pb, "salt");
  EXPECT_EQ(cache.device_prefix(a), pa);
  EXPECT_EQ(cache.device_prefix(std::vector<int32_t>(a.begin(), a.begin() + 11)),
            std::vector<int32_t>(pa.begin(), pa.begin() + 2));  // whole pages only, inside the edge
  std::vector<int32_t> diverging = a;
  diverging[9] = 5;
  EXPECT_EQ(cache.device_prefix(diverging), std::vector<int32_t>(pa.begin(), pa.begin() + 2));
  EXPECT_TRUE(cache.device_prefix(b).empty());  // (under another salt)
  EXPECT_EQ(cache.device_prefix(b, "salt"), pb);
  EXPECT_TRUE(cache.device_prefix(a, "salt").empty());
  // Nothing was split or touched: a (older than b) is still the one evicted first, as one edge.
  EXPECT_EQ(cache.evict(1), 3);
  (void)cache.take_copies();
  EXPECT_TRUE(cache.device_prefix(a).empty());  // on the host now
  EXPECT_EQ(cache.host_cached_slots(), 3);
  EXPECT_EQ(cache.match_prefix(a, 12).loaded_tokens, 12);  // (still there)
  cache.check_integrity();
  RadixCache disabled(P, pool, false);
  EXPECT_TRUE(disabled.device_prefix(a).empty());
}
