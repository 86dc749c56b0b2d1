#include "engine/rank_set.h"

#include "backend/backend_factory.h"
#include "core/log.h"
#include "parallel/inprocess_communicator.h"

namespace mlaserve {

RankSet::RankSet(const ModelConfig& config, const ParallelConfig& pc, const std::string& model_dir, const LoadOptions& lo)
    : config_(config), pc_(pc) {
  const int32_t n = pc_.tp_size, d = pc_.dp_size;
  MLA_CHECK(n >= 1, "--tp must be >= 1, got {}", n);
  MLA_CHECK(d >= 1 && n % d == 0, "--dp {} must divide --tp {} with --enable-dp-attention", d, n);
  const int32_t attn_tp = n / d;
  ranks_.resize(static_cast<size_t>(n));
  // Communicators: the world, and one attention-TP group per DP group.
  std::vector<std::unique_ptr<InProcessCommunicator>> world;
  if (n > 1) {
    world = make_inprocess_communicators(n);
    auto* g = &world[0]->group();
    abort_groups_.push_back([g] { g->abort("another rank failed"); });
  }
  std::vector<std::vector<std::unique_ptr<InProcessCommunicator>>> attn(static_cast<size_t>(d));
  if (attn_tp > 1 && d > 1) {
    for (int32_t g = 0; g < d; ++g) {
      attn[static_cast<size_t>(g)] = make_inprocess_communicators(attn_tp);
      auto* grp = &attn[static_cast<size_t>(g)][0]->group();
      abort_groups_.push_back([grp] { grp->abort("another rank failed"); });
    }
  }
  for (int32_t r = 0; r < n; ++r) {
    auto rk = std::make_unique<Rank>();
    rk->backend = make_backend(pc_.device);
    MLA_CHECK(rk->backend->device() == Device::CPU || n == 1,
              "multi-rank layouts on GPUs need the NCCL communicator (not in this build yet)");
    if (n > 1) rk->world = std::move(world[static_cast<size_t>(r)]);
    if (attn_tp > 1 && d > 1) rk->attn = std::move(attn[static_cast<size_t>(r / attn_tp)][static_cast<size_t>(r % attn_tp)]);
    ranks_[static_cast<size_t>(r)] = std::move(rk);
  }
  // Load every rank's shard (in parallel: each rank reads its slices of the mapped checkpoint).
  try {
    run_on_all([&](int r) {
      Rank& rk = *ranks_[static_cast<size_t>(r)];
      ParallelPlan plan = ParallelPlan::make(n, d, r);
      Communicator* attn_comm = d > 1 ? rk.attn.get() : rk.world.get();
      rk.model = std::make_unique<DeepseekModel>(config_, *rk.backend, plan, rk.world.get(), attn_comm);
      rk.model->load(model_dir, lo);
    });
  } catch (...) {
    stop_workers();
    throw;
  }
}

RankSet::~RankSet() { stop_workers(); }

void RankSet::stop_workers() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& r : ranks_)
    if (r && r->thread.joinable()) r->thread.join();
}

int64_t RankSet::weight_bytes_per_rank() const { return ranks_[0]->model ? ranks_[0]->model->weight_bytes() : 0; }

void RankSet::worker(int rank) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    std::string err;
    try {
      (*job)(rank);
    } catch (const std::exception& e) {
      err = e.what();
      for (auto& a : abort_groups_) a();
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!err.empty()) errors_.push_back(fmt::format("rank {}: {}", rank, err));
      --pending_;
    }
    done_cv_.notify_all();
  }
}

void RankSet::run_on_all(const std::function<void(int)>& fn) {
  if (ranks_.size() == 1) {
    fn(0);
    return;
  }
  if (!ranks_[0]->thread.joinable())
    for (size_t r = 0; r < ranks_.size(); ++r) ranks_[r]->thread = std::thread([this, r] { worker(static_cast<int>(r)); });
  std::unique_lock<std::mutex> lk(mu_);
  job_ = &fn;
  pending_ = static_cast<int>(ranks_.size());
  errors_.clear();
  ++generation_;
  cv_.notify_all();
  done_cv_.wait(lk, [&] { return pending_ == 0; });
  job_ = nullptr;
  if (!errors_.empty()) {
    std::string all;
    for (const auto& e : errors_) all += (all.empty() ? "" : "; ") + e;
    fail("{}", all);
  }
}

void RankSet::allocate_kv(int32_t num_pages, int32_t page_size) {
  for (auto& r : ranks_) r->kv = std::make_unique<KvCache>(*r->backend, config_, num_pages, page_size);
}

std::vector<Tensor> RankSet::step(const std::vector<const ForwardBatch*>& batches, MlaForm form) {
  const int32_t d = pc_.dp_size, attn_tp = pc_.tp_size / pc_.dp_size;
  MLA_CHECK(static_cast<int32_t>(batches.size()) == d, "step: {} batches for {} DP groups", batches.size(), d);
  DpStepInfo info;
  bool any = false;
  for (const ForwardBatch* b : batches) {
    info.num_tokens.push_back(b ? b->num_tokens() : 0);
    any |= b && b->num_tokens() > 0;
  }
  std::vector<Tensor> out(static_cast<size_t>(d));
  if (!any) return out;  // every group idle: no forward at all
  ForwardBatch idle;
  idle.page_size = 1;
  idle.seq_q_start = {0};
  run_on_all([&](int r) {
    const int32_t g = r / attn_tp;
    Rank& rk = *ranks_[static_cast<size_t>(r)];
    const ForwardBatch& b = batches[static_cast<size_t>(g)] ? *batches[static_cast<size_t>(g)] : idle;
    Tensor logits = rk.model->forward(b, *rk.kv, form, d > 1 ? &info : nullptr);
    if (r % attn_tp == 0) out[static_cast<size_t>(g)] = rk.backend->to_host_f32(logits);
  });
  return out;
}

}  // namespace mlaserve
