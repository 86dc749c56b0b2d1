#include "server/generation.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "core/log.h"
#include "server/protocol.h"

namespace mlaserve::server {

GenerationJob::GenerationJob(EngineClient& engine, const TextCodec* codec, ServerMetrics* metrics, Executor post,
                             JobSpec spec)
    : engine_(engine), codec_(codec), metrics_(metrics), post_(std::move(post)), spec_(std::move(spec)),
      start_time_(Clock::now()) {
  const size_t total = spec_.prompts.size() * static_cast<size_t>(spec_.n);
  choices_.resize(total);
  text_.reserve(total);
  for (size_t i = 0; i < total; ++i) {
    Choice& c = choices_[i];
    c.index = i;
    c.prompt_index = i / static_cast<size_t>(spec_.n);
    c.rid = total == 1 ? spec_.id : fmt::format("{}-{}", spec_.id, i);
    c.prompt_tokens = static_cast<int32_t>(spec_.prompts[c.prompt_index].input_ids.size());
    text_.push_back({codec_ ? codec_->stream_decoder(spec_.skip_special_tokens) : nullptr,
                     StopStringMatcher(spec_.stop), {}});
  }
  last_token_time_.assign(total, start_time_);
  unsent_.assign(total, ChoiceUpdate{});
  submitted_.assign(total, false);
}

GenerationJob::~GenerationJob() = default;

void GenerationJob::start() {
  const size_t n = static_cast<size_t>(spec_.n);
  for (size_t i = 0; i < choices_.size(); ++i) {
    // n samples of a long prompt: the first goes alone; the others follow its first output, when its prompt's
    // pages are in the prefix cache (computed once instead of n times).
    if (n > 1 && i % n != 0 && spec_.prompts[choices_[i].prompt_index].input_ids.size() >= kShareFrom) continue;
    try {
      submit_choice(i);
    } catch (...) {
      cancel("submit of a sibling request failed");
      throw;
    }
  }
}

void GenerationJob::submit_choice(size_t i) {
  GenerateRequest req;
  req.rid = choices_[i].rid;
  req.input_ids = spec_.prompts[choices_[i].prompt_index].input_ids;
  req.sampling = spec_.sampling;
  req.priority = spec_.priority;
  req.cache_salt = spec_.prompts[choices_[i].prompt_index].cache_salt;
  req.sampling.token_ids_logprob = spec_.prompts[choices_[i].prompt_index].token_ids_logprob;
  req.sampling.return_hidden_states = spec_.prompts[choices_[i].prompt_index].return_hidden_states;
  req.sampling.return_routed_experts = spec_.prompts[choices_[i].prompt_index].return_routed_experts;
  // n samples of one prompt with a seed: each sample its own stream, reproducible as a set.
  if (req.sampling.seed && spec_.n > 1) *req.sampling.seed += i % static_cast<size_t>(spec_.n);
  // A later sample goes to the DP rank of its prompt's first one, whose prefix cache holds the prompt.
  if (const size_t n = static_cast<size_t>(spec_.n); n > 1 && i % n != 0) req.follow_rid = choices_[i - i % n].rid;
  else req.follow_rid = spec_.follow_rid;
  if (i % static_cast<size_t>(spec_.n) == 0) {
    req.kv_prefix = spec_.prompts[choices_[i].prompt_index].kv_prefix;
    req.data_parallel_rank = spec_.prompts[choices_[i].prompt_index].dp_rank;
  }
  // The engine thread only posts: the job's state is touched on the executor alone.
  std::shared_ptr<GenerationJob> self = shared_from_this();
  req.on_output = [self, i](const GenerateOutput& out) {
    self->post_([self, i, out] { self->handle_output(i, out); });
  };
  engine_.submit(std::move(req));
  submitted_[i] = true;
  if (metrics_) ++metrics_->generate_requests_total;
}

void GenerationJob::release_siblings(size_t first) {
  const size_t n = static_cast<size_t>(spec_.n);
  for (size_t i = first + 1; i < first + n; ++i) {
    if (submitted_[i] || choices_[i].finished) continue;
    try {
      submit_choice(i);
    } catch (const std::exception& e) {  // the engine refused them now (e.g. shutting down): they end aborted
      FinishReason r;
      r.kind = FinishKind::Abort;
      r.message = e.what();
      for (size_t k = first + 1; k < first + n; ++k)
        if (!choices_[k].finished && !submitted_[k]) finish_choice(k, r);
      return;
    }
  }
}

void GenerationJob::cancel(const std::string& why) {
  if (cancelled_ || done_) return;
  cancelled_ = true;
  on_update = nullptr;
  on_done = nullptr;
  for (size_t i = 0; i < choices_.size(); ++i) {
    if (!submitted_[i] || choices_[i].finished) continue;
    FinishReason r;
    r.kind = FinishKind::Abort;
    r.message = why;
    choices_[i].finished = true;
    choices_[i].finish = r;
    engine_.abort(choices_[i].rid, r);
    if (metrics_) ++metrics_->aborted_requests_total;
  }
  if (auto end = std::move(on_end)) {
    on_end = nullptr;
    end(*this);
  }
}

void GenerationJob::handle_output(size_t i, const GenerateOutput& out) {
  Choice& c = choices_[i];
  if (cancelled_ || c.finished) return;  // outputs racing a stop-string abort or a cancel
  if (const size_t n = static_cast<size_t>(spec_.n); n > 1 && i % n == 0) release_siblings(i);
  const Clock::time_point now = Clock::now();
  c.prompt_tokens = out.prompt_tokens;
  c.cached_tokens = out.cached_tokens;

  const size_t k = out.new_tokens.size();
  if (k > 0) {
    if (c.output_ids.empty()) {
      c.first_token_time = now;
      if (metrics_) metrics_->ttft_seconds.observe(std::chrono::duration<double>(now - start_time_).count());
    } else if (metrics_) {
      // A chunk of k tokens: its latency split evenly over them.
      const double per_token = std::chrono::duration<double>(now - last_token_time_[i]).count() / double(k);
      for (size_t t = 0; t < k; ++t) metrics_->inter_token_latency_seconds.observe(per_token);
    }
    last_token_time_[i] = now;
  }
  c.output_ids.insert(c.output_ids.end(), out.new_tokens.begin(), out.new_tokens.end());
  c.logprobs.insert(c.logprobs.end(), out.new_logprobs.begin(), out.new_logprobs.end());
  c.prompt_logprobs.insert(c.prompt_logprobs.end(), out.prompt_logprobs.begin(), out.prompt_logprobs.end());
  c.hidden_states.insert(c.hidden_states.end(), out.hidden_states.begin(), out.hidden_states.end());
  if (out.hidden_size > 0) c.hidden_size = out.hidden_size;
  c.routed_experts.insert(c.routed_experts.end(), out.routed_experts.begin(), out.routed_experts.end());
  c.completion_tokens = std::max<int32_t>(out.completion_tokens, static_cast<int32_t>(c.output_ids.size()));

  // Text: a matched stop token (EOS or stop_token_ids) is never part of the text.
  std::vector<int32_t> to_decode = out.new_tokens;
  if (out.finished && out.finish.kind == FinishKind::Stop && out.finish.matched_token >= 0 && !to_decode.empty() &&
      to_decode.back() == out.finish.matched_token)
    to_decode.pop_back();
  TextState& ts = text_[i];
  // Stop strings count from the min_new_tokens-th token on (SGLang looks for them once that many were generated).
  const bool search = c.output_ids.size() >= static_cast<size_t>(std::max(spec_.sampling.min_new_tokens, 0));
  const std::string piece = ts.detok ? ts.detok->push(to_decode) : std::string();
  const std::string shown = search ? ts.stop.push(piece) : ts.stop.pass(piece);
  c.text += shown;
  std::optional<std::string> regex_hit;
  if (!ts.stop.matched()) regex_hit = stop_regex_hit(i, shown, search);
  if (regex_hit) {  // SGLang's stop_regex: the text is kept; matched names the pattern
    FinishReason r;
    r.kind = FinishKind::Stop;
    r.matched_text = *regex_hit;
    if (!out.finished) engine_.abort(c.rid, r);
    finish_choice(i, r);
  } else if (ts.stop.matched()) {
    FinishReason r;
    r.kind = FinishKind::Stop;
    r.matched_text = *ts.stop.matched();
    if (spec_.no_stop_trim) c.text += r.matched_text;
    if (!out.finished) engine_.abort(c.rid, r);  // frees the slot now; later outputs are ignored
    finish_choice(i, r);
  } else if (out.finished) {
    c.text += ts.stop.push(ts.detok ? ts.detok->flush() : std::string());
    if (ts.stop.matched()) {
      FinishReason r;
      r.kind = FinishKind::Stop;
      r.matched_text = *ts.stop.matched();
      if (spec_.no_stop_trim) c.text += r.matched_text;
      finish_choice(i, r);
    } else {
      const std::string rest = ts.stop.flush();
      c.text += rest;
      if (auto hit = stop_regex_hit(i, rest, search)) {
        FinishReason r;
        r.kind = FinishKind::Stop;
        r.matched_text = *hit;
        finish_choice(i, r);
      } else {
        finish_choice(i, out.finish);
      }
    }
  }
  // The job's end is recorded before its last update and on_done answer the client (who may act on the answer at once:
  // a session's next turn needs its parent recorded as finished).
  const bool job_done = c.finished && num_finished_ == choices_.size() && !done_;
  if (job_done)
    if (auto end = std::move(on_end)) {
      on_end = nullptr;
      end(*this);
    }
  ChoiceUpdate& u = unsent_[i];
  u.choice = i;
  u.finished = c.finished;
  const size_t due = static_cast<size_t>(std::max(spec_.stream_interval, 1));
  if (on_update && (u.finished || (k > 0 && c.output_ids.size() - u.ids_begin >= due))) {
    on_update(u);
    u.ids_begin = c.output_ids.size();
    u.logprobs_begin = c.logprobs.size();
    u.text_begin = c.text.size();
    u.hidden_begin = c.hidden_size > 0 ? c.hidden_states.size() / static_cast<size_t>(c.hidden_size) : 0;
    u.routes_begin = c.routed_experts.size();
  }
  if (job_done) {
    done_ = true;
    auto done_cb = std::move(on_done);
    on_update = nullptr;
    on_done = nullptr;
    if (done_cb) done_cb();
  }
}

std::optional<std::string> GenerationJob::stop_regex_hit(size_t i, const std::string& shown, bool search) {
  if (!spec_.stop_regex || (shown.empty() && !search)) return std::nullopt;
  std::string& tail = text_[i].regex_tail;
  tail += shown;
  if (tail.size() > StopRegexes::kWindow) {  // keep the last kWindow bytes, from a character's first byte
    size_t cut = tail.size() - StopRegexes::kWindow;
    while (cut < tail.size() && (static_cast<unsigned char>(tail[cut]) & 0xC0) == 0x80) ++cut;
    tail.erase(0, cut);
  }
  if (!search) return std::nullopt;  // (before min_new_tokens; SGLang then searches the earlier text too)
  return spec_.stop_regex->search(tail);
}

std::string log_excerpt(std::string_view s, size_t max_len) {
  size_t keep = std::min(s.size(), max_len);
  while (keep > 0 && keep < s.size() && (static_cast<unsigned char>(s[keep]) & 0xC0) == 0x80) --keep;
  std::string out = nlohmann::json(std::string(s.substr(0, keep))).dump(-1, ' ', false,
                                                                        nlohmann::json::error_handler_t::replace);
  if (keep < s.size()) out += fmt::format("...({} more bytes)", s.size() - keep);
  return out;
}

std::string log_excerpt(const std::vector<int32_t>& ids, size_t max_len) {
  const size_t keep = std::min(ids.size(), max_len);
  std::string out = fmt::format("[{}]", fmt::join(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(keep), ", "));
  if (keep < ids.size()) out += fmt::format("...({} more ids)", ids.size() - keep);
  return out;
}

void GenerationJob::finish_choice(size_t i, FinishReason reason) {
  Choice& c = choices_[i];
  c.finished = true;
  c.finish = std::move(reason);
  c.finish_time = Clock::now();
  if (spec_.log_level >= 0)
    MLA_LOG_INFO("request {} finished: {}, {} prompt tokens ({} cached), {} generated, {:.3f} s{}", c.rid,
                 native_finish_reason(c.finish, static_cast<int32_t>(c.output_ids.size())).dump(), c.prompt_tokens,
                 c.cached_tokens, c.output_ids.size(),
                 std::chrono::duration<double>(c.finish_time - start_time_).count(),
                 spec_.log_level < 2 ? std::string()
                 : codec_            ? ", text " + log_excerpt(c.text, spec_.log_max_len)
                                     : ", output_ids " + log_excerpt(c.output_ids, spec_.log_max_len));
  ++num_finished_;
  if (metrics_) {
    metrics_->e2e_latency_seconds.observe(std::chrono::duration<double>(c.finish_time - start_time_).count());
    metrics_->request_finished(c.finish.kind, c.prompt_tokens, static_cast<int64_t>(c.output_ids.size()));
  }
}

}  // namespace mlaserve::server
