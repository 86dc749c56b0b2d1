#include "engine/scheduler.h"

#include <algorithm>
#include <limits>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "core/random.h"

namespace mlaserve {

namespace {
int32_t div_up(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }
// The first prompt position whose logit row gives a prompt logprob (that of the token after it).
int32_t lp_first_row_of(const SamplingParams& sp) { return std::max(sp.logprob_start_len - 1, 0); }

// A row of the request's positions (RowOutputs) kept until its next output.
void keep_row(Req& r, const RowOutputs& row) {
  r.hidden.insert(r.hidden.end(), row.hidden.begin(), row.hidden.end());
  r.routes.insert(r.routes.end(), row.routes.begin(), row.routes.end());
}
}  // namespace

std::vector<int32_t> ngram_draft(std::span<const int32_t> seq, int32_t min_n, int32_t max_n, int32_t k) {
  const size_t len = seq.size();
  if (k <= 0 || min_n <= 0 || len < 2) return {};
  const size_t most = std::min(static_cast<size_t>(std::max(max_n, 0)), len - 1);
  if (most < static_cast<size_t>(min_n)) return {};
  const size_t lo = len > kNgramWindow ? len - kNgramWindow : 0;
  // One pass back from the end: each earlier position j holding the last token ends a match of m tokens; the longest
  // (at most `most`) wins, the most recent among equals (the first seen).
  size_t best = 0, best_end = 0;
  for (size_t j = len - 1; j-- > lo;) {
    if (seq[j] != seq[len - 1]) continue;
    size_t m = 1;
    while (m < most && j >= lo + m && seq[j - m] == seq[len - 1 - m]) ++m;
    if (m > best) {
      best = m;
      best_end = j + 1;
      if (m == most) break;
    }
  }
  if (best < static_cast<size_t>(min_n)) return {};
  // Past the sequence's end the continuation repeats with the match's period (len - best_end): a loop of p tokens
  // drafts k tokens of the loop, not only what followed the earlier occurrence before the end.
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(k));
  for (size_t i = best_end; out.size() < static_cast<size_t>(k); ++i) out.push_back(i < len ? seq[i] : out[i - len]);
  return out;
}

namespace {
// A sequence's pages are kept consecutive in runs of a 64-key decode tile (the 64-head-group decode kernel copies a
// tile over consecutive pages as one box; PagePool's placement).
int32_t run_pages(int32_t page_size) {
  constexpr int32_t kTileKeys = 64;
  return page_size > 0 && page_size < kTileKeys ? (kTileKeys + page_size - 1) / page_size : 1;
}
}  // namespace

Scheduler::Scheduler(SchedulerConfig cfg)
    : cfg_(std::move(cfg)),
      pool_(cfg_.num_pages, run_pages(cfg_.page_size)),
      cache_(cfg_.page_size, pool_, cfg_.enable_radix_cache) {
  MLA_CHECK(cfg_.max_running_requests > 0, "max running requests must be positive");
  MLA_CHECK(cfg_.host_pages >= 0, "scheduler: {} host pages", cfg_.host_pages);
  if (cfg_.host_pages > 0) cache_.enable_host_tier(cfg_.host_pages);
}

void Scheduler::take_copies(StepPlan& plan) {
  if (!cache_.copies_pending()) return;
  RadixCache::Copies c = cache_.take_copies();
  plan.batch.kv_saves = std::move(c.saves);
  plan.batch.kv_loads = std::move(c.loads);
}

Scheduler::~Scheduler() = default;

void Scheduler::validate(const GenerateRequest& r) const {
  MLA_CHECK(cfg_.priority_scheduling || r.priority == 0,
            "request {}: priority {} given, but priority scheduling is off", r.rid, r.priority);
  MLA_CHECK(!r.input_ids.empty(), "the prompt is empty");
  for (int32_t id : r.input_ids) MLA_CHECK(id >= 0, "invalid token id {}", id);
  const int64_t n = static_cast<int64_t>(r.input_ids.size());
  MLA_CHECK(n < cfg_.context_len, "the prompt has {} tokens but the model's context length is {}", n, cfg_.context_len);
  const int64_t pool_tokens = static_cast<int64_t>(cfg_.num_pages) * cfg_.page_size;
  MLA_CHECK(n + 1 <= pool_tokens, "the prompt has {} tokens but the KV cache holds only {} tokens", n, pool_tokens);
  const SamplingParams& s = r.sampling;
  MLA_CHECK(s.max_new_tokens >= 0, "max_new_tokens must be >= 0, got {}", s.max_new_tokens);
  MLA_CHECK(s.temperature >= 0.0f, "temperature must be >= 0, got {}", s.temperature);
  MLA_CHECK(s.top_p > 0.0f && s.top_p <= 1.0f, "top_p must be in (0, 1], got {}", s.top_p);
  MLA_CHECK(s.min_p >= 0.0f && s.min_p <= 1.0f, "min_p must be in [0, 1], got {}", s.min_p);
  MLA_CHECK(s.top_k >= -1 && s.top_k != 0, "top_k must be -1 (all) or positive, got {}", s.top_k);
  MLA_CHECK(s.repetition_penalty > 0.0f, "repetition_penalty must be > 0, got {}", s.repetition_penalty);
  MLA_CHECK(s.frequency_penalty >= -2.0f && s.frequency_penalty <= 2.0f, "frequency_penalty must be in [-2, 2], got {}",
            s.frequency_penalty);
  MLA_CHECK(s.presence_penalty >= -2.0f && s.presence_penalty <= 2.0f, "presence_penalty must be in [-2, 2], got {}",
            s.presence_penalty);
  MLA_CHECK(s.top_logprobs_num >= 0 && s.top_logprobs_num <= 100, "top_logprobs_num must be in [0, 100], got {}",
            s.top_logprobs_num);
  MLA_CHECK(s.logprob_start_len >= -1 && s.logprob_start_len < n,
            "logprob_start_len must be -1 or a position of the prompt (< {} tokens), got {}", n, s.logprob_start_len);
}

void Scheduler::add(GenerateRequest g) {
  validate(g);
  auto r = std::make_unique<Req>();
  r->rid = std::move(g.rid);
  r->prompt = std::move(g.input_ids);
  r->fill = r->prompt;
  r->sampling = std::move(g.sampling);
  r->on_output = std::move(g.on_output);
  r->priority = g.priority;
  r->cache_salt = std::move(g.cache_salt);
  r->arrival = ++arrival_counter_;
  r->sampler.seed = r->sampling.seed ? splitmix64(*r->sampling.seed) : splitmix64(++seed_counter_ ^ fnv1a64(r->rid));
  r->prompt_lps_done = r->sampling.logprob_start_len < 0;
  if (!r->sampling.allowed_token_ids.empty()) r->allowed_mask = token_mask(r->sampling.allowed_token_ids);
  if (const SamplingParams& sp = r->sampling; sp.thinking_budget >= 0) {  // does the prompt leave thinking open?
    bool open = false;
    for (size_t i = 1; i <= r->prompt.size(); ++i) {
      if (ends_with(r->prompt, i, sp.think_start_ids)) open = true;
      else if (ends_with(r->prompt, i, sp.think_end_ids)) open = false;
    }
    r->think_since = open ? 0 : -1;
  }
  if (const SamplingParams& sp = r->sampling; sp.constraint && sp.max_new_tokens > 0) {
    try {
      const auto& m = *sp.constraint->allowed(r->constraint_state);
      const bool can_stop = sp.constraint->accepting(r->constraint_state) && sp.min_new_tokens <= 0 &&
                            !sp.stop_tokens(cfg_.eos_token_ids).empty();
      r->empty_text = !can_stop && std::all_of(m.begin(), m.end(), [](uint32_t w) { return w == 0; });
    } catch (const std::exception& e) {  // before any work: this request alone ends, as a failing draw would end it
      r->finish.kind = FinishKind::Abort;
      r->finish.message = fmt::format("structured output: {}", e.what());
      r->state = ReqState::Finished;
      emit(*r);
      return;
    }
    if (r->empty_text) r->sampling.max_new_tokens = 0;
  }
  // Nothing to compute (the prompt's rows or logprobs asked for: its prefill runs, its draw is dropped).
  if (r->sampling.max_new_tokens == 0 && r->prompt_lps_done && !r->sampling.wants_rows()) {
    FinishReason f;
    f.kind = r->empty_text ? FinishKind::Stop : FinishKind::Length;
    r->finish = f;
    r->state = ReqState::Finished;
    emit(*r);
    return;
  }
  enqueue(std::move(r), /*front=*/false);
}

void Scheduler::emit(Req& r) {
  if (!r.on_output) return;
  GenerateOutput o;
  o.new_tokens.assign(r.output.begin() + r.emitted, r.output.end());
  o.new_logprobs = std::move(r.pending_lps);
  r.pending_lps.clear();
  if (r.prompt_lps_done && r.sampling.logprob_start_len >= 0 && r.emitted == 0) {
    // The first output after the prompt's last row resolved (prompt_lps_done): the prompt's logprobs, position 0
    // (which nothing predicts) as NaN.
    if (r.sampling.logprob_start_len == 0) {
      TokenLogprob first;
      first.token = r.prompt[0];
      first.logprob = std::numeric_limits<float>::quiet_NaN();
      o.prompt_logprobs.push_back(std::move(first));
    }
    o.prompt_logprobs.insert(o.prompt_logprobs.end(), std::make_move_iterator(r.prompt_lps.begin()),
                             std::make_move_iterator(r.prompt_lps.end()));
    r.prompt_lps.clear();
  }
  r.emitted = static_cast<int32_t>(r.output.size());
  o.hidden_states = std::move(r.hidden);
  r.hidden.clear();
  o.hidden_size = r.hidden_width;
  o.routed_experts = std::move(r.routes);
  r.routes.clear();
  o.finished = r.state == ReqState::Finished;
  o.finish = r.finish;
  o.prompt_tokens = static_cast<int32_t>(r.prompt.size());
  o.completion_tokens = static_cast<int32_t>(r.output.size());
  o.cached_tokens = r.cached_tokens;
  r.on_output(o);
}

bool Scheduler::may_draft(const Req& r) const {
  const SamplingParams& sp = r.sampling;
  return cfg_.spec_draft_tokens > 0 && r.in_flight <= 1 && !penalised(sp) && !sp.constraint &&
         sp.bad_words_ids.empty() && sp.thinking_budget < 0;
}

bool Scheduler::ensure_pages(int32_t n, const Req*) {
  if (pool_.num_free() >= n) return true;
  cache_.evict(n - pool_.num_free());
  return pool_.num_free() >= n;
}

std::vector<int32_t> Scheduler::device_prefix(std::span<const int32_t> tokens, std::string_view salt) const {
  return cache_suspect_ ? std::vector<int32_t>{} : cache_.device_prefix(tokens, salt);
}

int32_t Scheduler::import_prefix(std::span<const int32_t> tokens, std::string_view salt,
                                 const std::function<void(std::span<const int32_t>, int32_t)>& write, int32_t from) {
  const int32_t P = cfg_.page_size;
  const int32_t n = static_cast<int32_t>(tokens.size()) / P * P;
  if (!cache_.enabled() || cache_suspect_ || n == 0) return 0;
  const RadixCache::Match m = cache_.match_prefix(tokens, n, salt);
  if (m.tokens < from) return m.tokens;  // (the rows start past what is cached: a gap)
  cache_.lock(m.node);  // (kept while pages are evicted for the rest)
  int32_t cached = m.tokens;
  int32_t need = (n - m.tokens) / P;
  if (need > 0 && !ensure_pages(need, nullptr)) need = pool_.num_free();  // (the rows' first pages: what fits)
  if (need > 0) {
    const std::vector<int32_t> got = *pool_.alloc(need);
    try {
      write(got, m.tokens);
    } catch (...) {
      pool_.free(got);
      cache_.unlock(m.node);
      throw;
    }
    std::vector<int32_t> pages = m.pages;
    pages.insert(pages.end(), got.begin(), got.end());
    cached = m.tokens + need * P;
    cache_.insert(tokens.first(static_cast<size_t>(cached)), pages, salt);
  }
  cache_.unlock(m.node);
  return cached;
}

bool Scheduler::take_pages(Req& r, int32_t upto_tokens, const Req* protect) {
  const int32_t need = div_up(upto_tokens, cfg_.page_size) - static_cast<int32_t>(r.pages.size());
  if (need <= 0) return true;
  if (!ensure_pages(need, protect)) return false;
  auto got = pool_.alloc_after(r.pages, need);
  MLA_CHECK(got.has_value(), "page pool: allocation failed after ensure");
  r.pages.insert(r.pages.end(), got->begin(), got->end());
  return true;
}

int32_t Scheduler::lp_first_row(const Req& r) {
  return r.prompt_lps_done ? -1 : lp_first_row_of(r.sampling);
}

ScheduledSeq Scheduler::prefill_seq(Req& r, int32_t n) const {
  ScheduledSeq q;
  q.req = &r;
  q.num_tokens = n;
  q.wants_logits = r.kv_len + n == static_cast<int32_t>(r.fill.size());
  q.prefill = true;
  if (const int32_t first = lp_first_row(r); first >= 0) {
    q.lp_first_pos = std::max(first, r.kv_len);
    q.lp_rows = std::max(0, std::min(r.kv_len + n, static_cast<int32_t>(r.prompt.size()) - 1) - q.lp_first_pos);
  }
  return q;
}

void Scheduler::admit(Req& r) {
  // Reuse the longest cached prefix, leaving at least one token to compute (its logits give the next token), and
  // every token whose logit row the prompt logprobs need.
  int32_t limit = static_cast<int32_t>(r.fill.size()) - 1;
  if (const int32_t first = lp_first_row(r); first >= 0) limit = std::min(limit, first);
  if (r.sampling.wants_rows()) limit = std::min(limit, r.hidden_have);
  auto m = cache_suspect_ ? RadixCache::Match{} : cache_.match_prefix(r.fill, limit, r.cache_salt);
  cache_.lock(m.node);
  r.prefix_node = m.node;
  r.pages = std::move(m.pages);
  r.prefix_pages = static_cast<int32_t>(r.pages.size());
  r.kv_len = m.tokens;
  r.loaded_tokens = m.loaded_tokens;
  r.admit_order = ++admit_counter_;
}

void Scheduler::unadmit(Req& r) {
  cache_.unlock(r.prefix_node);
  r.prefix_node = nullptr;
  r.pages.clear();
  r.prefix_pages = 0;
  r.kv_len = 0;
}

int64_t Scheduler::available_tokens(const Req& r, int32_t headroom) const {
  const int64_t P = cfg_.page_size;
  return static_cast<int64_t>(pool_.num_free() + cache_.evictable_pages() - headroom) * P +
         (static_cast<int64_t>(r.pages.size()) * P - r.kv_len);
}

void Scheduler::release(Req& r, bool cache_kv) {
  const size_t P = static_cast<size_t>(cfg_.page_size);
  const size_t full = static_cast<size_t>(r.kv_len) / P;
  if (cache_kv && cache_.enabled() && !cache_suspect_ && full > 0) {
    const size_t n = std::min(full, r.pages.size());
    cache_.insert(std::span<const int32_t>(r.fill.data(), n * P), std::span<const int32_t>(r.pages.data(), n),
                  r.cache_salt);
    pool_.free(std::vector<int32_t>(r.pages.begin() + static_cast<int64_t>(n), r.pages.end()));
  } else {
    pool_.free(std::vector<int32_t>(r.pages.begin() + r.prefix_pages, r.pages.end()));
  }
  cache_.unlock(r.prefix_node);
  r.prefix_node = nullptr;
  r.pages.clear();
  r.prefix_pages = 0;
}

int32_t forced_think_token(const Req& r, int32_t in_flight) {
  const SamplingParams& sp = r.sampling;
  if (sp.thinking_budget < 0 || r.think_since < 0) return -1;
  const int64_t over = static_cast<int64_t>(r.output.size()) + in_flight - r.think_since - sp.thinking_budget;
  if (over < 0 || over >= static_cast<int64_t>(sp.think_end_ids.size())) return -1;
  return sp.think_end_ids[static_cast<size_t>(over)];
}

bool waits_for_previous_token(const Req& r) {
  const SamplingParams& sp = r.sampling;
  if (r.in_flight == 0) return false;
  if (needs_previous_token(sp)) return true;
  if (sp.thinking_budget < 0) return false;
  // Thinking open: from the budget on the draws are forced, each after the one before (its token tells whether the
  // end came). Closed: the token in flight may open it, which matters only for a budget of 0.
  if (r.think_since >= 0)
    return static_cast<int64_t>(r.output.size()) + r.in_flight - r.think_since >= sp.thinking_budget;
  return sp.thinking_budget == 0;
}

void Scheduler::enqueue(std::unique_ptr<Req> r, bool front) {
  if (!cfg_.priority_scheduling) {
    if (front) waiting_.push_front(std::move(r));
    else waiting_.push_back(std::move(r));
    return;
  }
  // (With longest_prefix_first the queue is ordered by priority only, arrival order lost within one: see schedule.)
  const bool lpm = cfg_.longest_prefix_first;
  const auto key = [lpm](const Req& q) { return std::make_pair(q.priority, lpm ? 0 : q.arrival); };
  const auto at = std::upper_bound(waiting_.begin(), waiting_.end(), key(*r),
                                   [&](const auto& k, const std::unique_ptr<Req>& q) { return k < key(*q); });
  waiting_.insert(at, std::move(r));
}

void Scheduler::cache_prefill(Req& r, int32_t kv_end) {
  const int32_t full = kv_end / cfg_.page_size;
  if (!cache_.enabled() || cache_suspect_ || full <= r.prefix_pages) return;
  const size_t n = static_cast<size_t>(full);
  MLA_CHECK(r.pages.size() >= n && r.fill.size() >= n * static_cast<size_t>(cfg_.page_size),
            "scheduler: request {} caches {} pages it does not hold", r.rid, full);
  // The request's duplicates of pages the tree had go back to the pool; it goes on with the tree's.
  RadixCache::Node* node = cache_.insert_shared(
      std::span<const int32_t>(r.fill.data(), n * static_cast<size_t>(cfg_.page_size)),
      std::span<int32_t>(r.pages.data(), n), r.cache_salt);
  cache_.lock(node);
  cache_.unlock(r.prefix_node);
  r.prefix_node = node;
  r.prefix_pages = full;
}

void Scheduler::retract(Req& r) {
  MLA_LOG_DEBUG("retracting request {} ({} tokens of KV)", r.rid, r.kv_len);
  r.prompt_lps.clear();  // a prefill cut short: its rows are computed again (admit stops the prefix before them)
  release(r, /*cache_kv=*/true);
  r.kv_len = 0;
  r.state = ReqState::Waiting;
  r.model_drafts.clear();  // its prefill again makes new ones
  ++counters_.num_retractions;
}

void Scheduler::finish(Req& r, FinishReason reason, bool cache_kv) {
  r.finish = std::move(reason);
  const bool held = r.state == ReqState::Prefilling || r.state == ReqState::Decoding;
  r.state = ReqState::Finished;
  if (held) release(r, cache_kv);
  ++counters_.num_requests_finished;
  emit(r);
}

void Scheduler::erase_finished() {
  running_.erase(std::remove_if(running_.begin(), running_.end(),
                                [](const std::unique_ptr<Req>& r) {
                                  return r->state == ReqState::Finished && r->plan_refs == 0;
                                }),
                 running_.end());
}

bool Scheduler::abort(const std::string& rid, const FinishReason& reason, bool cache_kv) {
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if ((*it)->rid != rid) continue;
    std::unique_ptr<Req> r = std::move(*it);
    waiting_.erase(it);
    finish(*r, reason, cache_kv);
    return true;
  }
  for (auto& r : running_) {
    if (r->rid != rid || r->state == ReqState::Finished) continue;
    finish(*r, reason, cache_kv);  // freed by erase_finished(), once no plan refers to it
    return true;
  }
  return false;
}

void Scheduler::fail(const StepPlan& plan, const FinishReason& reason) {
  std::vector<std::string> rids;
  for (const ScheduledSeq& s : plan.seqs) rids.push_back(s.req->rid);
  for (const auto& rid : rids) abort(rid, reason, /*cache_kv=*/false);
  if (!plan.batch.kv_saves.empty() || !plan.batch.kv_loads.empty()) {
    MLA_LOG_WARN("a failed step carried the prefix cache's copies: the cache is set aside until it can be emptied");
    cache_suspect_ = true;
  }
}

void Scheduler::retract_to_waiting(Req& victim) {
  MLA_CHECK(victim.in_flight == 0 && victim.plan_refs == 0, "scheduler: retracting request {} with a step in flight",
            victim.rid);
  retract(victim);
  for (auto it = running_.begin(); it != running_.end(); ++it)
    if (it->get() == &victim) {
      enqueue(std::move(*it), /*front=*/true);
      running_.erase(it);
      return;
    }
}

int64_t Scheduler::admission_shortfall(Req& w, int32_t headroom, std::span<Req* const> victims, int64_t& freed) {
  freed = 0;
  if (num_running() >= cfg_.max_running_requests) return -1;
  admit(w);  // (the cached prefix it would reuse counts, and its lock keeps those pages from `freed`; undone below)
  const int64_t chunk = first_chunk(w);
  const int64_t available = available_tokens(w, headroom);
  std::vector<RadixCache::Node*> paths;
  for (const Req* v : victims) {
    // Its own pages, and the page of headroom its next decode token would have needed.
    const size_t own = v->pages.size() - static_cast<size_t>(v->prefix_pages);
    freed += static_cast<int64_t>(own + (v->state == ReqState::Decoding ? 1 : 0)) * cfg_.page_size;
    paths.push_back(v->prefix_node);
  }
  freed += static_cast<int64_t>(cache_.pages_unlocked_by(paths)) * cfg_.page_size;
  unadmit(w);
  return std::max<int64_t>(0, chunk - available);
}

int64_t Scheduler::first_chunk(const Req& w) const {
  const int64_t budget =
      cfg_.chunked_prefill_size > 0 ? cfg_.chunked_prefill_size : std::numeric_limits<int64_t>::max();
  return std::min(static_cast<int64_t>(w.fill.size()) - w.kv_len, budget);
}

bool Scheduler::preempt_for_waiting(bool allow_retract) {
  if (!cfg_.priority_scheduling || !cfg_.priority_preemption) return false;
  while (!waiting_.empty()) {
    Req& w = *waiting_.front();
    // Running requests far enough below it (a larger priority value by more than the threshold).
    std::vector<Req*> victims;
    Req* victim = nullptr;
    int32_t decoding = 0;
    for (auto& r : running_) {
      decoding += r->state == ReqState::Decoding;
      if (r->state != ReqState::Prefilling && r->state != ReqState::Decoding) continue;
      if (static_cast<int64_t>(r->priority) - w.priority <= cfg_.priority_preemption_threshold) continue;
      if (allow_retract && (r->in_flight > 0 || r->plan_refs > 0)) continue;  // (none when nothing runs)
      victims.push_back(r.get());
      if (!victim || std::make_pair(r->priority, r->arrival) > std::make_pair(victim->priority, victim->arrival))
        victim = r.get();
    }
    if (!victim) return false;
    // It fits even without its cached prefix (no need to match it: admission will).
    if (num_running() < cfg_.max_running_requests && available_tokens(w, decoding) >= first_chunk(w)) return false;
    // The tokens retracting them all would free: their own pages, and their cached prefixes' pages that no other
    // running request (nor w's own prefix) holds: a prefix shared with a request that stays is not freed.
    int64_t victim_tokens = 0;
    const int64_t short_by = admission_shortfall(w, decoding, victims, victim_tokens);
    // It fits, or retracting them all would not make it fit (then it waits as usual).
    if (short_by == 0 || short_by > victim_tokens) return false;
    if (!allow_retract) return true;
    MLA_LOG_DEBUG("request {} (priority {}) preempts request {} (priority {})", w.rid, w.priority, victim->rid,
                  victim->priority);
    retract_to_waiting(*victim);
  }
  return false;
}

StepPlan Scheduler::schedule(bool allow_retract) {
  StepPlan plan;
  const int32_t P = cfg_.page_size;
  if (cache_suspect_) {  // once nothing holds a lock, the cache is emptied and used again
    if (empty_cache()) {
      cache_suspect_ = false;
      MLA_LOG_INFO("the prefix cache was emptied after a failed step; it is used again");
    }
  }
  // 0. Priority preemption: running requests far below the waiting queue's head make room for it.
  if (preempt_for_waiting(allow_retract)) {
    plan.blocked = true;  // retract once the step in flight is back
    return plan;
  }

  // 1. Decode: one token for every decoding request; retract the newest ones if pages run out.
  std::vector<Req*> decoding;
  // MTP drafts: a request that may draft waits for its step in flight (its draft comes from that step), unless this
  // step would check no drafts anyway (more decoding requests than spec_max_batch).
  const bool mtp_waits =
      cfg_.spec_model_drafts &&
      (cfg_.spec_max_batch <= 0 || std::count_if(running_.begin(), running_.end(), [](const auto& r) {
                                     return r->state == ReqState::Decoding;
                                   }) <= cfg_.spec_max_batch);
  for (auto& r : running_) {
    if (r->state != ReqState::Decoding) continue;
    // A request whose in-flight token will reach its length limit finishes when that token resolves.
    if (r->in_flight > 0 && (static_cast<int32_t>(r->output.size()) + r->in_flight >= r->sampling.max_new_tokens ||
                             static_cast<int64_t>(r->fill.size()) >= cfg_.context_len))
      continue;
    // A step checking its drafts is in flight: how many tokens it keeps is known only when it resolves.
    if (r->drafting) continue;
    if (mtp_waits && r->in_flight > 0 && may_draft(*r)) continue;
    decoding.push_back(r.get());
  }
  // Speculative decoding: each request's drafts, at most as many as its length limits leave room for.
  std::unordered_map<const Req*, std::vector<int32_t>> drafts;
  const bool draft_step = cfg_.spec_max_batch <= 0 || static_cast<int32_t>(decoding.size()) <= cfg_.spec_max_batch;
  for (Req* r : decoding) {
    if (!draft_step || !may_draft(*r)) continue;
    const int64_t room =
        std::min<int64_t>(r->sampling.max_new_tokens - static_cast<int64_t>(r->output.size()) - r->in_flight,
                          cfg_.context_len - static_cast<int64_t>(r->fill.size())) - 1;
    if (cfg_.spec_model_drafts) {
      const int64_t k =
          std::min<int64_t>({room, cfg_.spec_draft_tokens, static_cast<int64_t>(r->model_drafts.size())});
      if (r->in_flight == 0 && k >= 1)
        drafts.emplace(r, std::vector<int32_t>(r->model_drafts.begin(), r->model_drafts.begin() + k));
      continue;
    }
    if (r->draft_skip > 0) {  // its last drafts were not kept
      --r->draft_skip;
      continue;
    }
    const int32_t k = static_cast<int32_t>(std::min<int64_t>(cfg_.spec_draft_tokens, room));
    if (k <= 0) continue;
    if (r->in_flight == 0) {
      auto d = ngram_draft(r->fill, cfg_.spec_ngram_min, cfg_.spec_ngram_max, k);
      if (!d.empty()) drafts.emplace(r, std::move(d));
      continue;
    }
    // Its decode token is in flight (overlap scheduling): the match ends at the token before it, its next token is a
    // guess of the one in flight, and the drafts are the tokens after the guess. The step's input is the token in
    // flight itself (read on the device), so its draws check the drafts as usual; a wrong guess only makes them
    // unlikely to be kept.
    auto d = ngram_draft(std::span<const int32_t>(r->fill).first(r->fill.size() - 1), cfg_.spec_ngram_min,
                         cfg_.spec_ngram_max, k + 1);
    if (d.size() < 2) continue;
    d.erase(d.begin());
    drafts.emplace(r, std::move(d));
  }
  auto draft_of = [&](const Req* r) -> int32_t {
    const auto it = drafts.find(r);
    return it == drafts.end() ? 0 : static_cast<int32_t>(it->second.size());
  };
  plan.mtp_chain = cfg_.spec_model_drafts ? (draft_step ? cfg_.spec_draft_tokens : 1) : 0;
  int32_t chain_room = plan.chain_room();  // (0 once pages run short)
  auto pages_needed = [&]() {
    int32_t n = 0;
    for (Req* r : decoding)
      n += std::max(0, div_up(r->kv_len + 1 + draft_of(r) + chain_room, P) - static_cast<int32_t>(r->pages.size()));
    return n;
  };
  while (!decoding.empty() && !ensure_pages(pages_needed(), nullptr)) {
    if (!drafts.empty() || chain_room > 0) {  // drafts are the first to go when pages run short
      drafts.clear();
      chain_room = 0;
      continue;
    }
    if (!allow_retract) {
      plan.blocked = true;
      return plan;
    }
    if (decoding.size() == 1 && std::none_of(running_.begin(), running_.end(), [&](const auto& r) {
          return r->state == ReqState::Prefilling;
        })) {
      // Alone and still no room: the KV cache cannot hold this sequence any longer.
      FinishReason f;
      f.kind = FinishKind::Length;
      f.message = "KV cache full";
      finish(*decoding.front(), f);
      decoding.clear();
      break;
    }
    // Retract a mid-prefill request first (it has the least sunk work), else the newest decoding one; by priority:
    // the one of the largest (priority, arrival), prefilling or decoding.
    Req* victim = nullptr;
    if (cfg_.priority_scheduling) {
      auto later = [](const Req* a, const Req* b) {
        return std::make_pair(a->priority, a->arrival) > std::make_pair(b->priority, b->arrival);
      };
      for (auto& r : running_)
        if (r->state == ReqState::Prefilling && (!victim || later(r.get(), victim))) victim = r.get();
      for (Req* r : decoding)
        if (!victim || later(r, victim)) victim = r;
      decoding.erase(std::remove(decoding.begin(), decoding.end(), victim), decoding.end());
    } else {
      for (auto& r : running_)
        if (r->state == ReqState::Prefilling) victim = r.get();
      if (!victim) {
        victim = decoding.back();
        decoding.pop_back();
      }
    }
    retract_to_waiting(*victim);
  }
  for (Req* r : decoding) {
    const int32_t k = draft_of(r);
    MLA_CHECK(take_pages(*r, r->kv_len + 1 + k + chain_room, r), "scheduler: decode pages vanished");
    ScheduledSeq& q = plan.seqs.emplace_back();
    q.req = r;
    q.num_tokens = 1 + k;
    q.wants_logits = true;
    if (k > 0) q.drafts = std::move(drafts.at(r));
  }

  // 2. Prefill: continue the chunked request, then admit waiting requests in order, within the token budget.
  int64_t budget = cfg_.chunked_prefill_size > 0 ? cfg_.chunked_prefill_size : std::numeric_limits<int64_t>::max();
  const int32_t headroom = static_cast<int32_t>(decoding.size());  // next step's decode pages, roughly
  // Prompt-logprob rows left this step: a chunk needing more ends where they run out.
  int64_t lp_budget = std::max(cfg_.max_prompt_logprob_rows, 1);
  auto lp_limit = [&](const Req& r) {  // rows are those of positions [max(first, kv_len), prompt length - 1)
    const int32_t first = lp_first_row(r);
    const int64_t end = std::max<int64_t>(first, r.kv_len) + lp_budget;
    if (first < 0 || end >= static_cast<int64_t>(r.prompt.size()) - 1) return std::numeric_limits<int64_t>::max();
    return end - r.kv_len;
  };
  bool chunk_open = false;
  for (auto& rp : running_) {
    Req& r = *rp;
    if (r.state != ReqState::Prefilling) continue;
    const int64_t remaining = static_cast<int64_t>(r.fill.size()) - r.kv_len;
    const int64_t n = std::min({remaining, budget, available_tokens(r, headroom), lp_limit(r)});
    if (n <= 0) {
      chunk_open = true;
      continue;
    }
    MLA_CHECK(take_pages(r, r.kv_len + static_cast<int32_t>(n), &r), "scheduler: prefill pages vanished");
    plan.seqs.push_back(prefill_seq(r, static_cast<int32_t>(n)));
    lp_budget -= plan.seqs.back().lp_rows;
    budget -= n;
    if (n < remaining) chunk_open = true;
  }
  // A waiting request sharing at least kShareDefer (or a page) of its uncached tokens with the part of a running
  // request's prompt that request has computed or is computing but not cached yet waits: once those pages are cached
  // it finds them there instead of computing them again (a burst of prompts with one system prompt computes it once).
  // The requests after it are admitted meanwhile.
  const int64_t least_shared = std::max<int64_t>(kShareDefer, P);
  auto shares_prefill = [&](const Req& w) {
    if (!cache_.enabled() || cache_suspect_) return false;
    for (const auto& o : running_) {
      const int64_t cached_end = int64_t{o->prefix_pages} * P;  // o's pages in the tree: [0, cached_end)
      const size_t end = std::min({o->prompt.size(), o->fill.size(), w.fill.size()});
      if (o->state == ReqState::Finished || o->cache_salt != w.cache_salt ||
          static_cast<int64_t>(end) - std::max<int64_t>(cached_end, w.kv_len) < least_shared)
        continue;
      size_t c = 0;
      while (c < end && o->fill[c] == w.fill[c]) ++c;
      if (static_cast<int64_t>(c) - std::max<int64_t>(cached_end, w.kv_len) >= least_shared) return true;
    }
    return false;
  };
  if (cfg_.longest_prefix_first && cache_.enabled() && !cache_suspect_ && waiting_.size() > 1 &&
      waiting_.size() <= kLpmMaxWaiting) {
    // Longest cached prefix first (by priority first with priority scheduling); a stable sort keeps the queue's order
    // among equals.
    std::vector<std::pair<std::pair<int32_t, int64_t>, std::unique_ptr<Req>>> keyed;
    for (auto& w : waiting_) {
      const auto cached = static_cast<int64_t>(cache_.device_prefix(w->fill, w->cache_salt).size());
      keyed.emplace_back(std::make_pair(cfg_.priority_scheduling ? w->priority : 0, -cached), std::move(w));
    }
    std::stable_sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 0; i < keyed.size(); ++i) waiting_[i] = std::move(keyed[i].second);
  }
  size_t next = 0;  // waiting_[next] is the next to try
  while (!chunk_open && budget > 0 && next < waiting_.size() && num_running() < cfg_.max_running_requests) {
    Req& r = *waiting_[next];
    admit(r);
    if (shares_prefill(r)) {
      unadmit(r);
      ++next;
      continue;
    }
    const int64_t remaining = static_cast<int64_t>(r.fill.size()) - r.kv_len;
    const int64_t n = std::min({remaining, budget, available_tokens(r, headroom), lp_limit(r)});
    // Admission control: wait (do not fail) until the whole prompt fits in free + evictable pages,
    // unless it is chunked anyway because of the budget.
    const bool fits = available_tokens(r, headroom) >= std::min(remaining, budget);
    if (n <= 0 || !fits) {
      unadmit(r);
      break;
    }
    MLA_CHECK(take_pages(r, r.kv_len + static_cast<int32_t>(n), &r), "scheduler: admission pages vanished");
    r.state = ReqState::Prefilling;
    if (!r.counted) {  // first admission: what the prefix cache served
      r.cached_tokens = r.kv_len;
      r.counted = true;
      counters_.prompt_tokens_total += static_cast<int64_t>(r.prompt.size());
      counters_.cached_prompt_tokens_total += r.kv_len;
      counters_.host_loaded_tokens_total += r.loaded_tokens;
    }
    plan.seqs.push_back(prefill_seq(r, static_cast<int32_t>(n)));
    lp_budget -= plan.seqs.back().lp_rows;
    budget -= n;
    running_.push_back(std::move(waiting_[next]));
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(next));
    if (n < remaining) chunk_open = true;
  }

  build_batch(plan);
  return plan;
}

void Scheduler::build_batch(StepPlan& plan) {
  ForwardBatchBuilder bb(cfg_.page_size);
  std::vector<std::pair<size_t, int32_t>> from_device;  // (token index in the batch, previous step's logit row)
  size_t at = 0;
  std::vector<int32_t> with_drafts;
  for (const ScheduledSeq& s : plan.seqs) {
    Req& r = *s.req;
    std::span<const int32_t> toks(r.fill.data() + r.kv_len, static_cast<size_t>(s.num_tokens) - s.drafts.size());
    if (!s.drafts.empty()) {  // the decode token, then the drafts
      MLA_CHECK(toks.size() == 1, "scheduler: request {} drafts after {} tokens", r.rid, toks.size());
      with_drafts.assign(toks.begin(), toks.end());
      with_drafts.insert(with_drafts.end(), s.drafts.begin(), s.drafts.end());
      toks = with_drafts;
    }
    for (size_t i = 0; i < toks.size(); ++i)
      if (toks[i] == kPendingToken) {
        // Only a decode token can be pending, and only the newest one (one step in flight when planning).
        MLA_CHECK(r.in_flight == 1 && r.pending_row >= 0 && static_cast<size_t>(r.kv_len) + i + 1 == r.fill.size(),
                  "scheduler: request {} plans a pending token it cannot take from the device", r.rid);
        from_device.emplace_back(at + i, r.pending_row);
      }
    at += toks.size();
    // (chained MTP drafts: the pages after the new tokens that the request has, for the chain's positions)
    bb.add_logits_from(toks, r.kv_len, r.pages, s.num_tokens - s.rows(), plan.chain_room());
    // A few tokens after a long context: no expansion of the context.
    if (!s.drafts.empty()) bb.absorb_last(static_cast<int32_t>(s.drafts.size()));
    if (r.sampling.wants_rows()) bb.hidden_of_last();
  }
  plan.batch = bb.finish();
  plan.batch.mtp_chain = plan.mtp_chain;
  plan.batch.hidden_states = std::any_of(plan.seqs.begin(), plan.seqs.end(), [](const ScheduledSeq& s) {
    return s.req->sampling.return_hidden_states;
  });
  plan.uses_prev_ids = !from_device.empty();
  for (const auto& [t, row] : from_device) plan.batch.input_ids[t] = -(row + 1);
  if (cfg_.spec_model_drafts) set_next_ids(plan);
}

void Scheduler::set_next_ids(StepPlan& plan) const {
  ForwardBatch& b = plan.batch;
  std::vector<int32_t> row_of(static_cast<size_t>(b.num_tokens()), -1);  // token -> its logit row
  for (size_t k = 0; k < b.logit_rows.size(); ++k)
    row_of[static_cast<size_t>(b.logit_rows[k])] = static_cast<int32_t>(k);
  b.next_ids.assign(static_cast<size_t>(b.num_tokens()), 0);
  size_t t = 0;
  for (const ScheduledSeq& s : plan.seqs) {
    const Req& r = *s.req;
    for (int32_t i = 0; i < s.num_tokens; ++i, ++t) {
      // A decode token and its drafts: each one's next token is its own draw. Otherwise the next token of the prompt
      // (or of the output, after a retraction), or this step's draw at the end of what is known.
      const size_t next = static_cast<size_t>(r.kv_len) + static_cast<size_t>(i) + 1;
      if (s.drafts.empty() && next < r.fill.size() && r.fill[next] != kPendingToken) {
        b.next_ids[t] = r.fill[next];
      } else {
        MLA_CHECK(row_of[t] >= 0, "scheduler: request {}'s token {} has no next token and no draw", r.rid, i);
        b.next_ids[t] = -(row_of[t] + 1);
      }
    }
  }
}

void Scheduler::refresh(StepPlan& plan) {
  plan.seqs.erase(std::remove_if(plan.seqs.begin(), plan.seqs.end(),
                                 [](const ScheduledSeq& s) { return s.req->state == ReqState::Finished; }),
                  plan.seqs.end());
  for (const ScheduledSeq& s : plan.seqs)
    for (int32_t i = 0; i < s.num_tokens - static_cast<int32_t>(s.drafts.size()); ++i)
      MLA_CHECK(s.req->fill[static_cast<size_t>(s.req->kv_len + i)] != kPendingToken,
                "scheduler: request {} still has a pending token at refresh", s.req->rid);
  build_batch(plan);
}

void Scheduler::commit(StepPlan& plan, const std::vector<SampleResult>& sampled) {
  advance(plan);
  resolve(plan, sampled);
  erase_finished();
}

void Scheduler::advance(StepPlan& plan) {
  int32_t row = 0;
  for (ScheduledSeq& s : plan.seqs) {
    Req& r = *s.req;
    ++r.plan_refs;
    row += s.lp_rows;
    const int32_t my_row = s.wants_logits ? row : -1;
    row += s.sampled_rows();
    if (r.state == ReqState::Finished) continue;  // aborted or stopped meanwhile
    r.kv_len += s.num_tokens;
    s.kv_end = r.kv_len;
    if (!s.wants_logits) continue;
    r.state = ReqState::Decoding;
    r.fill.push_back(kPendingToken);
    ++r.in_flight;
    r.pending_row = my_row;
    r.drafting = !s.drafts.empty();
  }
}

void Scheduler::drop(StepPlan& plan) {
  for (ScheduledSeq& s : plan.seqs) --s.req->plan_refs;
}

void Scheduler::resolve(StepPlan& plan, const std::vector<SampleResult>& sampled) {
  size_t i = 0;
  int32_t step_rows = 0;  // the step's rows (ForwardBatch::hidden_rows): every new token of the requests wanting them
  const size_t width = static_cast<size_t>(plan.hidden_width), rwidth = static_cast<size_t>(plan.routes_width);
  // Row k of the step for request r (what it asks for), if the position it is of was not collected before.
  auto step_row = [&](Req& r, int32_t k, int32_t pos) -> RowOutputs {
    MLA_CHECK(!r.sampling.return_hidden_states ||
                  (static_cast<size_t>(k + 1) * width <= plan.hidden.size() && width > 0),
              "scheduler: request {} misses hidden row {} of the step ({} floats of rows of {})", r.rid, k,
              plan.hidden.size(), width);
    MLA_CHECK(!r.sampling.return_routed_experts || static_cast<size_t>(k + 1) * rwidth <= plan.routes.size(),
              "scheduler: request {} misses the routed experts of row {} of the step", r.rid, k);
    if (pos < r.hidden_have) return {};
    r.hidden_width = plan.hidden_width;
    r.hidden_have = pos + 1;
    RowOutputs row;
    if (r.sampling.return_hidden_states) row.hidden = {plan.hidden.data() + static_cast<size_t>(k) * width, width};
    if (r.sampling.return_routed_experts) row.routes = {plan.routes.data() + static_cast<size_t>(k) * rwidth, rwidth};
    return row;
  };
  for (ScheduledSeq& s : plan.seqs) {
    Req& r = *s.req;
    --r.plan_refs;
    MLA_CHECK(i + static_cast<size_t>(s.rows()) <= sampled.size(), "scheduler: {} sampled tokens for more rows",
              sampled.size());
    const int32_t first_row = step_rows;
    if (r.sampling.wants_rows()) step_rows += s.num_tokens;
    if (s.prefill && r.state != ReqState::Finished && r.state != ReqState::Waiting) {
      cache_prefill(r, s.kv_end);
      if (r.sampling.wants_rows())  // every position of the chunk
        for (int32_t k = 0; k < s.num_tokens; ++k)
          keep_row(r, step_row(r, first_row + k, s.kv_end - s.num_tokens + k));
    }
    if (r.state != ReqState::Finished)
      for (int32_t k = 0; k < s.lp_rows; ++k) r.prompt_lps.push_back(sampled[i + static_cast<size_t>(k)].logprob);
    i += static_cast<size_t>(s.lp_rows);
    if (!s.wants_logits) continue;
    const size_t first = i;
    i += static_cast<size_t>(s.sampled_rows());
    if (r.state == ReqState::Finished) continue;  // aborted while the step ran, or stopped by an earlier token
    if (!s.drafts.empty()) r.drafting = false;  // (a step before it resolving leaves a check in flight)
    if (!r.prompt_lps_done) {
      r.prompt_lps_done = true;  // the prompt's last row: its logprobs go out with this output
      MLA_CHECK(r.prompt_lps.size() + 1 == r.prompt.size() - static_cast<size_t>(lp_first_row_of(r.sampling)),
                "scheduler: request {} has {} prompt logprobs for {} prompt tokens from {}", r.rid,
                r.prompt_lps.size(), r.prompt.size(), r.sampling.logprob_start_len);
    }
    if (r.sampling.max_new_tokens == 0) {  // prompt logprobs only: the sample is dropped
      const size_t at = r.fill.size() - static_cast<size_t>(r.in_flight);
      MLA_CHECK(r.in_flight == 1 && at + 1 == r.fill.size(), "scheduler: request {} has {} tokens in flight", r.rid,
                r.in_flight);
      r.fill.pop_back();
      --r.in_flight;
      FinishReason f;
      f.kind = r.empty_text ? FinishKind::Stop : FinishKind::Length;
      finish(r, f);
      continue;
    }
    // Drafts: the draws agree with the first `kept` of them; those and the draw after them are the new tokens. The
    // cache holds the decode token and the kept drafts; the rejected drafts' rows are overwritten later.
    // (Drafts made while the decode token was in flight followed a guess of it, but the step's input was the token
    // itself, read on the device: the draws check the drafts against it, right guess or not.)
    size_t kept = 0;
    while (kept < s.drafts.size() && sampled[first + kept].token == s.drafts[kept]) ++kept;
    if (!s.drafts.empty()) {
      r.kv_len -= static_cast<int32_t>(s.drafts.size() - kept);
      counters_.spec_draft_tokens += static_cast<int64_t>(s.drafts.size());
      counters_.spec_accepted_tokens += static_cast<int64_t>(kept);
      ++counters_.spec_checks;
      if (!cfg_.spec_model_drafts) {
        r.draft_backoff = kept > 0 ? 0 : std::min(std::max(1, 2 * r.draft_backoff), kMaxDraftBackoff);
        r.draft_skip = r.draft_backoff;
      }
    }
    // A decode step's rows go with the tokens they drew (the decode token's row, then each kept draft's).
    const bool decode_rows = r.sampling.wants_rows() && !s.prefill;
    for (size_t t = 0; t <= kept && r.state != ReqState::Finished; ++t)
      take_token(r, sampled[first + t], t == 0,
                 decode_rows ? step_row(r, first_row + static_cast<int32_t>(t),
                                        s.kv_end - s.num_tokens + static_cast<int32_t>(t))
                             : RowOutputs{});
    if (r.state == ReqState::Finished) continue;
    r.model_drafts = sampled[first + kept].drafts;  // the MTP layer's tokens after the last one taken
    emit(r);
    // Pages past the next token's position go back (drafts that were not kept).
    const size_t need = static_cast<size_t>(div_up(r.kv_len + 1, cfg_.page_size));
    if (!s.drafts.empty() && r.pages.size() > need && need >= static_cast<size_t>(r.prefix_pages)) {
      pool_.free(std::vector<int32_t>(r.pages.begin() + static_cast<int64_t>(need), r.pages.end()));
      r.pages.resize(need);
    }
  }
  MLA_CHECK(i == sampled.size(), "scheduler: {} sampled tokens for {} rows", sampled.size(), i);
  // (hidden states only when a request of the step returns them)
  const size_t hidden_floats = plan.batch.hidden_states ? static_cast<size_t>(step_rows) * width : 0;
  MLA_CHECK(hidden_floats == plan.hidden.size() &&
                (plan.routes.empty() || static_cast<size_t>(step_rows) * rwidth == plan.routes.size()),
            "scheduler: {} floats of hidden states and {} routed experts for {} rows of {} / {}", plan.hidden.size(),
            plan.routes.size(), step_rows, width, rwidth);
}

void Scheduler::take_token(Req& r, const SampleResult& sr, bool pending, const RowOutputs& row) {
  if (pending) {  // the oldest token still in flight is this step's
    const size_t at = r.fill.size() - static_cast<size_t>(r.in_flight);
    MLA_CHECK(r.in_flight >= 1 && r.fill[at] == kPendingToken, "scheduler: request {} has no pending token", r.rid);
    r.fill[at] = sr.token;
    --r.in_flight;
  } else {  // a draw after kept drafts (no other token in flight: drafting needs none)
    MLA_CHECK(r.in_flight == 0, "scheduler: request {} keeps drafts with {} tokens in flight", r.rid, r.in_flight);
    r.fill.push_back(sr.token);
  }
  r.output.push_back(sr.token);
  const size_t hidden_before = r.hidden.size(), routes_before = r.routes.size();
  keep_row(r, row);
  if (r.sampling.thinking_budget >= 0) {
    if (ends_with(r.output, r.output.size(), r.sampling.think_start_ids))
      r.think_since = static_cast<int32_t>(r.output.size());
    else if (ends_with(r.output, r.output.size(), r.sampling.think_end_ids))
      r.think_since = -1;
  }
  r.sampler.observe_output(sr.token);
  ++r.sampler.step;
  if (r.sampling.wants_logprobs()) r.pending_lps.push_back(sr.logprob);
  ++counters_.generation_tokens_total;
  const SamplingParams& sp = r.sampling;
  FinishReason f;
  const bool may_stop = r.output.size() > static_cast<size_t>(std::max(sp.min_new_tokens, 0));
  const bool stop_token = sp.is_stop_token(cfg_.eos_token_ids, sr.token);
  // Constrained: a stop token ends the text where the constraint accepts; otherwise the token moves the state, and a
  // state with no token allowed ends the request (a stop with no token: its text is complete).
  bool complete = false, dropped = false;
  auto drop_token = [&] {  // not part of the answer, which ends before it
    complete = dropped = true;
    r.output.pop_back();
    r.hidden.resize(hidden_before);
    r.routes.resize(routes_before);
    if (r.sampling.wants_logprobs()) r.pending_lps.pop_back();
    --counters_.generation_tokens_total;
  };
  if (r.allowed_mask && !mask_has(*r.allowed_mask, sr.token)) {
    // A token outside allowed_token_ids: drawn only when every allowed one was banned (stop tokens under
    // min_new_tokens, bad words, a constraint).
    drop_token();
  } else if (sp.constraint && r.constraint_error.empty() &&
      !(stop_token && may_stop && sp.constraint->accepting(r.constraint_state))) {
    try {
      r.constraint_state = sp.constraint->next(r.constraint_state, sr.token);
      if (r.constraint_state == TokenConstraint::kDead) {
        // A token outside the constraint (drawn only when every allowed one was banned, e.g. stop tokens under
        // min_new_tokens).
        drop_token();
      } else {
        const auto& m = *sp.constraint->allowed(r.constraint_state);
        complete = std::all_of(m.begin(), m.end(), [](uint32_t w) { return w == 0; });
      }
    } catch (const std::exception& e) {
      r.constraint_error = e.what();
    }
  }
  if (!r.constraint_error.empty()) {
    f.kind = FinishKind::Abort;
    f.message = "structured output: " + r.constraint_error;
  } else if (may_stop && stop_token && !dropped) {
    f.kind = FinishKind::Stop;
    f.matched_token = sr.token;
  } else if (complete) {
    f.kind = FinishKind::Stop;
  } else if (static_cast<int32_t>(r.output.size()) >= sp.max_new_tokens ||
             static_cast<int64_t>(r.fill.size()) - r.in_flight >= cfg_.context_len) {
    f.kind = FinishKind::Length;
  }
  if (f.kind != FinishKind::None) {
    // Ended before the last of a run of kept drafts: the cache holds the tokens before this one (else a no-op).
    r.kv_len = std::min(r.kv_len, static_cast<int32_t>(r.fill.size()) - 1);
    finish(r, f);
  }
}

void Scheduler::abort_all(const FinishReason& reason) {
  while (!waiting_.empty()) abort(waiting_.front()->rid, reason);
  for (auto& r : running_)
    if (r->state != ReqState::Finished) finish(*r, reason);
  erase_finished();
}

void Scheduler::retract_all() {
  std::vector<Req*> victims;
  for (auto& r : running_)
    if (r->state != ReqState::Finished) victims.push_back(r.get());
  // The last first: each goes to the front of the queue, so the first ends up first.
  for (auto it = victims.rbegin(); it != victims.rend(); ++it) retract_to_waiting(**it);
  erase_finished();
}

bool Scheduler::flush_cache() { return num_running() == 0 && empty_cache(); }

bool Scheduler::empty_cache() {
  // Copies no step has taken yet (a waiting request's loads, evictions' saves) concern only what is dropped; taking
  // them here also unpins the edges being loaded.
  (void)cache_.take_copies();
  return cache_.reset();
}

RankStats Scheduler::stats() const {
  RankStats s = counters_;
  s.kv_tokens_total = static_cast<int64_t>(pool_.num_pages()) * cfg_.page_size;
  s.kv_tokens_free = static_cast<int64_t>(pool_.num_free()) * cfg_.page_size;
  s.kv_tokens_cached = static_cast<int64_t>(cache_.evictable_pages()) * cfg_.page_size;
  s.kv_host_tokens_total = static_cast<int64_t>(cache_.host_slots()) * cfg_.page_size;
  s.kv_host_tokens_cached = static_cast<int64_t>(cache_.host_cached_slots()) * cfg_.page_size;
  s.num_running_reqs = num_running();
  s.num_queue_reqs = num_waiting();
  return s;
}

void Scheduler::check_integrity() const {
  pool_.check_integrity();
  cache_.check_integrity();
  // Pages: free + cached + owned by requests (beyond their cached prefix) == all, with no overlap.
  std::set<int32_t> owned;
  int chunked = 0;
  for (const auto& r : running_) {
    if (r->state == ReqState::Finished) {
      MLA_CHECK(r->pages.empty(), "scheduler: finished request {} still holds pages", r->rid);
      continue;
    }
    if (r->state == ReqState::Prefilling) ++chunked;
    MLA_CHECK(static_cast<int64_t>(r->pages.size()) * cfg_.page_size >= r->kv_len,
              "scheduler: request {} holds {} pages for {} tokens", r->rid, r->pages.size(), r->kv_len);
    for (size_t i = static_cast<size_t>(r->prefix_pages); i < r->pages.size(); ++i)
      MLA_CHECK(owned.insert(r->pages[i]).second, "scheduler: page {} owned twice", r->pages[i]);
  }
  for (const auto& r : waiting_) MLA_CHECK(r->pages.empty(), "scheduler: waiting request {} holds pages", r->rid);
  MLA_CHECK(chunked <= 1, "scheduler: {} requests mid-prefill", chunked);
  MLA_CHECK(static_cast<int32_t>(owned.size()) + pool_.num_free() + cache_.cached_pages() == pool_.num_pages(),
            "scheduler: page accounting broken: {} owned + {} free + {} cached != {}", owned.size(), pool_.num_free(),
            cache_.cached_pages(), pool_.num_pages());
}

}  // namespace mlaserve
