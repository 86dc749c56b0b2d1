#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "core/buffer_pool.h"
#include "core/log.h"

namespace mlaserve {

namespace {
double ms_since(PhaseClock::time_point t) {
  return std::chrono::duration<double, std::milli>(PhaseClock::now() - t).count();
}
// Tells the client of a request that never reached a scheduler that it ended (aborted, refused, shut down).
void end_unscheduled(const std::function<void(const GenerateOutput&)>& on_output, const FinishReason& f) {
  if (!on_output) return;
  GenerateOutput o;
  o.finished = true;
  o.finish = f;
  on_output(o);
}
}  // namespace

Engine::Engine(std::unique_ptr<RankSet> ranks, const EngineOptions& opts)
    : ranks_(std::move(ranks)), opts_(opts), balancer_(ranks_->dp_groups(), opts.load_balance_method,
                opts.enable_radix_cache && ranks_->dp_groups() > 1
                    ? (int64_t{opts.num_pages} + opts.host_pages) * opts.page_size
                    : 0,
                opts.balance) {  // (one group: nothing to choose between, nothing tracked)
  const ModelConfig& cfg = ranks_->config();
  if (opts_.context_len <= 0) opts_.context_len = cfg.max_position_embeddings;
  MLA_CHECK(opts_.num_pages > 0, "engine: the KV pool has no pages");
  MLA_CHECK(opts_.host_pages == 0 || opts_.enable_radix_cache,
            "the hierarchical cache keeps the prefix cache's pages: it needs the prefix cache "
            "(no --disable-radix-cache)");
  ranks_->allocate_kv(opts_.num_pages, opts_.page_size, opts_.host_pages);
  SchedulerConfig sc;
  sc.page_size = opts_.page_size;
  sc.num_pages = opts_.num_pages;
  sc.max_running_requests = opts_.max_running_requests;
  sc.chunked_prefill_size = opts_.chunked_prefill_size;
  sc.context_len = opts_.context_len;
  sc.priority_scheduling = opts_.priority_scheduling;
  sc.longest_prefix_first = opts_.longest_prefix_first;
  sc.priority_preemption = opts_.priority_preemption;
  sc.priority_preemption_threshold = opts_.priority_preemption_threshold;
  sc.spec_draft_tokens = opts_.spec_draft_tokens;
  sc.spec_ngram_min = opts_.spec_ngram_min;
  sc.spec_ngram_max = opts_.spec_ngram_max;
  sc.spec_max_batch = opts_.spec_max_batch;
  sc.spec_model_drafts = ranks_->config().mtp_layers > 0;
  MLA_CHECK(!sc.spec_model_drafts || (opts_.spec_draft_tokens >= 1 && opts_.spec_draft_tokens <= kMaxMtpChain),
            "speculative decoding with the MTP layer drafts 1 to {} tokens per step, not {}", kMaxMtpChain,
            opts_.spec_draft_tokens);
  MLA_CHECK(opts_.spec_draft_tokens >= 0 && opts_.spec_ngram_min >= 1 && opts_.spec_ngram_max >= opts_.spec_ngram_min,
            "speculative decoding: draft tokens {} must be >= 0 and the n-gram sizes 1 <= {} <= {}",
            opts_.spec_draft_tokens, opts_.spec_ngram_min, opts_.spec_ngram_max);
  sc.enable_radix_cache = opts_.enable_radix_cache;
  sc.host_pages = opts_.host_pages;
  sc.eos_token_ids = opts_.eos_token_ids;
  for (int32_t g = 0; g < ranks_->dp_groups(); ++g) scheds_.push_back(std::make_unique<Scheduler>(sc));
  if (const char* e = std::getenv("MLASERVE_CHECK_INTEGRITY"); e && *e && *e != '0') opts_.check_integrity = true;
  if (const char* e = std::getenv("MLASERVE_ENGINE_STATS"); e && *e && *e != '0') phase_stats_ = true;
  published_.resize(scheds_.size());
  publish_stats();
  recording_ = opts_.record_experts && ranks_->counts_experts();
  out_thread_ = std::thread([this] { output_loop(); });
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { shutdown(); }

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!stop_) stop_ = true;
  }
  cv_.notify_all();
  flush_cv_.notify_all();
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
  // The step loop has queued its last outputs (aborts included): deliver them, then stop.
  {
    std::lock_guard<std::mutex> lk(out_mu_);
    out_stop_ = true;
  }
  out_cv_.notify_all();
  if (out_thread_.joinable() && std::this_thread::get_id() != out_thread_.get_id()) out_thread_.join();
}

void Engine::output_loop() {
  for (;;) {
    OutputBatch batch;
    {
      std::unique_lock<std::mutex> lk(out_mu_);
      out_cv_.wait(lk, [&] { return out_stop_ || !out_queue_.empty(); });
      if (out_queue_.empty()) return;  // stopping, nothing left
      batch = std::move(out_queue_.front());
      out_queue_.pop_front();
    }
    for (auto& [cb, o] : batch) cb(o);
  }
}

void Engine::submit(GenerateRequest req) {
  const int64_t V = ranks_->config().vocab_size;
  for (int32_t id : req.input_ids)
    MLA_CHECK(id >= 0 && id < V, "token id {} is outside the vocabulary [0, {})", id, V);
  const SamplingParams& sp = req.sampling;
  std::vector<int32_t> biased;
  biased.reserve(sp.logit_bias.size());
  for (const auto& [id, bias] : sp.logit_bias) {
    MLA_CHECK(id >= 0 && id < V, "logit_bias: token id {} is outside the vocabulary [0, {})", id, V);
    MLA_CHECK(std::isfinite(bias), "logit_bias: the bias of token {} is not a finite number", id);
    biased.push_back(id);
  }
  std::sort(biased.begin(), biased.end());
  const auto twice = std::adjacent_find(biased.begin(), biased.end());
  MLA_CHECK(twice == biased.end(), "logit_bias: token id {} appears twice", twice == biased.end() ? 0 : *twice);
  for (int32_t id : sp.token_ids_logprob)
    MLA_CHECK(id >= 0 && id < V, "token_ids_logprob: token id {} is outside the vocabulary [0, {})", id, V);
  if (sp.thinking_budget >= 0) {
    MLA_CHECK(!sp.think_start_ids.empty() && !sp.think_end_ids.empty(),
              "thinking_budget: the thinking section's start and end tokens are not given");
    for (const auto* ids : {&sp.think_start_ids, &sp.think_end_ids})
      for (int32_t id : *ids)
        MLA_CHECK(id >= 0 && id < V, "thinking_budget: token id {} is outside the vocabulary [0, {})", id, V);
  }
  for (int32_t id : sp.allowed_token_ids)
    MLA_CHECK(id >= 0 && id < V, "allowed_token_ids: token id {} is outside the vocabulary [0, {})", id, V);
  for (const auto& word : sp.bad_words_ids) {
    MLA_CHECK(!word.empty(), "bad_words: a bad word has no tokens");
    for (int32_t id : word)
      MLA_CHECK(id >= 0 && id < V, "bad_words: token id {} is outside the vocabulary [0, {})", id, V);
  }
  MLA_CHECK(sp.min_new_tokens >= 0 && sp.min_new_tokens <= sp.max_new_tokens,
            "min_new_tokens ({}) must be between 0 and max_new_tokens ({})", sp.min_new_tokens, sp.max_new_tokens);
  MLA_CHECK(!sp.return_routed_experts || ranks_->captures_routes(),
            "return_routed_experts needs the server started with --enable-return-routed-experts");
  scheds_[0]->validate(req);  // reads only the immutable config
  MLA_CHECK(req.data_parallel_rank < ranks_->dp_groups(), "data_parallel_rank {} is out of range (dp size {})",
            req.data_parallel_rank, ranks_->dp_groups());
  const int64_t cost = static_cast<int64_t>(req.input_ids.size()) + req.sampling.max_new_tokens;
  const int32_t group =
      balancer_.assign(req.rid, cost, req.data_parallel_rank, req.follow_rid, req.input_ids, req.cache_salt);
  req.on_output = [this, cb = balancer_.release_on_finish(req.rid, std::move(req.on_output))](const GenerateOutput& o) {
    deferred_.emplace_back(cb, o);  // called on the engine thread; delivered after publish_stats()
  };
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) {
      balancer_.release(req.rid);
      fail("the engine is shutting down");
    }
    inbox_.emplace_back(group, std::move(req));
  }
  cv_.notify_one();
}

int32_t Engine::choose_rank(std::span<const int32_t> prompt, std::string_view salt) {
  return ranks_->dp_groups() > 1 ? balancer_.choose(prompt, salt) : -1;
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
  return published_;
}

bool Engine::queue_update(PendingUpdate p) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return false;
    p.ahead = inbox_.size();
    updates_.push_back(std::move(p));
  }
  cv_.notify_one();
  return true;
}

void Engine::update_weights(WeightUpdate u, std::function<void(const WeightUpdateResult&)> done) {
  MLA_CHECK(!u.model_path.empty(), "a weight update needs the checkpoint's folder");
  PendingUpdate p;
  p.u = std::move(u);
  p.done = done;
  if (!queue_update(std::move(p))) done(WeightUpdateResult{false, "the server is shutting down", {}});
}

void Engine::release_memory(std::function<void(const WeightUpdateResult&)> done) {
  PendingUpdate p;
  p.done = done;
  p.job = Job::Release;
  if (!queue_update(std::move(p))) done(WeightUpdateResult{false, "the server is shutting down", {}});
}

void Engine::resume_memory(std::function<void(const WeightUpdateResult&)> done) {
  PendingUpdate p;
  p.done = done;
  p.job = Job::Resume;
  if (!queue_update(std::move(p))) done(WeightUpdateResult{false, "the server is shutting down", {}});
}

bool Engine::run_update(bool abort_first) {
  if (abort_first) {
    finish_inflight();
    FinishReason f;
    f.kind = FinishKind::Abort;
    f.message = "aborted for a weight update";
    for (auto& s : scheds_) s->abort_all(f);
  }
  if (inflight_) return false;
  bool stopped = false;  // no step runs: requests left wait
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopped = paused_ || released_;
  }
  for (auto& s : scheds_)
    if (s->has_work() && !stopped) return false;
  PendingUpdate job;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Requests submitted before it are admitted first (while no step runs they wait in the inbox behind it).
    if (updates_.front().ahead > 0 && !stopped) return false;
    job = std::move(updates_.front());
    updates_.pop_front();
  }
  WeightUpdateResult res;
  try {
    res = run_job(job);
  } catch (const std::exception& e) {
    res.ok = false;
    res.message = e.what();
  }
  publish_stats();
  job.done(res);
  return true;
}

WeightUpdateResult Engine::run_job(const PendingUpdate& job) {
  WeightUpdateResult res;
  res.previous_model_path = ranks_->model_dir();
  switch (job.job) {
    case Job::Weights:
      ranks_->reload_weights(job.u.model_path);
      if (job.u.flush_cache) flush_caches();
      res.message = fmt::format("weights updated from {}", job.u.model_path);
      break;
    case Job::Release: {
      int32_t held = 0;
      for (auto& s : scheds_) held += s->num_running();
      MLA_CHECK(held == 0, "{} requests are paused in place with their KV cache: pause with mode retract or abort "
                "before releasing the memory", held);
      if (recording_) recorded_ = recorded_counts(false);  // (the device's counts go with the memory)
      ranks_->release_memory();
      flush_caches();  // (its pages' contents go with the memory)
      {
        std::lock_guard<std::mutex> lk(mu_);
        released_ = true;
      }
      res.message = "released the weights' and the KV cache's memory";
      break;
    }
    case Job::Resume: {
      ranks_->resume_memory();
      {
        std::lock_guard<std::mutex> lk(mu_);
        released_ = false;
      }
      if (ranks_->counts_experts()) ranks_->reset_expert_counts();  // (recorded_ holds what came before)
      res.message = fmt::format("took the memory again; weights of {} loaded again", ranks_->model_dir());
      break;
    }
  }
  res.ok = true;
  return res;
}

bool Engine::queue_control(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return false;
    controls_.push_back(std::move(job));
  }
  cv_.notify_one();
  return true;
}

void Engine::expert_record(ExpertRecordOp op, std::function<void(const ExpertRecord&)> done) {
  if (queue_control([this, op, done] { done(run_record(op)); })) return;
  ExpertRecord r;
  r.message = "the server is shutting down";
  done(r);
}

void Engine::get_weights(std::string name, int64_t rows,
                         std::function<void(const std::vector<WeightValues>&)> done) {
  auto job = [this, name = std::move(name), rows, done] {
    WeightValues v;
    try {
      finish_inflight();
      auto w = ranks_->read_weight(name, rows);
      if (!w) {
        v.message = fmt::format("the model holds no weight named '{}' (names are the checkpoint's, e.g. "
                                "'model.layers.0.self_attn.o_proj.weight')", name);
      } else {
        v.ok = true;
        v.shape.assign(w->full.begin(), w->full.end());
        v.rows = w->rows;
        v.cols = w->cols;
        v.values = std::move(w->values);
      }
    } catch (const std::exception& e) {
      v.message = e.what();
    }
    done(std::vector<WeightValues>(scheds_.size(), v));
  };
  if (queue_control(std::move(job))) return;
  WeightValues v;
  v.message = "the server is shutting down";
  done({v});
}

void Engine::export_kv(std::vector<int32_t> tokens, std::string salt, int32_t begin, int32_t max_tokens,
                       std::function<void(KvRows)> done, int32_t rank) {
  auto job = [this, tokens = std::move(tokens), salt = std::move(salt), begin, max_tokens, done, rank] {
    KvRows r;
    try {
      r = run_export(tokens, salt, begin, max_tokens, rank);
    } catch (const std::exception& e) {
      r = KvRows{};
      r.error = e.what();
    }
    done(std::move(r));
  };
  if (queue_control(std::move(job))) return;
  KvRows r;
  r.error = "the server is shutting down";
  done(std::move(r));
}

KvRows Engine::run_export(const std::vector<int32_t>& tokens, const std::string& salt, int32_t begin,
                          int32_t max_tokens, int32_t only_group) {
  MLA_CHECK(begin >= 0 && max_tokens >= 0, "KV export: begin ({}) and max_tokens ({}) must be >= 0", begin,
            max_tokens);
  MLA_CHECK(only_group < static_cast<int32_t>(scheds_.size()), "KV export: DP rank {} is out of range (dp size {})",
            only_group, scheds_.size());
  if (max_tokens > 0) finish_inflight();  // (the rows are read; a length alone is read from the tree as it stands)
  KvRows r;
  r.layers = ranks_->kv_layers();
  r.row_bytes = ranks_->kv_row_bytes();
  r.dtype = dtype_name(ranks_->kv_dtype());
  std::vector<int32_t> pages;
  int32_t group = 0;
  for (size_t g = 0; g < scheds_.size(); ++g) {
    if (only_group >= 0 && g != static_cast<size_t>(only_group)) continue;
    std::vector<int32_t> p = scheds_[g]->device_prefix(tokens, salt);
    if (p.size() > pages.size()) {
      pages = std::move(p);
      group = static_cast<int32_t>(g);
    }
  }
  const int32_t P = opts_.page_size;
  r.cached = static_cast<int32_t>(pages.size()) * P;
  r.begin = std::min(begin, r.cached);
  const int64_t token_bytes = std::max<int64_t>(1, r.layers * r.row_bytes);
  const int64_t most = std::max<int64_t>(1, static_cast<int64_t>(kMaxKvExportBytes) / token_bytes);
  r.end = static_cast<int32_t>(std::min({int64_t{r.cached}, int64_t{r.begin} + max_tokens, int64_t{r.begin} + most}));
  if (r.end == r.begin) return r;
  r.offset = kKvExportHeaderRoom;
  const size_t size = r.offset + static_cast<size_t>(r.end - r.begin) * static_cast<size_t>(r.token_bytes());
  r.bytes = BufferPool::global().take_sized(size);  // (an earlier answer's once sent, its bytes not filled again)
  ranks_->read_kv_rows(group, pages, r.begin, r.end - r.begin, r.bytes.data() + r.offset);
  return r;
}

void Engine::import_prefix(int32_t g, GenerateRequest& r) {
  const std::shared_ptr<const KvPrefix> kv = std::move(r.kv_prefix);
  KvRows here;
  here.layers = ranks_->kv_layers();
  here.row_bytes = ranks_->kv_row_bytes();
  here.dtype = dtype_name(ranks_->kv_dtype());
  const auto token_bytes = static_cast<size_t>(here.token_bytes());
  if (kv->empty()) return;
  // The parts' tokens [from, rows), each part where the one before ended (from > 0: the tokens before it were
  // cached here when they were read, so only the rest came).
  const int32_t from = kv->front().begin;
  int32_t rows = from;
  std::string bad;
  for (const KvRows& p : *kv) {
    if (!p.same_layout(here))
      bad = fmt::format("{} layers x {} bytes of {}", p.layers, p.row_bytes, p.dtype);
    else if (p.begin != rows || p.end < p.begin || p.begin < 0)
      bad = fmt::format("tokens [{}, {}) after [{}, {})", p.begin, p.end, from, rows);
    else if (p.offset > p.bytes.size() || p.rows_size() != static_cast<size_t>(p.end - p.begin) * token_bytes)
      bad = fmt::format("{} bytes for tokens [{}, {})", p.bytes.size() - std::min(p.offset, p.bytes.size()), p.begin,
                        p.end);
    if (!bad.empty()) break;
    rows = p.end;
  }
  if (!bad.empty()) {
    MLA_LOG_WARN("request {}: the KV rows handed over ({}) do not fit this cache ({} layers x {} bytes of {}): the "
                 "whole prompt is computed here",
                 r.rid, bad, here.layers, here.row_bytes, here.dtype);
    return;
  }
  const size_t n = std::min(static_cast<size_t>(rows), r.input_ids.size());
  try {
    const int32_t cached = scheds_[static_cast<size_t>(g)]->import_prefix(
        std::span<const int32_t>(r.input_ids).first(n), r.cache_salt,
        [&](std::span<const int32_t> pages, int32_t first) {
          // Token first + i: its rows in the part holding it.
          ranks_->write_kv_rows(g, pages, [&](int64_t i) {
            const int64_t t = first + i;
            const auto part = std::upper_bound(kv->begin(), kv->end(), t,
                                               [](int64_t x, const KvRows& p) { return x < p.end; });
            return part->rows() + static_cast<size_t>(t - part->begin) * token_bytes;
          });
        },
        from);
    if (cached < from)
      MLA_LOG_WARN("request {}: the KV rows handed over start at token {}, but only {} are cached here: the prompt is "
                   "computed here",
                   r.rid, from, cached);
  } catch (const std::exception& e) {
    MLA_LOG_WARN("request {}: the KV rows handed over could not be cached ({}): the prompt is computed here", r.rid,
                 e.what());
  }
}

void Engine::profile(const ProfileRequest& req, std::function<void(const ProfileResult&)> done) {
  if (queue_control([this, req, done] { done(run_profile(req)); })) return;
  ProfileResult r;
  r.message = "the server is shutting down";
  done(r);
}

ProfileResult Engine::run_profile(const ProfileRequest& req) {
  ProfileResult r;
  try {
    if (req.start) {
      MLA_CHECK(!trace_.active(), "a profile is already being recorded: /stop_profile first");
      MLA_CHECK(req.num_steps >= 0, "num_steps must be >= 0, got {}", req.num_steps);
      MLA_CHECK(!req.output_dir.empty(), "profiling needs an output folder");
      ranks_->set_profiler(true);
      trace_.start(req.output_dir, req.num_steps, req.tag);
      r.message = "profiling started";
    } else {
      MLA_CHECK(trace_.active(), "no profile is being recorded: /start_profile first");
      r.paths.push_back(trace_.stop());  // (first: a failing profiler call below keeps the trace)
      ranks_->set_profiler(false);
      r.message = fmt::format("profile of {} steps written", trace_.steps());
    }
    r.ok = true;
  } catch (const std::exception& e) {
    r.ok = false;
    r.message = e.what();
  }
  return r;
}

nlohmann::json Engine::step_args(const std::vector<StepPlan>& plans) const {
  nlohmann::json tokens = nlohmann::json::array(), seqs = nlohmann::json::array();
  bool prefill = false;
  std::vector<const ForwardBatch*> batches;
  for (const StepPlan& p : plans) {
    tokens.push_back(p.empty() ? 0 : p.batch.num_tokens());
    seqs.push_back(p.empty() ? 0 : p.batch.num_seqs());
    prefill |= !p.empty() && p.batch.has_prefill();
    batches.push_back(p.empty() ? nullptr : &p.batch);
  }
  return {{"step", steps_}, {"tokens", std::move(tokens)}, {"sequences", std::move(seqs)}, {"prefill", prefill},
          {"graph_size", ranks_->graph_size_for(batches, MlaForm::Auto)}};
}

void Engine::traced_step(PhaseClock::time_point launched, const nlohmann::json& args) {
  if (!trace_.active()) return;
  trace_.span("step", /*step_track=*/true, launched, PhaseClock::now(), args);
  if (!trace_.step_done()) return;
  try {  // num_steps ran out: the trace is written now (a later /stop_profile finds none running)
    MLA_LOG_INFO("profile of {} steps written to {}", trace_.steps(), trace_.stop());
    ranks_->set_profiler(false);
  } catch (const std::exception& e) {
    MLA_LOG_WARN("profile: {}", e.what());
  }
}

std::vector<int64_t> Engine::recorded_counts(bool released) {
  std::vector<int64_t> c = recorded_;
  if (released) return c;
  const std::vector<int64_t> dev = ranks_->expert_counts();
  if (c.empty()) return dev;
  for (size_t i = 0; i < c.size() && i < dev.size(); ++i) c[i] += dev[i];
  return c;
}

ExpertRecord Engine::run_record(ExpertRecordOp op) {
  const ModelConfig& cfg = ranks_->config();
  ExpertRecord r;
  try {
    MLA_CHECK(ranks_->counts_experts(), "expert distribution recording is off: start the server with "
              "--expert-distribution-recorder-mode stat");
    bool released = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      released = released_;
    }
    // Zeroes the device's counts (they start again from zero after resume_memory when released).
    auto zero_device = [&] {
      if (!released) ranks_->reset_expert_counts();
    };
    switch (op) {
      case ExpertRecordOp::Start:
        if (recording_) MLA_LOG_WARN("expert distribution: already recording; starting again from zero");
        zero_device();
        recorded_.clear();
        recording_ = true;
        break;
      case ExpertRecordOp::Stop:
        if (!recording_) MLA_LOG_WARN("expert distribution: stop without a recording");
        else recorded_ = recorded_counts(released);
        recording_ = false;
        break;
      case ExpertRecordOp::Dump:
        r.counts = recording_ ? recorded_counts(released) : recorded_;
        r.counts.resize(static_cast<size_t>(cfg.num_hidden_layers * cfg.n_routed_experts), 0);
        zero_device();
        recorded_.clear();
        break;
    }
    r.ok = true;
    r.num_layers = cfg.num_hidden_layers;
    r.num_experts = cfg.n_routed_experts;
  } catch (const std::exception& e) {
    r.ok = false;
    r.message = e.what();
    r.counts.clear();
  }
  r.recording = recording_;
  return r;
}

void Engine::pause_generation(PauseMode mode, std::function<void(bool)> done) {
  bool queued = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!stop_) {
      pauses_.push_back(PendingPause{mode, std::move(done), inbox_.size()});
      queued = true;
    }
  }
  if (!queued) return done(false);
  cv_.notify_one();
}

bool Engine::continue_generation() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    paused_ = false;
  }
  cv_.notify_one();
  return true;
}

bool Engine::is_paused() const {
  std::lock_guard<std::mutex> lk(mu_);
  return paused_;
}

bool Engine::memory_released() const {
  std::lock_guard<std::mutex> lk(mu_);
  return released_;
}

void Engine::run_pause() {
  PauseMode mode;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Requests submitted before it are still on their way in (unless no step runs: they wait in the inbox).
    if (pauses_.front().ahead > 0 && !paused_ && !released_) return;
    mode = pauses_.front().mode;
  }
  if (mode == PauseMode::Drain) {
    if (inflight_) return;
    for (auto& s : scheds_)
      if (s->has_work()) return;
  } else {
    finish_inflight();
    if (mode == PauseMode::Abort) {
      FinishReason f;
      f.kind = FinishKind::Abort;
      f.message = "aborted by a pause of the generation";
      for (auto& s : scheds_) s->abort_all(f);
    } else if (mode == PauseMode::Retract) {
      for (auto& s : scheds_) s->retract_all();
    }
  }
  PendingPause job;
  {
    std::lock_guard<std::mutex> lk(mu_);
    job = std::move(pauses_.front());
    pauses_.pop_front();
    paused_ = true;
  }
  publish_stats();
  job.done(true);
}

bool Engine::flush_caches() {
  bool ok = true;
  for (auto& s : scheds_) ok &= s->flush_cache();
  if (ok) balancer_.forget_prefixes();  // (what the load balancer tracks as cached goes with them)
  return ok;
}

bool Engine::flush_cache() {
  std::unique_lock<std::mutex> lk(mu_);
  const int ticket = ++flush_requests_;
  cv_.notify_one();
  flush_cv_.wait(lk, [&] { return flush_done_ >= ticket || stop_; });
  return flush_ok_;
}

void Engine::publish_stats() {
  std::vector<RankStats> s;
  for (auto& sc : scheds_) {
    s.push_back(sc->stats());
    s.back().forward_steps = static_cast<int64_t>(steps_);
    s.back().overlapped_steps = pipelined_steps_;
  }
  std::lock_guard<std::mutex> lk(mu_);
  published_ = std::move(s);
}

void Engine::loop() {
  auto has_work = [&] {
    for (auto& s : scheds_)
      if (s->has_work()) return true;
    return false;
  };
  for (;;) {
    std::deque<std::pair<int32_t, GenerateRequest>> in;
    std::deque<std::pair<std::string, FinishReason>> ab;
    std::vector<std::pair<GenerateRequest, FinishReason>> dropped;  // aborted while waiting in the inbox
    int flushes = 0;
    std::deque<std::function<void()>> controls;
    std::optional<bool> update;  // a weight update waits (its abort_all_requests)
    bool pausing = false, paused = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      const bool busy = (has_work() || inflight_.has_value()) && !paused_ && !released_;
      cv_.wait_for(lk, std::chrono::milliseconds(busy ? 0 : 50), [&] {
        return stop_ || (!inbox_.empty() && !paused_ && !released_) || !aborts_.empty() ||
               flush_requests_ > flush_done_ || !updates_.empty() || !pauses_.empty() || !controls_.empty() || busy;
      });
      if (stop_) break;
      pausing = !pauses_.empty();
      paused = paused_ || released_;
      // Requests submitted after a pending update or pause wait for it; while paused, all do.
      size_t hold = paused ? 0 : inbox_.size();
      if (pausing) hold = std::min(hold, pauses_.front().ahead);
      if (!updates_.empty()) hold = std::min(hold, updates_.front().ahead);
      if (!updates_.empty()) update = updates_.front().u.abort_all_requests;
      const size_t n = std::min(hold, inbox_.size());
      if (n == inbox_.size()) {
        in.swap(inbox_);  // (the usual case: nothing holds requests back)
      } else {
        for (size_t i = 0; i < n; ++i) {
          in.push_back(std::move(inbox_.front()));
          inbox_.pop_front();
        }
      }
      for (PendingUpdate& p : updates_) p.ahead -= std::min(p.ahead, n);
      for (PendingPause& p : pauses_) p.ahead -= std::min(p.ahead, n);
      ab.swap(aborts_);
      controls.swap(controls_);
      // An abort of a request still waiting in the inbox (behind a pause or an update) takes it out there.
      for (auto a = ab.begin(); a != ab.end();) {
        const auto it =
            std::find_if(inbox_.begin(), inbox_.end(), [&](const auto& q) { return q.second.rid == a->first; });
        if (it == inbox_.end()) {
          ++a;
          continue;
        }
        const auto pos = static_cast<size_t>(it - inbox_.begin());
        for (PendingUpdate& p : updates_) p.ahead -= p.ahead > pos ? 1 : 0;
        for (PendingPause& p : pauses_) p.ahead -= p.ahead > pos ? 1 : 0;
        dropped.emplace_back(std::move(it->second), std::move(a->second));
        inbox_.erase(it);
        a = ab.erase(a);
      }
      flushes = flush_requests_ - flush_done_;
    }
    for (auto& [r, reason] : dropped) end_unscheduled(r.on_output, reason);
    bool drained = false;  // KV rows go into the caches with no step in flight
    for (auto& [g, r] : in) {
      if (r.kv_prefix) {
        if (!drained) finish_inflight();
        drained = true;
        import_prefix(g, r);
      }
      auto cb = r.on_output;
      try {
        scheds_[static_cast<size_t>(g)]->add(std::move(r));
      } catch (const Error& e) {
        FinishReason f;
        f.kind = FinishKind::Abort;
        f.message = e.what();
        end_unscheduled(cb, f);
      }
    }
    for (auto& [rid, reason] : ab)
      for (auto& s : scheds_)
        if (s->abort(rid, reason)) break;
    if (flushes > 0) {
      const bool ok = flush_caches();
      publish_stats();  // a caller that sees the flush done must see its effect in the stats
      {
        std::lock_guard<std::mutex> lk(mu_);
        flush_ok_ = ok;
        flush_done_ = flush_requests_;
      }
      flush_cv_.notify_all();
    }
    if (pausing) run_pause();
    if (update) run_update(*update);
    for (auto& job : controls) job();
    {
      std::lock_guard<std::mutex> lk(mu_);
      paused = paused_ || released_;
    }
    const auto t0 = PhaseClock::now();
    const bool stepped = !paused && (opts_.overlap ? (has_work() || inflight_) : has_work());
    if (opts_.overlap) {
      if (stepped) overlap_step();
    } else if (stepped) {
      step();
    }
    for (auto& sc : scheds_) sc->erase_finished();
    publish_stats();
    const auto t1 = PhaseClock::now();
    deliver_outputs();
    if (phase_stats_ && stepped) {
      phases_.deliver += ms_since(t1);
      phases_.total += ms_since(t0);
      ++phases_.iterations;
    }
  }
  if (phase_stats_ && phases_.iterations > 0)
    MLA_LOG_INFO("engine thread over {} steps, ms per step: schedule {:.3f}, launch {:.3f}, wait for the device "
                 "{:.3f}, resolve {:.3f}, hand outputs over {:.3f}, all {:.3f}",
                 phases_.iterations, phases_.schedule / phases_.iterations, phases_.launch / phases_.iterations,
                 phases_.wait / phases_.iterations, phases_.resolve / phases_.iterations,
                 phases_.deliver / phases_.iterations, phases_.total / phases_.iterations);
  finish_inflight();
  // Shutting down: abort whatever is left so no caller waits forever.
  FinishReason f;
  f.kind = FinishKind::Abort;
  f.message = "server shutting down";
  std::deque<std::pair<int32_t, GenerateRequest>> in;
  std::deque<PendingUpdate> updates;
  {
    std::lock_guard<std::mutex> lk(mu_);
    in.swap(inbox_);
    updates.swap(updates_);
  }
  for (auto& u : updates) u.done(WeightUpdateResult{false, "the server is shutting down", {}});
  std::deque<PendingPause> pauses;
  {
    std::lock_guard<std::mutex> lk(mu_);
    pauses.swap(pauses_);
  }
  for (auto& p : pauses) p.done(false);
  std::deque<std::function<void()>> controls;  // asked for before the stop: run (the ranks are still there)
  {
    std::lock_guard<std::mutex> lk(mu_);
    controls.swap(controls_);
  }
  for (auto& job : controls) job();
  if (trace_.active()) {
    try {
      MLA_LOG_INFO("profile of {} steps written to {}", trace_.steps(), trace_.stop());
    } catch (const std::exception& e) {
      MLA_LOG_WARN("profile: {}", e.what());
    }
  }
  for (auto& [g, r] : in) end_unscheduled(r.on_output, f);
  for (auto& s : scheds_) s->abort_all(f);
  publish_stats();
  deliver_outputs();
}

void Engine::deliver_outputs() {
  if (deferred_.empty()) return;
  {
    std::lock_guard<std::mutex> lk(out_mu_);
    out_queue_.push_back(std::move(deferred_));
  }
  deferred_.clear();
  out_cv_.notify_one();
}

// A draw before min_new_tokens: the request's stop tokens get -inf (an entry of their own or the bias's entry).
// The request's stop tokens: its stop_token_ids, and the EOS ids unless it ignores EOS.
std::vector<int32_t> Engine::stop_tokens(const SamplingParams& sp) const { return sp.stop_tokens(opts_.eos_token_ids); }

void Engine::ban_stop_tokens(const SamplingParams& sp, RowSampling& row) const {
  for (int32_t id : stop_tokens(sp)) ban_token(row, id);
}

// Constrained decoding: the tokens the request's constraint allows in its state (its previous token is back: see
// overlap_step), and its stop tokens where the text may end.
void Engine::constrain(Req& r, RowSampling& row) const {
  MLA_CHECK(r.in_flight == 0, "request {}: a constrained draw with {} tokens in flight", r.rid, r.in_flight);
  TokenConstraint& c = *r.sampling.constraint;
  std::shared_ptr<const std::vector<uint32_t>> mask;
  try {
    mask = c.allowed(r.constraint_state);
  } catch (const std::exception& e) {  // this request alone fails (Scheduler::resolve ends it); the draw is unmasked
    r.constraint_error = e.what();
    return;
  }
  if (c.accepting(r.constraint_state)) {
    const std::vector<int32_t> stops = stop_tokens(r.sampling);
    if (!stops.empty()) {
      auto m = std::make_shared<std::vector<uint32_t>>(*mask);
      for (int32_t id : stops) {
        if (id < 0) continue;
        if (static_cast<size_t>(id / 32) >= m->size()) m->resize(static_cast<size_t>(id / 32) + 1, 0u);
        (*m)[static_cast<size_t>(id / 32)] |= 1u << (id % 32);
      }
      mask = std::move(m);
    }
  }
  row.allowed = std::move(mask);
}

std::vector<std::vector<RowSampling>> Engine::sampling_rows(const std::vector<StepPlan>& plans,
                                                            LogitRows& logit_rows) {
  std::vector<std::vector<RowSampling>> rows(plans.size());
  logit_rows.assign(plans.size(), {});  // only for top-N and prompt logprobs, computed on the host
  for (size_t g = 0; g < plans.size(); ++g)
    for (const ScheduledSeq& s : plans[g].seqs) {
      for (int32_t k = 0; k < s.lp_rows; ++k) {  // prompt logprobs: the logits come to the host, the draw is dropped
        logit_rows[g].push_back(static_cast<int32_t>(rows[g].size()));
        rows[g].emplace_back();  // greedy
      }
      // One row per draw: the decode token's, then one after each draft, drawn as those positions' draws would be
      // without drafts (a seed's draw k is draw k). A request with drafts has none of the treatments below that
      // depend on earlier tokens (Scheduler::may_draft).
      for (int32_t d = 0; d < s.sampled_rows(); ++d) {
        RowSampling row = s.req->sampler.row(s.req->sampling);
        row.step += static_cast<uint64_t>(s.req->in_flight + d);  // draws of tokens in flight, drafts before it
        if (row.step < static_cast<uint64_t>(std::max(s.req->sampling.min_new_tokens, 0)))
          ban_stop_tokens(s.req->sampling, row);
        if (s.req->sampling.constraint) constrain(*s.req, row);
        restrict_to(row, s.req->allowed_mask);  // allowed_token_ids
        if (!s.req->sampling.bad_words_ids.empty()) {
          // Multi-token bad words need the output's end: such a step was planned with no token in flight.
          MLA_CHECK(s.req->in_flight == 0 || !needs_previous_token(s.req->sampling),
                    "request {}: bad words with {} tokens in flight", s.req->rid, s.req->in_flight);
          ban_bad_words(s.req->sampling, s.req->output, row);
        }
        if (const int32_t forced = forced_think_token(*s.req, s.req->in_flight); forced >= 0) {
          MLA_CHECK(s.req->in_flight == 0, "request {}: a forced thinking end with {} tokens in flight", s.req->rid,
                    s.req->in_flight);
          row.allowed = token_mask(std::vector<int32_t>{forced});  // the thinking budget is spent: only its end
          std::erase_if(row.logit_bias, [&](const auto& b) { return b.first == forced; });
        }
        if (s.req->in_flight > 0 && penalised(s.req->sampling)) {
          // The token still in flight is this row's input (an id read on the device): the sampler counts it there.
          const ForwardBatch& b = plans[g].batch;
          const int32_t pos = b.logit_rows[rows[g].size()];
          MLA_CHECK(s.req->in_flight == 1 && b.input_ids[static_cast<size_t>(pos)] < 0,
                    "request {}: {} tokens in flight, input id {}", s.req->rid, s.req->in_flight,
                    b.input_ids[static_cast<size_t>(pos)]);
          row.pending_input = pos;
        }
        if (s.req->sampling.wants_host_logits()) logit_rows[g].push_back(static_cast<int32_t>(rows[g].size()));
        rows[g].push_back(std::move(row));
      }
    }
  return rows;
}

std::vector<std::vector<SampleResult>> Engine::collect(std::vector<StepPlan>& plans, std::vector<GroupOutput>& outs) {
  const int64_t V = ranks_->config().vocab_size;
  std::vector<std::vector<SampleResult>> sampled(plans.size());
  for (size_t g = 0; g < plans.size(); ++g) {
    // (return_hidden_states / return_routed_experts: the scheduler hands them out)
    const ModelConfig& mc = ranks_->config();
    plans[g].hidden = std::move(outs[g].hidden);
    plans[g].hidden_width = static_cast<int32_t>(mc.hidden_size);
    plans[g].routes = std::move(outs[g].routes);
    plans[g].routes_width = static_cast<int32_t>(mc.num_hidden_layers * mc.num_experts_per_tok);
    int64_t i = 0, kept = 0;  // row i; kept: the rows with logits before it (their order in outs[g].logits)
    auto host_logits = [&](int64_t row) {
      MLA_CHECK(kept < (outs[g].logits.defined() ? outs[g].logits.size(0) : 0), "group {}: logits of row {} missing",
                g, row);
      return outs[g].logits.data_as<float>() + kept++ * V;
    };
    for (const ScheduledSeq& s : plans[g].seqs) {
      const SamplingParams& sp = s.req->sampling;
      for (int32_t k = 0; k < s.lp_rows; ++k, ++i) {  // the logprob of the prompt token after each row's position
        const int32_t next = s.req->prompt[static_cast<size_t>(s.lp_first_pos + k + 1)];
        SampleResult r;
        r.logprob = top_logprobs(host_logits(i), V, next, sp.top_logprobs_num, sp.token_ids_logprob);
        sampled[g].push_back(std::move(r));
      }
      for (int32_t k = 0; k < s.sampled_rows(); ++k, ++i) {
        SampleResult r;
        r.token = outs[g].ids[static_cast<size_t>(i)];
        if (!outs[g].drafts.empty()) {  // [rows, width]: the row's drafts until the first missing one
          const size_t w = outs[g].drafts.size() / outs[g].ids.size();
          for (size_t c = 0; c < w && outs[g].drafts[static_cast<size_t>(i) * w + c] >= 0; ++c)
            r.drafts.push_back(outs[g].drafts[static_cast<size_t>(i) * w + c]);
        }
        if (sp.wants_host_logits()) {
          r.logprob = top_logprobs(host_logits(i), V, r.token, sp.top_logprobs_num, sp.token_ids_logprob);
        } else if (sp.return_logprob) {
          r.logprob.token = r.token;
          r.logprob.logprob = outs[g].logprobs[static_cast<size_t>(i)];
        }
        sampled[g].push_back(std::move(r));
      }
    }
  }
  return sampled;
}

void Engine::abort_plans(const std::vector<StepPlan>& plans, const std::string& why) {
  MLA_LOG_ERROR("forward step failed: {}; aborting its requests", why);
  FinishReason f;
  f.kind = FinishKind::Abort;
  f.message = "internal error: " + why;
  for (size_t g = 0; g < plans.size(); ++g) scheds_[g]->fail(plans[g], f);
}

int64_t Engine::hidden_size() const { return ranks_->config().hidden_size; }

void Engine::step() {
  const size_t groups = scheds_.size();
  std::vector<StepPlan> plans(groups);
  std::vector<const ForwardBatch*> batches(groups, nullptr);
  bool any = false;
  const auto t0 = PhaseClock::now();
  for (size_t g = 0; g < groups; ++g) {
    plans[g] = scheds_[g]->schedule();
    if (!plans[g].empty()) {
      batches[g] = &plans[g].batch;
      any = true;
    }
  }
  if (!any) return;
  const auto t1 = PhaseClock::now();
  const bool traced = trace_.active();
  const nlohmann::json args = traced ? step_args(plans) : nlohmann::json();
  if (traced) trace_.span("schedule", false, t0, t1);
  for (size_t g = 0; g < groups; ++g)
    if (!plans[g].empty()) scheds_[g]->take_copies(plans[g]);
  LogitRows logit_rows;
  std::vector<std::vector<SampleResult>> sampled;
  try {
    const auto rows = sampling_rows(plans, logit_rows);  // as in launch(): a failure here ends the step's requests
    std::vector<GroupOutput> outs = ranks_->step(batches, rows, logit_rows);
    if (traced) trace_.span("run on the device", false, t1, PhaseClock::now(), args);
    sampled = collect(plans, outs);
  } catch (const std::exception& e) {
    abort_plans(plans, e.what());
    return;
  }
  for (size_t g = 0; g < groups; ++g)
    if (!plans[g].empty()) scheds_[g]->commit(plans[g], sampled[g]);
  ++steps_;
  traced_step(t1, args);
  if (opts_.check_integrity)
    for (auto& s : scheds_) s->check_integrity();
}

void Engine::finish_inflight() {
  if (!inflight_) return;
  InFlight cur = std::move(*inflight_);
  inflight_.reset();
  try {
    const auto t0 = PhaseClock::now();
    std::vector<GroupOutput> outs = ranks_->finish(cur.launched);
    const auto t1 = PhaseClock::now();
    auto sampled = collect(cur.plans, outs);
    for (size_t g = 0; g < scheds_.size(); ++g)
      if (!cur.plans[g].empty()) scheds_[g]->resolve(cur.plans[g], sampled[g]);
    if (phase_stats_) {
      phases_.wait += std::chrono::duration<double, std::milli>(t1 - t0).count();
      phases_.resolve += ms_since(t1);
    }
    if (trace_.active()) {
      trace_.span("wait for the device", false, t0, t1);
      trace_.span("resolve", false, t1, PhaseClock::now());
      traced_step(cur.launched_at, cur.trace_args);
    }
  } catch (const std::exception& e) {
    abort_plans(cur.plans, e.what());
    for (size_t g = 0; g < scheds_.size(); ++g) scheds_[g]->drop(cur.plans[g]);
  }
}

bool Engine::launch(std::vector<StepPlan> plans) {
  const size_t groups = scheds_.size();
  std::vector<const ForwardBatch*> batches(groups, nullptr);
  for (size_t g = 0; g < groups; ++g)
    if (!plans[g].empty()) {
      scheds_[g]->take_copies(plans[g]);
      batches[g] = &plans[g].batch;
    }
  LogitRows logit_rows;
  InFlight f;
  try {
    const auto rows = sampling_rows(plans, logit_rows);
    const auto t0 = PhaseClock::now();
    f.launched = ranks_->launch(batches, rows, logit_rows);
    if (phase_stats_) phases_.launch += ms_since(t0);
    if (trace_.active()) {
      f.launched_at = t0;
      f.trace_args = step_args(plans);
      trace_.span("launch", false, t0, PhaseClock::now(), f.trace_args);
    }
  } catch (const std::exception& e) {
    abort_plans(plans, e.what());
    return false;
  }
  for (size_t g = 0; g < groups; ++g)
    if (!plans[g].empty()) scheds_[g]->advance(plans[g]);
  f.plans = std::move(plans);
  inflight_ = std::move(f);
  ++steps_;
  return true;
}

void Engine::overlap_step() {
  const size_t groups = scheds_.size();
  // Plan the next step while the current one runs (its requests already advanced: kv lengths, pending tokens).
  const bool running = inflight_.has_value();
  std::vector<StepPlan> next(groups);
  bool blocked = false, any = false;
  const auto t0 = PhaseClock::now();
  for (size_t g = 0; g < groups; ++g) {
    next[g] = scheds_[g]->schedule(/*allow_retract=*/!running);
    blocked |= next[g].blocked;
    any |= !next[g].empty();
  }
  if (phase_stats_) phases_.schedule += ms_since(t0);
  if (any && trace_.active()) trace_.span("schedule", false, t0, PhaseClock::now());
  // A constrained request's draw needs its previous token (its constraint's state; a bad word's earlier tokens):
  // such a step waits for it.
  bool needs_tokens = false;
  for (size_t g = 0; g < groups; ++g)
    for (const ScheduledSeq& s : next[g].seqs)
      needs_tokens |= s.wants_logits && waits_for_previous_token(*s.req);
  if (running && any && !blocked && !needs_tokens) {
    // Launch it behind the running step (its pending tokens are read on the device), then finish the running one:
    // the device never waits for the host between the two.
    std::optional<InFlight> launched = std::exchange(inflight_, std::nullopt);
    if (launch(std::move(next))) ++pipelined_steps_;
    std::swap(launched, inflight_);  // the older step first
    finish_inflight();
    inflight_ = std::move(launched);
  } else {
    finish_inflight();
    for (size_t g = 0; g < groups; ++g) {
      // A group that needed to retract plans again now that nothing runs; the others just drop requests that
      // finished meanwhile and take the tokens that came back.
      if (next[g].blocked) next[g] = scheds_[g]->schedule(/*allow_retract=*/true);
      else if (running) scheds_[g]->refresh(next[g]);
    }
    any = false;
    for (size_t g = 0; g < groups; ++g) any |= !next[g].empty();
    if (any) launch(std::move(next));
  }
  for (auto& s : scheds_) s->erase_finished();
  if (opts_.check_integrity)
    for (auto& s : scheds_) s->check_integrity();
}

}  // namespace mlaserve
