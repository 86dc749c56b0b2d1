#include "engine/dp_controller.h"

#include <mutex>

#include <fmt/format.h>

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

void DpController::update_weights(WeightUpdate u, std::function<void(const WeightUpdateResult&)> done) {
  update_next(std::make_shared<UpdateChain>(UpdateChain{std::move(u), std::move(done), {}}));
}

void DpController::update_next(std::shared_ptr<UpdateChain> c) {
  const size_t r = c->previous.size();
  if (r == replicas_.size()) {
    c->done(WeightUpdateResult{true, fmt::format("weights updated from {}", c->u.model_path), c->previous[0]});
    return;
  }
  replicas_[r]->update_weights(c->u, [this, c, r](const WeightUpdateResult& res) {
    if (!res.ok) return roll_back(c, fmt::format("replica {}: {}", r, res.message));
    c->previous.push_back(res.previous_model_path);
    update_next(c);
  });
}

void DpController::roll_back(std::shared_ptr<UpdateChain> c, std::string why) {
  if (c->previous.empty()) {
    c->done(WeightUpdateResult{false, why, {}});
    return;
  }
  const size_t r = c->previous.size() - 1;
  WeightUpdate back = c->u;
  back.model_path = c->previous.back();
  back.abort_all_requests = false;
  c->previous.pop_back();
  replicas_[r]->update_weights(back, [this, c, r, why, path = back.model_path](const WeightUpdateResult& res) {
    if (!res.ok) {
      c->done(WeightUpdateResult{
          false, fmt::format("{}; replica {} could not load the weights of {} again: {}", why, r, path, res.message),
          {}});
      return;
    }
    roll_back(c, why);
  });
}

void DpController::pause_generation(PauseMode mode, std::function<void(bool)> done) {
  struct Count {
    std::mutex mu;
    size_t left;
    bool ok = true;
    std::function<void(bool)> done;
  };
  auto c = std::make_shared<Count>();
  c->left = replicas_.size();
  c->done = std::move(done);
  for (auto& e : replicas_)
    e->pause_generation(mode, [c](bool ok) {
      bool last = false;
      {
        std::lock_guard<std::mutex> lk(c->mu);
        c->ok &= ok;
        last = --c->left == 0;
      }
      if (last) c->done(c->ok);
    });
}

void DpController::on_all(
    const std::function<void(EngineClient&, std::function<void(const WeightUpdateResult&)>)>& op,
    std::function<void(const WeightUpdateResult&)> done) {
  struct Count {
    std::mutex mu;
    size_t left = 0;
    WeightUpdateResult result{true, {}, {}};
    std::function<void(const WeightUpdateResult&)> done;
  };
  auto c = std::make_shared<Count>();
  c->left = replicas_.size();
  c->done = std::move(done);
  for (size_t r = 0; r < replicas_.size(); ++r)
    op(*replicas_[r], [c, r](const WeightUpdateResult& res) {
      bool last = false;
      {
        std::lock_guard<std::mutex> lk(c->mu);
        if (c->result.ok && !res.ok)
          c->result = WeightUpdateResult{false, fmt::format("replica {}: {}", r, res.message), {}};
        else if (c->result.ok)
          c->result.message = res.message;
        last = --c->left == 0;
      }
      if (last) c->done(c->result);
    });
}

void DpController::release_memory(std::function<void(const WeightUpdateResult&)> done) {
  on_all([](EngineClient& e, auto cb) { e.release_memory(std::move(cb)); }, std::move(done));
}

void DpController::resume_memory(std::function<void(const WeightUpdateResult&)> done) {
  on_all([](EngineClient& e, auto cb) { e.resume_memory(std::move(cb)); }, std::move(done));
}

void DpController::expert_record(ExpertRecordOp op, std::function<void(const ExpertRecord&)> done) {
  struct Sum {
    std::mutex mu;
    size_t left = 0;
    bool failed = false;
    ExpertRecord result;
    std::function<void(const ExpertRecord&)> done;
  };
  auto c = std::make_shared<Sum>();
  c->left = replicas_.size();
  c->result.ok = true;
  c->done = std::move(done);
  for (size_t r = 0; r < replicas_.size(); ++r)
    replicas_[r]->expert_record(op, [c, r](const ExpertRecord& res) {
      bool last = false;
      {
        std::lock_guard<std::mutex> lk(c->mu);
        if (!res.ok && !c->failed) {
          c->failed = true;
          c->result.ok = false;
          c->result.message = fmt::format("replica {}: {}", r, res.message);
          c->result.counts.clear();
        } else if (res.ok && !c->failed) {
          c->result.num_layers = res.num_layers;
          c->result.num_experts = res.num_experts;
          c->result.recording = res.recording;
          if (c->result.counts.size() < res.counts.size()) c->result.counts.resize(res.counts.size(), 0);
          for (size_t i = 0; i < res.counts.size(); ++i) c->result.counts[i] += res.counts[i];
        }
        last = --c->left == 0;
      }
      if (last) c->done(c->result);
    });
}

void DpController::profile(const ProfileRequest& req, std::function<void(const ProfileResult&)> done) {
  struct Gather {
    std::mutex mu;
    size_t left = 0;
    ProfileResult result;
    std::function<void(const ProfileResult&)> done;
  };
  auto c = std::make_shared<Gather>();
  c->left = replicas_.size();
  c->result.ok = true;
  c->done = std::move(done);
  for (size_t r = 0; r < replicas_.size(); ++r) {
    ProfileRequest one = req;
    one.tag = (req.tag.empty() ? "" : req.tag + "-") + "replica" + std::to_string(r);
    replicas_[r]->profile(one, [c, r](const ProfileResult& res) {
      bool last = false;
      {
        std::lock_guard<std::mutex> lk(c->mu);
        if (!res.ok && c->result.ok) {
          c->result.ok = false;
          c->result.message = fmt::format("replica {}: {}", r, res.message);
        } else if (c->result.ok) {
          c->result.message = res.message;
        }
        c->result.paths.insert(c->result.paths.end(), res.paths.begin(), res.paths.end());
        last = --c->left == 0;
      }
      if (last) c->done(c->result);
    });
  }
}

bool DpController::continue_generation() {
  bool ok = true;
  for (auto& e : replicas_) ok &= e->continue_generation();
  return ok;
}

bool DpController::is_paused() const {
  for (const auto& e : replicas_)
    if (e->is_paused()) return true;
  return false;
}

void DpController::shutdown() {
  for (auto& e : replicas_) e->shutdown();
}

}  // namespace mlaserve
