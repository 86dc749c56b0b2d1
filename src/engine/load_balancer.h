// LoadBalancer: picks the DP rank (an attention-DP group or a replica) for each new request.
// round_robin cycles; shortest_queue (or minimum_tokens, the same) picks the rank with the fewest tokens in flight
// (prompt + max_new_tokens of every unfinished request), counting tokens rather than requests so long prompts weigh
// what they cost. cache_aware (the policy of SGLang's router, here inside the server): while the ranks are balanced
// (their requests in flight differ by at most BalanceThresholds::abs, or the most is at most `rel` times the fewest)
// and a rank probably caches at least `cache` of the prompt, the request goes to the rank caching the longest prefix
// of it (of several, the one with the fewest tokens in flight); else as shortest_queue, a tie going to the rank that
// tracks fewer tokens. What a rank caches is tracked approximately, a PrefixTracker per rank. A request may follow
// another (live, or among the last kRecent finished) onto its rank, where the prefix cache holds what they share.
// Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/engine_api.h"
#include "engine/prefix_tracker.h"

namespace mlaserve {

// An error naming the flag unless the thresholds are in range (NaN is not).
void check_balance_thresholds(const BalanceThresholds& t);

class LoadBalancer {
 public:
  // `cache_tokens`: how many tokens one rank's prefix cache holds (cache_aware tracks that many per rank; 0: the
  // ranks cache nothing, and cache_aware is shortest_queue). Bad thresholds: an error naming the flag.
  LoadBalancer(int32_t ranks, const std::string& method, int64_t cache_tokens = 0,
               const BalanceThresholds& thresholds = {});
  static constexpr size_t kRecent = 4096;
  // Chooses a rank (or takes `pinned` when >= 0, else the rank of the request `follow` when it is live or finished
  // lately) and records the request's cost (`tokens`) there. `prompt` / `salt`: its prompt's tokens and cache salt,
  // for cache_aware.
  int32_t assign(const std::string& rid, int64_t tokens, int32_t pinned = -1, const std::string& follow = {},
                 std::span<const int32_t> prompt = {}, std::string_view salt = {});
  // The rank the policy picks for a request with this prompt now (records nothing; round_robin's turn moves on). A
  // request then assigned with it pinned goes there.
  int32_t choose(std::span<const int32_t> prompt, std::string_view salt = {});
  // The request finished: its tokens leave its rank. Returns its rank (-1 if unknown).
  int32_t release(const std::string& rid);
  // Wraps a request's output callback so the request is released when its final output arrives (and, for
  // cache_aware, its output is tracked as cached with its prompt).
  std::function<void(const GenerateOutput&)> release_on_finish(const std::string& rid,
                                                              std::function<void(const GenerateOutput&)> user);
  // Rank holding a live request, or -1.
  int32_t rank_of(const std::string& rid) const;
  std::vector<int64_t> tokens_in_flight() const;
  // cache_aware: the tokens of `prompt` tracked as cached on `rank`.
  int32_t tracked_prefix(int32_t rank, std::span<const int32_t> prompt, std::string_view salt = {}) const;
  // The ranks' prefix caches were emptied (a flush): nothing is tracked as cached any more.
  void forget_prefixes();

 private:
  enum class Method { RoundRobin, Shortest, CacheAware };
  int32_t pick(std::span<const int32_t> prompt, std::string_view salt);  // (mu_ held)
  struct Live {
    int32_t rank = 0;
    int64_t tokens = 0;
    std::vector<int32_t> seq;  // cache_aware: the prompt, then what has been generated
    std::string salt;
  };
  int32_t ranks_;
  Method method_;
  BalanceThresholds t_;
  mutable std::mutex mu_;
  int32_t next_ = 0;
  std::vector<int64_t> load_;
  std::vector<int64_t> requests_;  // in flight, per rank
  std::vector<PrefixTracker> cached_;  // cache_aware: per rank
  std::unordered_map<std::string, Live> live_;
  std::unordered_map<std::string, int32_t> recent_;  // finished requests' ranks (the last kRecent)
  std::deque<std::string> recent_order_;             // oldest first
};

}  // namespace mlaserve
