#include "engine/dp_controller.h"

#include "core/error.h"

namespace mlaserve {

DpController::DpController(std::vector<std::unique_ptr<EngineClient>> replicas, const std::string& method)
    : replicas_(std::move(replicas)), balancer_(static_cast<int32_t>(replicas_.size()), method) {
  MLA_CHECK(!replicas_.empty(), "DP controller needs at least one replica");
}

DpController::~DpController() { shutdown(); }

void DpController::submit(GenerateRequest req) {
  MLA_CHECK(req.data_parallel_rank < static_cast<int32_t>(replicas_.size()),
            "data_parallel_rank {} is out of range (dp size {})", req.data_parallel_rank, replicas_.size());
  const int64_t cost = static_cast<int64_t>(req.input_ids.size()) + req.sampling.max_new_tokens;
  const int32_t r = balancer_.assign(req.rid, cost, req.data_parallel_rank, req.follow_rid);
  req.on_output = balancer_.release_on_finish(req.rid, std::move(req.on_output));
  req.data_parallel_rank = -1;  // inside the replica there is one group
  const std::string rid = req.rid;
  try {
    replicas_[static_cast<size_t>(r)]->submit(std::move(req));
  } catch (...) {
    balancer_.release(rid);
    throw;
  }
}

void DpController::abort(const std::string& rid, FinishReason reason) {
  const int32_t r = balancer_.rank_of(rid);
  if (r >= 0) replicas_[static_cast<size_t>(r)]->abort(rid, std::move(reason));
}

std::vector<RankStats> DpController::stats() const {
  std::vector<RankStats> all;
  for (const auto& e : replicas_) {
    auto s = e->stats();
    all.insert(all.end(), s.begin(), s.end());
  }
  return all;
}

bool DpController::flush_cache() {
  bool ok = true;
  for (auto& e : replicas_) ok &= e->flush_cache();
  return ok;
}

void DpController::shutdown() {
  for (auto& e : replicas_) e->shutdown();
}

}  // namespace mlaserve
