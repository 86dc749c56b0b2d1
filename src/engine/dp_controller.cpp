#include "engine/dp_controller.h"

#include <mutex>

#include <fmt/format.h>

#include "core/error.h"

namespace mlaserve {

DpController::DpController(std::vector<std::unique_ptr<EngineClient>> replicas, const std::string& method,
                           int64_t cache_tokens, const BalanceThresholds& thresholds)
    : replicas_(std::move(replicas)),
      balancer_(static_cast<int32_t>(replicas_.size()), method, cache_tokens, thresholds) {
  MLA_CHECK(!replicas_.empty(), "DP controller needs at least one replica");
}

DpController::~DpController() { shutdown(); }

void DpController::submit(GenerateRequest req) {
  MLA_CHECK(req.data_parallel_rank < static_cast<int32_t>(replicas_.size()),
            "data_parallel_rank {} is out of range (dp size {})", req.data_parallel_rank, replicas_.size());
  const int64_t cost = static_cast<int64_t>(req.input_ids.size()) + req.sampling.max_new_tokens;
  const int32_t r =
      balancer_.assign(req.rid, cost, req.data_parallel_rank, req.follow_rid, req.input_ids, req.cache_salt);
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
  if (ok) balancer_.forget_prefixes();
  return ok;
}

void DpController::update_weights(WeightUpdate u, std::function<void(const WeightUpdateResult&)> done) {
  if (u.flush_cache) balancer_.forget_prefixes();  // (the replicas flush theirs one after another)
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

namespace {

// Calls every replica at once (call(r, replica, callback)); merge folds replica r's answer into the result (under a
// lock, in the order they come); done gets the result once all answered.
template <class R>
void gather(std::vector<std::unique_ptr<EngineClient>>& replicas, R init,
            const std::function<void(size_t, EngineClient&, std::function<void(const R&)>)>& call,
            std::function<void(R&, size_t, const R&)> merge, std::function<void(const R&)> done) {
  struct State {
    std::mutex mu;
    size_t left = 0;
    R result;
    std::function<void(R&, size_t, const R&)> merge;
    std::function<void(const R&)> done;
  };
  auto st = std::make_shared<State>();
  st->left = replicas.size();
  st->result = std::move(init);
  st->merge = std::move(merge);
  st->done = std::move(done);
  for (size_t r = 0; r < replicas.size(); ++r)
    call(r, *replicas[r], [st, r](const R& res) {
      bool last = false;
      {
        std::lock_guard<std::mutex> lk(st->mu);
        st->merge(st->result, r, res);
        last = --st->left == 0;
      }
      if (last) st->done(st->result);
    });
}

}  // namespace

void DpController::pause_generation(PauseMode mode, std::function<void(bool)> done) {
  gather<bool>(
      replicas_, true, [mode](size_t, EngineClient& e, std::function<void(const bool&)> cb) {
        e.pause_generation(mode, [cb](bool ok) { cb(ok); });
      },
      [](bool& acc, size_t, const bool& ok) { acc = acc && ok; },
      [done = std::move(done)](const bool& ok) { done(ok); });
}

void DpController::on_all(
    const std::function<void(EngineClient&, std::function<void(const WeightUpdateResult&)>)>& op,
    std::function<void(const WeightUpdateResult&)> done) {
  using R = WeightUpdateResult;
  gather<R>(
      replicas_, R{true, {}, {}}, [&](size_t, EngineClient& e, std::function<void(const R&)> cb) { op(e, cb); },
      [](R& acc, size_t r, const R& res) {
        if (acc.ok && !res.ok) acc = R{false, fmt::format("replica {}: {}", r, res.message), {}};
        else if (acc.ok) acc.message = res.message;
      },
      std::move(done));
}

void DpController::release_memory(std::function<void(const WeightUpdateResult&)> done) {
  balancer_.forget_prefixes();  // (the replicas drop their caches with the memory)
  on_all([](EngineClient& e, auto cb) { e.release_memory(std::move(cb)); }, std::move(done));
}

void DpController::resume_memory(std::function<void(const WeightUpdateResult&)> done) {
  on_all([](EngineClient& e, auto cb) { e.resume_memory(std::move(cb)); }, std::move(done));
}

void DpController::expert_record(ExpertRecordOp op, std::function<void(const ExpertRecord&)> done) {
  ExpertRecord init;
  init.ok = true;
  gather<ExpertRecord>(
      replicas_, std::move(init),
      [op](size_t, EngineClient& e, std::function<void(const ExpertRecord&)> cb) { e.expert_record(op, cb); },
      [](ExpertRecord& acc, size_t r, const ExpertRecord& res) {
        if (!acc.ok) return;  // (the first failure stays)
        if (!res.ok) {
          acc.ok = false;
          acc.message = fmt::format("replica {}: {}", r, res.message);
          acc.counts.clear();
          return;
        }
        acc.num_layers = res.num_layers;
        acc.num_experts = res.num_experts;
        acc.recording = res.recording;
        if (acc.counts.size() < res.counts.size()) acc.counts.resize(res.counts.size(), 0);
        for (size_t i = 0; i < res.counts.size(); ++i) acc.counts[i] += res.counts[i];
      },
      std::move(done));
}

void DpController::get_weights(std::string name, int64_t rows,
                               std::function<void(const std::vector<WeightValues>&)> done) {
  using Parts = std::vector<std::vector<WeightValues>>;
  gather<Parts>(
      replicas_, Parts(replicas_.size()),
      [name, rows](size_t, EngineClient& e, std::function<void(const Parts&)> cb) {
        e.get_weights(name, rows, [cb](const std::vector<WeightValues>& v) { cb(Parts{v}); });
      },
      [](Parts& acc, size_t r, const Parts& res) { acc[r] = res.front(); },
      [done](const Parts& parts) {
        std::vector<WeightValues> all;
        for (const auto& p : parts) all.insert(all.end(), p.begin(), p.end());
        done(all);
      });
}

void DpController::profile(const ProfileRequest& req, std::function<void(const ProfileResult&)> done) {
  ProfileResult init;
  init.ok = true;
  gather<ProfileResult>(
      replicas_, std::move(init),
      [&req](size_t r, EngineClient& e, std::function<void(const ProfileResult&)> cb) {
        ProfileRequest one = req;
        one.tag = (req.tag.empty() ? "" : req.tag + "-") + "replica" + std::to_string(r);
        e.profile(one, cb);
      },
      [](ProfileResult& acc, size_t r, const ProfileResult& res) {
        if (!res.ok && acc.ok) {
          acc.ok = false;
          acc.message = fmt::format("replica {}: {}", r, res.message);
        } else if (acc.ok) {
          acc.message = res.message;
        }
        acc.paths.insert(acc.paths.end(), res.paths.begin(), res.paths.end());
      },
      std::move(done));
}

int32_t DpController::choose_rank(std::span<const int32_t> prompt, std::string_view salt) {
  return balancer_.choose(prompt, salt);
}

void DpController::export_kv(std::vector<int32_t> tokens, std::string salt, int32_t begin, int32_t max_tokens,
                             std::function<void(KvRows)> done, int32_t rank) {
  if (rank >= static_cast<int32_t>(replicas_.size())) {
    KvRows r;
    r.error = fmt::format("KV export: DP rank {} is out of range (dp size {})", rank, replicas_.size());
    done(std::move(r));
    return;
  }
  if (rank >= 0) {
    replicas_[static_cast<size_t>(rank)]->export_kv(std::move(tokens), std::move(salt), begin, max_tokens,
                                                    std::move(done));
    return;
  }
  struct Best {
    int32_t cached = -1;
    size_t replica = 0;
    std::string error;
  };
  gather<Best>(
      replicas_, Best{}, [&](size_t, EngineClient& e, std::function<void(const Best&)> cb) {
        e.export_kv(tokens, salt, 0, 0, [cb](KvRows r) { cb(Best{r.error.empty() ? r.cached : -1, 0, r.error}); });
      },
      [](Best& acc, size_t r, const Best& res) {
        if (res.cached > acc.cached) acc = Best{res.cached, r, {}};
        else if (acc.cached < 0 && acc.error.empty()) acc.error = res.error;
      },
      [this, tokens, salt, begin, max_tokens, done = std::move(done)](const Best& best) {
        if (best.cached < 0) {
          KvRows r;
          r.error = best.error;
          done(std::move(r));
          return;
        }
        replicas_[best.replica]->export_kv(tokens, salt, begin, max_tokens, done);
      });
}

bool DpController::continue_generation() {
  bool ok = true;
  for (auto& e : replicas_) ok &= e->continue_generation();
  return ok;
}

bool DpController::memory_released() const {
  for (const auto& e : replicas_)
    if (e->memory_released()) return true;
  return false;
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
