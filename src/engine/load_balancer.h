// LoadBalancer: picks the DP rank (an attention-DP group or a replica) for each new request.
// round_robin cycles; shortest_queue picks the rank with the fewest tokens in flight (prompt + max_new_tokens of
// every unfinished request), counting tokens rather than requests so long prompts weigh what they cost. A request may
// follow another (live, or among the last kRecent finished) onto its rank, where the prefix cache holds what they
// share. Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>
#include <functional>

#include "engine/engine_api.h"

namespace mlaserve {

class LoadBalancer {
 public:
  LoadBalancer(int32_t ranks, const std::string& method);
  static constexpr size_t kRecent = 4096;
  // Chooses a rank (or takes `pinned` when >= 0, else the rank of the request `follow` when it is live or finished
  // lately) and records the request's cost there.
  int32_t assign(const std::string& rid, int64_t tokens, int32_t pinned = -1, const std::string& follow = {});
  // The request finished: its tokens leave its rank. Returns its rank (-1 if unknown).
  int32_t release(const std::string& rid);
  // Wraps a request's output callback so the request is released when its final output arrives.
  std::function<void(const GenerateOutput&)> release_on_finish(const std::string& rid,
                                                              std::function<void(const GenerateOutput&)> user);
  // Rank holding a live request, or -1.
  int32_t rank_of(const std::string& rid) const;
  std::vector<int64_t> tokens_in_flight() const;

 private:
  int32_t ranks_;
  bool shortest_;
  mutable std::mutex mu_;
  int32_t next_ = 0;
  std::vector<int64_t> load_;
  std::unordered_map<std::string, std::pair<int32_t, int64_t>> live_;
  std::unordered_map<std::string, int32_t> recent_;  // finished requests' ranks (the last kRecent)
  std::deque<std::string> recent_order_;             // oldest first
};

}  // namespace mlaserve
