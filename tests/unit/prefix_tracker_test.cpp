// PrefixTracker (what a DP rank's prefix cache probably holds) and LoadBalancer's cache_aware method built on it.
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>
#include <set>

#include "core/error.h"
#include "engine/load_balancer.h"
#include "engine/prefix_tracker.h"

using namespace mlaserve;

namespace {
std::vector<int32_t> seq(int32_t from, int32_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), from);
  return v;
}
std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
}  // namespace

TEST(PrefixTracker, MatchesTheLongestTrackedPrefix) {
  PrefixTracker t(1000);
  const auto a = seq(0, 10);
  EXPECT_EQ(t.match("", a), 0);
  t.insert("", a);
  EXPECT_EQ(t.size(), 10);
  EXPECT_EQ(t.match("", a), 10);
  EXPECT_EQ(t.match("", seq(0, 4)), 4);
  EXPECT_EQ(t.match("", cat(seq(0, 6), {99, 7})), 6);   // parts inside an edge
  EXPECT_EQ(t.match("", cat(a, seq(50, 5))), 10);       // longer than what is tracked
  EXPECT_EQ(t.match("", seq(1, 10)), 0);
  // A branch splits the edge; both sequences stay whole.
  const auto b = cat(seq(0, 6), seq(100, 8));
  t.insert("", b);
  EXPECT_EQ(t.size(), 18);
  EXPECT_EQ(t.match("", a), 10);
  EXPECT_EQ(t.match("", b), 14);
  EXPECT_EQ(t.match("", cat(seq(0, 6), {100, 101, 5})), 8);
  // A leaf extended (a request's output after its prompt) and a sequence inserted again add nothing twice.
  t.insert("", cat(a, seq(200, 3)));
  t.insert("", b);
  EXPECT_EQ(t.size(), 21);
  EXPECT_EQ(t.match("", cat(a, seq(200, 9))), 13);
  // Salts keep trees apart.
  EXPECT_EQ(t.match("s", a), 0);
  t.insert("s", seq(0, 3));
  EXPECT_EQ(t.match("s", a), 3);
  EXPECT_EQ(t.match("", a), 10);
  t.clear();
  EXPECT_EQ(t.size(), 0);
  EXPECT_EQ(t.match("", a), 0);
}

TEST(PrefixTracker, EvictsTheLeastRecentlyUsedPastItsCapacity) {
  PrefixTracker t(100);
  const auto a = seq(0, 40), b = seq(1000, 40), c = seq(2000, 40);
  t.insert("", a);
  t.insert("", b);
  t.insert("", a);  // a used again: b is the older one
  t.insert("", c);  // 120 > 100: down to 90 at most, the oldest leaf first
  EXPECT_LE(t.size(), 90);
  EXPECT_EQ(t.match("", b), 0);
  EXPECT_EQ(t.match("", a), 40);
  EXPECT_EQ(t.match("", c), 40);
  // Eviction takes leaves: a branch's shared part stays while a branch under it does.
  PrefixTracker u(50);
  u.insert("", cat(seq(0, 20), seq(100, 10)));
  u.insert("x", seq(500, 10));
  u.insert("", cat(seq(0, 20), seq(300, 10)));  // 50 tokens
  u.insert("", seq(700, 10));                   // 60: the oldest leaves go (the first branch, then salt x's)
  EXPECT_LE(u.size(), 45);
  EXPECT_EQ(u.match("", cat(seq(0, 20), seq(300, 10))), 30);
  EXPECT_EQ(u.match("", cat(seq(0, 20), seq(100, 10))), 20);
  EXPECT_EQ(u.match("x", seq(500, 10)), 0);
  // Nothing is tracked without a capacity.
  PrefixTracker none(0);
  none.insert("", a);
  EXPECT_EQ(none.match("", a), 0);
}

// Random sequences over a small alphabet (many shared starts, splits and extended leaves) under two salts: with room
// for everything, match is the longest common prefix with any sequence inserted under that salt, and size counts each
// distinct (salt, prefix) token once; with little room, a match is never longer than that and the size stays bounded.
TEST(PrefixTracker, EqualsTheDefinitionOnRandomSequences) {
  std::mt19937 rng(7);
  auto random_seq = [&] {
    std::vector<int32_t> v(1 + rng() % 24);
    for (auto& t : v) t = static_cast<int32_t>(rng() % 3);
    return v;
  };
  const auto lcp = [](const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
    size_t c = 0;
    while (c < a.size() && c < b.size() && a[c] == b[c]) ++c;
    return static_cast<int32_t>(c);
  };
  PrefixTracker all(1 << 20), small(40);
  std::map<std::string, std::vector<std::vector<int32_t>>> inserted;
  for (int i = 0; i < 300; ++i) {
    const std::string salt = rng() % 4 == 0 ? "s" : "";
    const auto seq = random_seq();
    all.insert(salt, seq);
    small.insert(salt, seq);
    inserted[salt].push_back(seq);
    EXPECT_LE(small.size(), 40);
    for (int k = 0; k < 5; ++k) {
      const std::string qs = rng() % 4 == 0 ? "s" : "";
      const auto q = random_seq();
      int32_t want = 0;
      for (const auto& x : inserted[qs]) want = std::max(want, lcp(x, q));
      ASSERT_EQ(all.match(qs, q), want) << i << " " << k;
      ASSERT_LE(small.match(qs, q), want);
    }
  }
  std::map<std::string, std::set<std::vector<int32_t>>> prefixes;  // every distinct non-empty prefix, per salt
  for (const auto& [salt, seqs] : inserted)
    for (const auto& x : seqs)
      for (size_t n = 1; n <= x.size(); ++n) prefixes[salt].insert(std::vector<int32_t>(x.begin(), x.begin() + n));
  int64_t distinct = 0;
  for (const auto& [salt, set] : prefixes) distinct += static_cast<int64_t>(set.size());
  EXPECT_EQ(all.size(), distinct);
}

// cache_aware's thresholds (SGLang's router flags): how many prompts sharing a cached start of 500 of their 520
// tokens follow it to rank 0 (requests in flight 1 + n there, 1 on rank 1) before one goes to the shortest queue.
TEST(LoadBalancer, CacheAwareThresholdsAreTheFlags) {
  const auto sys = seq(0, 500);
  auto follow = [&](const BalanceThresholds& t) {
    LoadBalancer lb(2, "cache_aware", 100000, t);
    EXPECT_EQ(lb.assign("first", 600, -1, {}, cat(sys, seq(1000, 20))), 0);
    EXPECT_EQ(lb.assign("other", 150, -1, {}, seq(5000, 50)), 1);
    int n = 0;
    while (n < 100 && lb.assign("g" + std::to_string(n), 600, -1, {}, cat(sys, seq(10000 + 100 * n, 20))) == 0) ++n;
    return n;
  };
  EXPECT_EQ(follow({}), 9);                 // balanced while the counts differ by at most 8
  EXPECT_EQ(follow({0.3, 2, 1.5}), 3);      // ... by at most 2
  EXPECT_EQ(follow({0.3, 2, 20.0}), 20);    // ... or the most is at most 20 times the fewest
  EXPECT_EQ(follow({0.96, 8, 1.5}), 9);     // 500 >= 96% of 520
  EXPECT_EQ(follow({0.97, 8, 1.5}), 0);     // 500 < 97% of 520: the shortest queue from the start
  for (const auto& [t, flag] : {std::pair{BalanceThresholds{1.5, 8, 1.5}, "--cache-threshold"},
                                std::pair{BalanceThresholds{-0.1, 8, 1.5}, "--cache-threshold"},
                                std::pair{BalanceThresholds{0.3, -1, 1.5}, "--balance-abs-threshold"},
                                std::pair{BalanceThresholds{0.3, 8, 0.5}, "--balance-rel-threshold"},
                                std::pair{BalanceThresholds{0.3, 8, std::nan("")}, "--balance-rel-threshold"}}) {
    try {
      LoadBalancer bad(2, "cache_aware", 100, t);
      ADD_FAILURE() << flag << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(flag), std::string::npos) << e.what();
    }
  }
}

TEST(LoadBalancer, CacheAwareSendsARequestWhereItsPrefixIs) {
  LoadBalancer lb(2, "cache_aware", 100000);
  const auto sys = seq(0, 500);  // a long shared start
  const auto q1 = cat(sys, seq(1000, 20)), q2 = cat(sys, seq(2000, 20)), other = seq(5000, 50);
  EXPECT_EQ(lb.assign("a", 600, -1, {}, q1), 0);     // nothing cached anywhere: the fewest tokens in flight
  EXPECT_EQ(lb.assign("b", 150, -1, {}, other), 1);  // (rank 1 now)
  // The same start goes where it is cached, though rank 0 is busier.
  EXPECT_EQ(lb.assign("c", 600, -1, {}, q2), 0);
  EXPECT_EQ(lb.tracked_prefix(0, q2), 520);
  EXPECT_EQ(lb.tracked_prefix(1, q2), 0);
  // A cached start under 30% of the prompt (--cache-threshold) does not draw it: the fewest tokens in flight.
  EXPECT_EQ(lb.assign("s", 400, -1, {}, cat(seq(0, 100), seq(7000, 300))), 1);
  // While balanced (requests in flight differing by at most 8) the start keeps drawing its prompts to rank 0;
  // then one goes to the shortest queue, rank 1, which tracks the start from then on.
  for (int k = 0; k < 9; ++k) {
    EXPECT_EQ(lb.assign("g" + std::to_string(k), 600, -1, {}, cat(sys, seq(10000 + 100 * k, 20))), 0) << k;
  }
  EXPECT_EQ(lb.assign("g9", 600, -1, {}, cat(sys, seq(20000, 20))), 1);  // (11 requests against 2)
  EXPECT_EQ(lb.tracked_prefix(1, q1), 500);
  // Both ranks cache the start now: of them, the one with the fewest tokens in flight.
  EXPECT_EQ(lb.assign("h", 600, -1, {}, cat(sys, seq(21000, 20))), 1);
  for (const char* rid : {"a", "b", "s", "g0", "g1", "g2", "g3", "g4", "g5", "g6", "g7", "g8", "g9", "h"})
    EXPECT_GE(lb.release(rid), 0) << rid;
  // A finished request's output counts as cached with its prompt: its next turn follows it.
  auto on = lb.release_on_finish("c", nullptr);
  GenerateOutput o;
  o.new_tokens = {7, 8, 9};
  on(o);
  o.new_tokens = {10};
  o.finished = true;
  on(o);
  EXPECT_EQ(lb.rank_of("c"), -1);
  EXPECT_EQ(lb.tokens_in_flight(), (std::vector<int64_t>{0, 0}));
  const auto turn2 = cat(cat(q2, {7, 8, 9, 10}), seq(4000, 30));
  EXPECT_EQ(lb.tracked_prefix(0, turn2), 524);
  EXPECT_EQ(lb.tracked_prefix(1, turn2), 500);
  EXPECT_EQ(lb.assign("e", 600, -1, {}, turn2), 0);
  lb.release("e");
  // Salts: the same tokens under another salt are not cached anywhere.
  EXPECT_EQ(lb.tracked_prefix(0, q1, "tenant"), 0);
  // A flush forgets everything.
  lb.forget_prefixes();
  EXPECT_EQ(lb.tracked_prefix(0, q1), 0);
  EXPECT_EQ(lb.tracked_prefix(1, turn2), 0);
  // Without a cache, cache_aware is shortest_queue; minimum_tokens is shortest_queue's other name.
  for (const char* m : {"cache_aware", "minimum_tokens"}) {
    LoadBalancer plain(2, m, 0);
    EXPECT_EQ(plain.assign("x", 100, -1, {}, q1), 0);
    EXPECT_EQ(plain.assign("y", 100, -1, {}, q1), 1);
    EXPECT_EQ(plain.assign("z", 10, -1, {}, q1), 0);
    EXPECT_EQ(plain.tracked_prefix(0, q1), 0);
  }
  EXPECT_THROW(LoadBalancer(2, "cache-aware"), Error);
  // choose: the pick without recording it (round_robin's turn moves on); a request pinned to it goes there.
  LoadBalancer rr(3, "round_robin");
  EXPECT_EQ(rr.choose(q1), 0);
  EXPECT_EQ(rr.assign("p", 10, 0), 0);
  EXPECT_EQ(rr.choose(q1), 1);
  EXPECT_EQ(rr.assign("q", 10), 2);
  LoadBalancer ca(2, "cache_aware", 1000);
  EXPECT_EQ(ca.assign("a", 300, -1, {}, q1), 0);
  EXPECT_EQ(ca.choose(q2), 0);  // (the start is cached there)
  EXPECT_EQ(ca.choose(other), 1);
  EXPECT_EQ(ca.tokens_in_flight()[1], 0);
  EXPECT_EQ(ca.tracked_prefix(1, other), 0);
}
