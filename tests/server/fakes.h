// Test doubles for the server's unit tests (not used by the product):
// - ByteCodec: a byte-level "tokenizer": ids 0..255 are bytes, 256 = <bos>, 257 = <eos>.
// - FakeEngine: an EngineClient whose requests generate their own prompt bytes again, cyclically (without the
//   BOS), one token per 1 ms step (or `tokens_per_output` per output); a prompt byte '#' comes out as <eos>.
//   It keeps KV accounting (prompt + generated tokens held per live request) so leaks show in stats().
#pragma once

#include <atomic>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/engine_api.h"
#include "server/text_codec.h"

namespace mlaserve::test {

constexpr int32_t kBos = 256, kEos = 257;

class ByteCodec : public server::TextCodec {
 public:
  std::vector<int32_t> encode(const std::string& text, bool add_special) const override {
    std::vector<int32_t> ids;
    if (add_special) ids.push_back(kBos);
    for (unsigned char c : text) ids.push_back(c);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const override {
    std::string bytes;
    for (int32_t id : ids) {
      if (id < 256) bytes.push_back(static_cast<char>(id));
      else if (!skip_special) bytes += id == kBos ? "<bos>" : "<eos>";
    }
    // An incomplete UTF-8 sequence at the end decodes to U+FFFD, as Hugging Face tokenizers do.
    size_t i = bytes.size(), back = 0;
    while (i > 0 && back < 4 && (static_cast<unsigned char>(bytes[i - 1]) & 0xC0) == 0x80) --i, ++back;
    if (i > 0) {
      unsigned char lead = static_cast<unsigned char>(bytes[i - 1]);
      size_t need = lead >= 0xF0 ? 3 : lead >= 0xE0 ? 2 : lead >= 0xC0 ? 1 : 0;
      if (need > back) bytes = bytes.substr(0, i - 1) + "\xEF\xBF\xBD";
    }
    return bytes;
  }
  // chat_template_kwargs: {"prefix": "..."} starts the assistant's turn with it; tools: "[tools:a,b]" first;
  // documents: "[docs:N]" first.
  std::string apply_chat_template(const nlohmann::json& messages, bool add_generation_prompt,
                                  const nlohmann::json& extra) const override {
    std::string s = "<bos>";
    if (extra.contains("documents")) s += fmt::format("[docs:{}]", extra["documents"].size());
    if (extra.contains("tools")) {
      s += "[tools:";
      for (const auto& t : extra["tools"]) s += t["function"]["name"].get<std::string>() + ",";
      s += "]";
    }
    for (const auto& m : messages) {  // tool calls of the history as [calls:name(arguments)|id,...]
      s += fmt::format("[{}]{}", m["role"].get<std::string>(),
                       m["content"].is_string() ? m["content"].get<std::string>() : std::string());
      if (m.contains("tool_call_id")) s += fmt::format("({})", m["tool_call_id"].get<std::string>());
      if (m.contains("tool_calls")) {
        s += "[calls:";
        for (const auto& c : m["tool_calls"])
          s += fmt::format("{}({})|{},", c["function"]["name"].get<std::string>(),
                           c["function"]["arguments"].get<std::string>(), c["id"].get<std::string>());
        s += "]";
      }
    }
    if (add_generation_prompt) s += "[assistant]" + extra.value("prefix", std::string());
    return s;
  }
  // A request's own template: "<bos>{SOURCE}" and the messages' text ("{% bad" fails as a template that does not
  // parse).
  std::string apply_chat_template_source(const std::string& source, const nlohmann::json& messages, bool,
                                         const nlohmann::json&) const override {
    if (source == "{% bad") throw std::runtime_error("unexpected end of template");
    std::string s = "<bos>{" + source + "}";
    for (const auto& m : messages) s += m["content"].is_string() ? m["content"].get<std::string>() : std::string();
    return s;
  }
  std::string name_or_path() const override { return "bytes"; }
  size_t vocab_size() const override { return 258; }
};

class FakeEngine : public EngineClient {
 public:
  explicit FakeEngine(int64_t context_len = 4096, int64_t kv_tokens = 1 << 20, int tokens_per_output = 1)
      : context_len_(context_len), kv_total_(kv_tokens), tokens_per_output_(tokens_per_output) {
    thread_ = std::thread([this] { loop(); });
  }
  ~FakeEngine() override { shutdown(); }

  void submit(GenerateRequest req) override {
    MLA_CHECK(!req.input_ids.empty(), "empty prompt");
    MLA_CHECK(static_cast<int64_t>(req.input_ids.size()) < context_len_, "prompt too long");
    std::lock_guard lk(mu_);
    MLA_CHECK(!live_.count(req.rid), "duplicate rid '{}'", req.rid);
    Live l;
    l.req = std::move(req);
    for (int32_t id : l.req.input_ids)
      if (id != kBos) l.script.push_back(id);
    if (l.script.empty()) l.script.push_back('x');
    held_ += static_cast<int64_t>(l.req.input_ids.size());
    submitted_.push_back(l.req.rid);
    inputs_[l.req.rid] = l.req.input_ids;
    priorities_.push_back(l.req.priority);
    live_.emplace(l.req.rid, std::move(l));
    cv_.notify_all();
  }

  void abort(const std::string& rid, FinishReason reason) override {
    std::function<void(const GenerateOutput&)> cb;
    GenerateOutput out;
    {
      std::lock_guard lk(mu_);
      auto it = live_.find(rid);
      if (it == live_.end()) return;
      aborted_.push_back(rid);
      out = final_output(it->second, reason);
      cb = std::move(it->second.req.on_output);
      release(it);
    }
    cb(out);
  }

  std::vector<RankStats> stats() const override {
    std::lock_guard lk(mu_);
    RankStats s;
    s.kv_tokens_total = kv_total_;
    s.kv_tokens_free = kv_total_ - held_;
    s.num_running_reqs = static_cast<int32_t>(live_.size());
    s.prompt_tokens_total = prompt_tokens_total_;
    s.generation_tokens_total = generation_tokens_total_;
    return {s};
  }
  bool flush_cache() override {
    std::lock_guard lk(mu_);
    return live_.empty();
  }
  // Weight updates are recorded; one from a path holding "broken" fails.
  void update_weights(WeightUpdate u, std::function<void(const WeightUpdateResult&)> done) override {
    const bool ok = u.model_path.find("broken") == std::string::npos;
    std::string previous;
    {
      std::lock_guard lk(mu_);
      previous = weights_;
      if (ok) weights_ = u.model_path;
      updates_.push_back(std::move(u));
    }
    done(WeightUpdateResult{ok, ok ? "" : "cannot read the checkpoint", previous});
  }
  void pause_generation(PauseMode mode, std::function<void(bool)> done) override {
    {
      std::lock_guard lk(mu_);
      pauses_.push_back(mode);
      paused_ = true;
    }
    done(true);
  }
  bool continue_generation() override {
    std::lock_guard lk(mu_);
    paused_ = false;
    return true;
  }
  bool is_paused() const override {
    std::lock_guard lk(mu_);
    return paused_;
  }
  // Memory released and taken again: recorded (true: release), always done.
  void release_memory(std::function<void(const WeightUpdateResult&)> done) override {
    {
      std::lock_guard lk(mu_);
      memory_ops_.push_back(true);
      released_ = true;
    }
    done(WeightUpdateResult{true, "released", {}});
  }
  void resume_memory(std::function<void(const WeightUpdateResult&)> done) override {
    {
      std::lock_guard lk(mu_);
      memory_ops_.push_back(false);
      released_ = false;
    }
    done(WeightUpdateResult{true, "resumed", {}});
  }
  // Expert distribution recording: each operation recorded; refused until set_expert_counts gives the counts a dump
  // returns ([layers * experts]).
  void expert_record(ExpertRecordOp op, std::function<void(const ExpertRecord&)> done) override {
    ExpertRecord r;
    {
      std::lock_guard lk(mu_);
      expert_ops_.push_back(op);
      r.ok = expert_layers_ > 0;
      if (!r.ok) r.message = "expert distribution recording is off";
      if (r.ok && op == ExpertRecordOp::Dump) {
        r.num_layers = expert_layers_;
        r.num_experts = static_cast<int64_t>(expert_counts_.size()) / expert_layers_;
        r.counts = expert_counts_;
      }
    }
    done(r);
  }
  // Profiling: each request recorded; a stop without a start refused, else a trace path in the folder.
  void profile(const ProfileRequest& r, std::function<void(const ProfileResult&)> done) override {
    ProfileResult res;
    {
      std::lock_guard lk(mu_);
      profiles_.push_back(r);
      res.ok = r.start != profiling_;
      if (res.ok) profiling_ = r.start;
      else res.message = r.start ? "a profile is already being recorded" : "no profile is being recorded";
      if (res.ok && !r.start) res.paths.push_back(profiles_.front().output_dir + "/trace.json");
    }
    done(res);
  }
  std::vector<ProfileRequest> profiles() const {
    std::lock_guard lk(mu_);
    return profiles_;
  }
  // /get_weights_by_name: each read recorded (name, rows); answered with set_weights' entries (none: refused).
  void get_weights(std::string name, int64_t rows,
                   std::function<void(const std::vector<WeightValues>&)> done) override {
    std::vector<WeightValues> v;
    {
      std::lock_guard lk(mu_);
      weight_reads_.emplace_back(name, rows);
      v = weight_values_;
    }
    if (v.empty()) {
      v.emplace_back();
      v.back().message = "the model holds no weight named '" + name + "'";
    }
    done(v);
  }
  void set_weights(std::vector<WeightValues> v) {
    std::lock_guard lk(mu_);
    weight_values_ = std::move(v);
  }
  std::vector<std::pair<std::string, int64_t>> weight_reads() const {
    std::lock_guard lk(mu_);
    return weight_reads_;
  }
  void set_expert_counts(int64_t layers, std::vector<int64_t> counts) {
    std::lock_guard lk(mu_);
    expert_layers_ = layers;
    expert_counts_ = std::move(counts);
  }
  std::vector<ExpertRecordOp> expert_ops() const {
    std::lock_guard lk(mu_);
    return expert_ops_;
  }
  bool memory_released() const override {
    std::lock_guard lk(mu_);
    return released_;
  }
  std::vector<bool> memory_ops() const {
    std::lock_guard lk(mu_);
    return memory_ops_;
  }
  std::vector<PauseMode> pauses() const {
    std::lock_guard lk(mu_);
    return pauses_;
  }
  std::vector<WeightUpdate> updates() const {
    std::lock_guard lk(mu_);
    return updates_;
  }
  int64_t max_context_len() const override { return context_len_; }
  int64_t hidden_size() const override { return kHiddenSize; }
  std::vector<int32_t> eos_token_ids() const override { return {kEos}; }
  void shutdown() override {
    {
      std::lock_guard lk(mu_);
      if (stop_) return;
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  size_t num_live() const {
    std::lock_guard lk(mu_);
    return live_.size();
  }
  std::vector<std::string> aborted() const {
    std::lock_guard lk(mu_);
    return aborted_;
  }
  std::vector<std::string> submitted() const {
    std::lock_guard lk(mu_);
    return submitted_;
  }
  // The prompt request `rid` was submitted with (empty if none was).
  std::vector<int32_t> input_ids(const std::string& rid) const {
    std::lock_guard lk(mu_);
    const auto it = inputs_.find(rid);
    return it == inputs_.end() ? std::vector<int32_t>{} : it->second;
  }
  // GenerateRequest::priority of each submitted request, in order.
  std::vector<int32_t> priorities() const {
    std::lock_guard lk(mu_);
    return priorities_;
  }
  std::atomic<int> step_delay_ms{1};
  // The fake hidden state at position p.
  static constexpr int32_t kHiddenSize = 3;
  static std::vector<float> fake_hidden_row(int32_t p) {
    return {static_cast<float>(p), static_cast<float>(p) + 0.5f, -0.1f * static_cast<float>(p)};
  }
  // The fake routed experts at position p (two layers of two, the first dense).
  static std::vector<int32_t> fake_route_row(int32_t p) { return {0, 0, p % 7, 1000 + p}; }

 private:
  static void append_route_row(std::vector<int32_t>& out, int32_t p) {
    const std::vector<int32_t> row = fake_route_row(p);
    out.insert(out.end(), row.begin(), row.end());
  }
  static void append_hidden_row(std::vector<float>& out, int32_t p) {
    const std::vector<float> row = fake_hidden_row(p);
    out.insert(out.end(), row.begin(), row.end());
  }
  struct Live {
    GenerateRequest req;
    std::vector<int32_t> script;
    int32_t generated = 0;
  };

  GenerateOutput final_output(const Live& l, FinishReason reason) {
    GenerateOutput out;
    out.finished = true;
    out.finish = std::move(reason);
    out.prompt_tokens = static_cast<int32_t>(l.req.input_ids.size());
    out.completion_tokens = l.generated;
    return out;
  }
  void release(std::map<std::string, Live>::iterator it) {
    held_ -= static_cast<int64_t>(it->second.req.input_ids.size()) + it->second.generated;
    prompt_tokens_total_ += static_cast<int64_t>(it->second.req.input_ids.size());
    live_.erase(it);
  }

  void loop() {
    while (true) {
      std::vector<std::pair<std::function<void(const GenerateOutput&)>, GenerateOutput>> outs;
      bool stopping = false;  // (stop_ read under the lock only)
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [this] { return stop_ || !live_.empty(); });
        stopping = stop_;
        if (stopping) {
          for (auto it = live_.begin(); it != live_.end();) {
            FinishReason r;
            r.kind = FinishKind::Abort;
            r.message = "engine shut down";
            outs.emplace_back(it->second.req.on_output, final_output(it->second, r));
            auto next = std::next(it);
            release(it);
            it = next;
          }
        }
        for (auto it = live_.begin(); it != live_.end();) {
          Live& l = it->second;
          GenerateOutput out;
          out.prompt_tokens = static_cast<int32_t>(l.req.input_ids.size());
          if (const int32_t from = l.req.sampling.logprob_start_len; from >= 0 && l.generated == 0) {
            // Prompt logprobs: position p's is -p / 10 (none at 0), alternatives as for generated tokens.
            for (size_t p = static_cast<size_t>(from); p < l.req.input_ids.size(); ++p) {
              TokenLogprob lp;
              lp.token = l.req.input_ids[p];
              lp.logprob = p == 0 ? std::numeric_limits<float>::quiet_NaN() : -0.1f * static_cast<float>(p);
              lp.rank = p == 0 ? 0 : 1 + static_cast<int32_t>(p % 3);
              for (int k = 0; p > 0 && k < l.req.sampling.top_logprobs_num; ++k)
                lp.top.emplace_back((lp.token + k) % 256, -0.5f * static_cast<float>(k));
              out.prompt_logprobs.push_back(lp);
            }
          }
          // return_hidden_states: rows of kHiddenSize (fake_hidden_row) at every prompt position with the first output,
          // then one per token after the first (the row at the previous token's position, which drew it).
          // return_routed_experts: the same positions' fake_route_row.
          const bool hidden = l.req.sampling.return_hidden_states, routes = l.req.sampling.return_routed_experts;
          const int32_t P = static_cast<int32_t>(l.req.input_ids.size());
          if (hidden) out.hidden_size = kHiddenSize;
          for (int32_t p = 0; l.generated == 0 && p < P; ++p) {
            if (hidden) append_hidden_row(out.hidden_states, p);
            if (routes) append_route_row(out.routed_experts, p);
          }
          if (l.req.sampling.max_new_tokens == 0) {
            out.finished = true;
            out.finish.kind = FinishKind::Length;
          }
          for (int t = 0; t < tokens_per_output_ && !out.finished; ++t) {
            int32_t tok = l.script[static_cast<size_t>(l.generated) % l.script.size()];
            if (tok == '#') tok = kEos;
            ++l.generated;
            ++held_;
            ++generation_tokens_total_;
            out.new_tokens.push_back(tok);
            if (hidden && l.generated >= 2) append_hidden_row(out.hidden_states, P + l.generated - 2);
            if (routes && l.generated >= 2) append_route_row(out.routed_experts, P + l.generated - 2);
            if (l.req.sampling.return_logprob) {
              TokenLogprob lp;
              lp.token = tok;
              lp.logprob = -0.25f * static_cast<float>(l.generated % 4);
              for (int k = 0; k < l.req.sampling.top_logprobs_num; ++k)
                lp.top.emplace_back((tok + k) % 256, -0.5f * static_cast<float>(k));
              // token_ids_logprob: id's logprob -(id % 8) / 8 - P / 16 (P: the prompt's length).
              for (int32_t id : l.req.sampling.token_ids_logprob)
                lp.ids.emplace_back(id, -0.125f * static_cast<float>(id % 8) - 0.0625f * static_cast<float>(P));
              out.new_logprobs.push_back(lp);
            }
            const auto& stops = l.req.sampling.stop_token_ids;
            if (tok == kEos && !l.req.sampling.ignore_eos) {
              out.finished = true;
              out.finish.kind = FinishKind::Stop;
              out.finish.matched_token = kEos;
            } else if (std::find(stops.begin(), stops.end(), tok) != stops.end()) {
              out.finished = true;
              out.finish.kind = FinishKind::Stop;
              out.finish.matched_token = tok;
            } else if (l.generated >= l.req.sampling.max_new_tokens) {
              out.finished = true;
              out.finish.kind = FinishKind::Length;
            }
          }
          out.completion_tokens = l.generated;
          outs.emplace_back(l.req.on_output, out);
          auto next = std::next(it);
          if (out.finished) release(it);
          it = next;
        }
      }
      for (auto& [cb, out] : outs) cb(out);
      if (stopping) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(step_delay_ms.load()));
    }
  }

  const int64_t context_len_, kv_total_;
  const int tokens_per_output_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Live> live_;
  std::vector<std::string> aborted_, submitted_;
  std::vector<int32_t> priorities_;
  std::map<std::string, std::vector<int32_t>> inputs_;
  std::vector<WeightUpdate> updates_;
  std::vector<PauseMode> pauses_;
  std::vector<bool> memory_ops_;
  std::vector<ExpertRecordOp> expert_ops_;
  bool released_ = false;
  std::vector<ProfileRequest> profiles_;
  bool profiling_ = false;
  int64_t expert_layers_ = 0;
  std::vector<int64_t> expert_counts_;
  std::vector<WeightValues> weight_values_;
  std::vector<std::pair<std::string, int64_t>> weight_reads_;
  bool paused_ = false;  // (pause_generation records the mode; the fake keeps generating)
  std::string weights_ = "/models/fake";
  int64_t held_ = 0, prompt_tokens_total_ = 0, generation_tokens_total_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace mlaserve::test
