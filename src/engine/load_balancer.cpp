#include "engine/load_balancer.h"

#include "core/error.h"

namespace mlaserve {

LoadBalancer::LoadBalancer(int32_t ranks, const std::string& method)
    : ranks_(ranks), shortest_(method == "shortest_queue"), load_(static_cast<size_t>(ranks), 0) {
  MLA_CHECK(method == "round_robin" || method == "shortest_queue",
            "--load-balance-method: expected round_robin or shortest_queue, got '{}'", method);
}

int32_t LoadBalancer::assign(const std::string& rid, int64_t tokens, int32_t pinned, const std::string& follow) {
  std::lock_guard<std::mutex> lk(mu_);
  MLA_CHECK(pinned < ranks_, "data_parallel_rank {} is out of range (dp size {})", pinned, ranks_);
  int32_t r = pinned;
  if (r < 0 && !follow.empty()) {
    if (const auto it = live_.find(follow); it != live_.end()) r = it->second.first;
    else if (const auto f = recent_.find(follow); f != recent_.end()) r = f->second;
  }
  if (r < 0) {
    if (shortest_) {
      r = 0;
      for (int32_t i = 1; i < ranks_; ++i)
        if (load_[static_cast<size_t>(i)] < load_[static_cast<size_t>(r)]) r = i;
    } else {
      r = next_;
      next_ = (next_ + 1) % ranks_;
    }
  }
  load_[static_cast<size_t>(r)] += tokens;
  live_[rid] = {r, tokens};
  return r;
}

int32_t LoadBalancer::release(const std::string& rid) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = live_.find(rid);
  if (it == live_.end()) return -1;
  const int32_t r = it->second.first;
  load_[static_cast<size_t>(r)] -= it->second.second;
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
    if (o.finished) release(rid);
    if (user) user(o);
  };
}

int32_t LoadBalancer::rank_of(const std::string& rid) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = live_.find(rid);
  return it == live_.end() ? -1 : it->second.first;
}

std::vector<int64_t> LoadBalancer::tokens_in_flight() const {
  std::lock_guard<std::mutex> lk(mu_);
  return load_;
}

}  // namespace mlaserve
