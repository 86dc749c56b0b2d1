#include "engine/engine.h"

#include <chrono>
#include <cstdlib>

#include "core/log.h"
#include "core/thread_pool.h"

namespace mlaserve {

Engine::Engine(std::unique_ptr<Backend> backend, std::unique_ptr<DeepseekModel> model, const EngineOptions& opts)
    : backend_(std::move(backend)), model_(std::move(model)), opts_(opts) {
  const ModelConfig& cfg = model_->config();
  if (opts_.context_len <= 0) opts_.context_len = cfg.max_position_embeddings;
  MLA_CHECK(opts_.num_pages > 0, "engine: the KV pool has no pages");
  kv_ = std::make_unique<KvCache>(*backend_, cfg, opts_.num_pages, opts_.page_size);
  SchedulerConfig sc;
  sc.page_size = opts_.page_size;
  sc.num_pages = opts_.num_pages;
  sc.max_running_requests = opts_.max_running_requests;
  sc.chunked_prefill_size = opts_.chunked_prefill_size;
  sc.context_len = opts_.context_len;
  sc.enable_radix_cache = opts_.enable_radix_cache;
  sc.eos_token_ids = opts_.eos_token_ids;
  sched_ = std::make_unique<Scheduler>(sc);
  if (const char* e = std::getenv("MLASERVE_CHECK_INTEGRITY"); e && *e && *e != '0') opts_.check_integrity = true;
  publish_stats();
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { shutdown(); }

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) {
      if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
      return;
    }
    stop_ = true;
  }
  cv_.notify_all();
  flush_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Engine::submit(GenerateRequest req) {
  const int64_t V = model_->config().vocab_size;
  for (int32_t id : req.input_ids)
    MLA_CHECK(id >= 0 && id < V, "token id {} is outside the vocabulary [0, {})", id, V);
  sched_->validate(req);  // reads only the immutable config
  {
    std::lock_guard<std::mutex> lk(mu_);
    MLA_CHECK(!stop_, "the engine is shutting down");
    inbox_.push_back(std::move(req));
  }
  cv_.notify_one();
}

void Engine::abort(const std::string& rid, FinishReason reason) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    aborts_.emplace_back(rid, std::move(reason));
  }
  cv_.notify_one();
}

std::vector<RankStats> Engine::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return {published_};
}

bool Engine::flush_cache() {
  std::unique_lock<std::mutex> lk(mu_);
  const int ticket = ++flush_requests_;
  cv_.notify_one();
  flush_cv_.wait(lk, [&] { return flush_done_ >= ticket || stop_; });
  return flush_ok_;
}

void Engine::publish_stats() {
  RankStats s = sched_->stats();
  std::lock_guard<std::mutex> lk(mu_);
  const int64_t steps = published_.forward_steps;
  published_ = s;
  published_.forward_steps = steps;
}

void Engine::loop() {
  for (;;) {
    std::deque<GenerateRequest> in;
    std::deque<std::pair<std::string, FinishReason>> ab;
    int flushes = 0;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait_for(lk, std::chrono::milliseconds(sched_->has_work() ? 0 : 50), [&] {
        return stop_ || !inbox_.empty() || !aborts_.empty() || flush_requests_ > flush_done_ || sched_->has_work();
      });
      if (stop_) break;
      in.swap(inbox_);
      ab.swap(aborts_);
      flushes = flush_requests_ - flush_done_;
    }
    for (auto& r : in) {
      const std::string rid = r.rid;
      auto cb = r.on_output;
      try {
        sched_->add(std::move(r));
      } catch (const Error& e) {
        if (cb) {
          GenerateOutput o;
          o.finished = true;
          o.finish.kind = FinishKind::Abort;
          o.finish.message = e.what();
          cb(o);
        }
      }
    }
    for (auto& [rid, reason] : ab) sched_->abort(rid, reason);
    if (flushes > 0) {
      const bool ok = sched_->flush_cache();
      {
        std::lock_guard<std::mutex> lk(mu_);
        flush_ok_ = ok;
        flush_done_ = flush_requests_;
      }
      flush_cv_.notify_all();
    }
    if (sched_->has_work()) step();
    publish_stats();
  }
  // Shutting down: abort whatever is left so no caller waits forever.
  FinishReason f;
  f.kind = FinishKind::Abort;
  f.message = "server shutting down";
  std::deque<GenerateRequest> in;
  {
    std::lock_guard<std::mutex> lk(mu_);
    in.swap(inbox_);
  }
  for (auto& r : in)
    if (r.on_output) {
      GenerateOutput o;
      o.finished = true;
      o.finish = f;
      r.on_output(o);
    }
  sched_->abort_all(f);
}

void Engine::step() {
  StepPlan plan = sched_->schedule();
  if (plan.empty()) return;
  const int64_t V = model_->config().vocab_size;
  std::vector<SampleResult> sampled;
  try {
    Tensor logits = backend_->to_host_f32(model_->forward(plan.batch, *kv_));
    std::vector<Req*> rows;
    for (const ScheduledSeq& s : plan.seqs)
      if (s.wants_logits) rows.push_back(s.req);
    sampled.resize(rows.size());
    parallel_for(static_cast<int64_t>(rows.size()), 1, [&](int64_t b, int64_t e) {
      std::vector<float> scratch;
      for (int64_t i = b; i < e; ++i)
        sampled[i] = sample_row(logits.data_as<float>() + i * V, V, rows[i]->sampling, rows[i]->sampler, scratch);
    });
  } catch (const std::exception& e) {
    MLA_LOG_ERROR("forward step failed: {}; aborting its requests", e.what());
    FinishReason f;
    f.kind = FinishKind::Abort;
    f.message = std::string("internal error: ") + e.what();
    std::vector<std::string> rids;
    for (const ScheduledSeq& s : plan.seqs) rids.push_back(s.req->rid);
    for (const auto& rid : rids) sched_->abort(rid, f);
    return;
  }
  sched_->commit(plan, sampled);
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++published_.forward_steps;
  }
  if (opts_.check_integrity) sched_->check_integrity();
}

}  // namespace mlaserve
