#include "engine/load_balancer.h"

#include <algorithm>

#include "core/error.h"

namespace mlaserve {

void check_balance_thresholds(const BalanceThresholds& t) {
  MLA_CHECK(t.cache >= 0.0 && t.cache <= 1.0, "--cache-threshold must be in [0, 1], got {}", t.cache);
  MLA_CHECK(t.abs >= 0, "--balance-abs-threshold must be >= 0, got {}", t.abs);
  MLA_CHECK(t.rel >= 1.0, "--balance-rel-threshold must be >= 1, got {}", t.rel);
}

LoadBalancer::LoadBalancer(int32_t ranks, const std::string& method, int64_t cache_tokens,
                           const BalanceThresholds& thresholds)
    : ranks_(ranks), t_(thresholds), load_(static_cast<size_t>(ranks), 0), requests_(static_cast<size_t>(ranks), 0) {
  check_balance_thresholds(t_);
  if (method == "round_robin") method_ = Method::RoundRobin;
  else if (method == "shortest_queue" || method == "minimum_tokens") method_ = Method::Shortest;
  else if (method == "cache_aware") method_ = Method::CacheAware;
  else
    throw Error(fmt::format(
        "--load-balance-method: expected round_robin, shortest_queue, minimum_tokens or cache_aware, got '{}'",
        method));
  if (method_ == Method::CacheAware && cache_tokens > 0)
    for (int32_t r = 0; r < ranks; ++r) cached_.emplace_back(cache_tokens);
}

int32_t LoadBalancer::assign(const std::string& rid, int64_t tokens, int32_t pinned, const std::string& follow,
                             std::span<const int32_t> prompt, std::string_view salt) {
  std::lock_guard<std::mutex> lk(mu_);
  MLA_CHECK(pinned < ranks_, "data_parallel_rank {} is out of range (dp size {})", pinned, ranks_);
  int32_t r = pinned;
  if (r < 0 && !follow.empty()) {
    if (const auto it = live_.find(follow); it != live_.end()) r = it->second.rank;
    else if (const auto f = recent_.find(follow); f != recent_.end()) r = f->second;
  }
  if (r < 0) r = pick(prompt, salt);
  load_[static_cast<size_t>(r)] += tokens;
  ++requests_[static_cast<size_t>(r)];
  Live& l = live_[rid];
  l.rank = r;
  l.tokens = tokens;
  if (!cached_.empty()) {
    cached_[static_cast<size_t>(r)].insert(salt, prompt);  // (requests placed before it runs find it there)
    l.seq.assign(prompt.begin(), prompt.end());
    l.salt = salt;
  }
  return r;
}

int32_t LoadBalancer::choose(std::span<const int32_t> prompt, std::string_view salt) {
  std::lock_guard<std::mutex> lk(mu_);
  return pick(prompt, salt);
}

int32_t LoadBalancer::pick(std::span<const int32_t> prompt, std::string_view salt) {
  if (method_ == Method::RoundRobin) {
    const int32_t r = next_;
    next_ = (next_ + 1) % ranks_;
    return r;
  }
  const auto n = static_cast<size_t>(ranks_);
  std::vector<int32_t> match(n, 0);
  int32_t best_match = 0;
  if (!cached_.empty())
    for (size_t i = 0; i < n; ++i) best_match = std::max(best_match, match[i] = cached_[i].match(salt, prompt));
  const auto [lo, hi] = std::minmax_element(requests_.begin(), requests_.end());
  const bool balanced = *hi - *lo <= t_.abs || static_cast<double>(*hi) <= t_.rel * static_cast<double>(*lo);
  const bool by_cache = balanced && best_match > 0 &&
                        static_cast<double>(best_match) >= t_.cache * static_cast<double>(prompt.size());
  // by_cache: of the ranks with the longest tracked prefix, the one with the fewest tokens in flight. Else the fewest
  // tokens in flight over all; on a tie the rank tracking fewer tokens (new prefixes spread over the caches). Then the
  // lower rank.
  int32_t r = -1;
  for (size_t i = 0; i < n; ++i) {
    if (by_cache && match[i] < best_match) continue;
    const auto b = static_cast<size_t>(r);
    if (r < 0 || load_[i] < load_[b] ||
        (load_[i] == load_[b] && !cached_.empty() && cached_[i].size() < cached_[b].size()))
      r = static_cast<int32_t>(i);
  }
  return r;
}

int32_t LoadBalancer::release(const std::string& rid) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = live_.find(rid);
  if (it == live_.end()) return -1;
  const int32_t r = it->second.rank;
  load_[static_cast<size_t>(r)] -= it->second.tokens;
  --requests_[static_cast<size_t>(r)];
  if (!cached_.empty()) cached_[static_cast<size_t>(r)].insert(it->second.salt, it->second.seq);
  if (recent_.insert_or_assign(rid, r).second) {
    recent_order_.push_back(rid);
    if (recent_order_.size() > kRecent) {
      recent_.erase(recent_order_.front());
      recent_order_.pop_front();
    }
  }
  live_.erase(it);
  return r;
}

std::function<void(const GenerateOutput&)> LoadBalancer::release_on_finish(
    const std::string& rid, std::function<void(const GenerateOutput&)> user) {
  return [this, rid, user = std::move(user)](const GenerateOutput& o) {
    if (!cached_.empty() && !o.new_tokens.empty()) {
      std::lock_guard<std::mutex> lk(mu_);
      if (const auto it = live_.find(rid); it != live_.end())
        it->second.seq.insert(it->second.seq.end(), o.new_tokens.begin(), o.new_tokens.end());
    }
    if (o.finished) release(rid);
    if (user) user(o);
  };
}

int32_t LoadBalancer::rank_of(const std::string& rid) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = live_.find(rid);
  return it == live_.end() ? -1 : it->second.rank;
}

std::vector<int64_t> LoadBalancer::tokens_in_flight() const {
  std::lock_guard<std::mutex> lk(mu_);
  return load_;
}

int32_t LoadBalancer::tracked_prefix(int32_t rank, std::span<const int32_t> prompt, std::string_view salt) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (cached_.empty() || rank < 0 || rank >= ranks_) return 0;
  return cached_[static_cast<size_t>(rank)].match(salt, prompt);
}

void LoadBalancer::forget_prefixes() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& c : cached_) c.clear();
}

}  // namespace mlaserve
