// GenerationJob: one front-end request turned into engine requests (one per prompt and sample: n > 1 and
// batches expand here), and the engine's token outputs turned back into text. The job runs on one executor
// (a connection's strand): the engine's on_output only posts there, and detokenizing, stop-string matching and
// the caller's callbacks all happen on that executor, never on an engine thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine_api.h"
#include "server/metrics.h"
#include "server/text_stream.h"

namespace mlaserve::server {

using Clock = std::chrono::steady_clock;
using Executor = std::function<void(std::function<void()>)>;  // runs a function later, serialized

struct JobPrompt {
  std::vector<int32_t> input_ids;
  std::string text;  // the prompt's text when known (echo)
  std::vector<int32_t> token_ids_logprob;  // this prompt's sampling.token_ids_logprob
  bool return_hidden_states = false;       // this prompt's sampling.return_hidden_states
  bool return_routed_experts = false;      // and return_routed_experts
  std::string cache_salt;  // GenerateRequest::cache_salt (the request's, or in a batch SGLang's extra_key's own)
  // Its prefix's latent rows from a prefill server (GenerateRequest::kv_prefix, with its first sample); null: none.
  std::shared_ptr<const KvPrefix> kv_prefix;
  // The DP rank its first sample is sent to (GenerateRequest::data_parallel_rank; the others follow it); -1: the load
  // balancer's choice at submit.
  int32_t dp_rank = -1;
};

struct JobSpec {
  std::string id;                 // response id; engine rids are id, or id-<k> for more than one choice
  std::vector<JobPrompt> prompts;
  int32_t n = 1;
  SamplingParams sampling;
  std::vector<std::string> stop;  // stop strings
  std::shared_ptr<const StopRegexes> stop_regex;  // SGLang's stop_regex, or null
  bool skip_special_tokens = true;
  bool no_stop_trim = false;      // keep the matched stop string in the text
  int32_t stream_interval = 1;    // on_update once a choice has this many tokens since its last one (or finished)
  int32_t priority = 0;           // GenerateRequest::priority (the engine's convention: lower first)
  std::string follow_rid;         // GenerateRequest::follow_rid of its choices (a session request: its parent)
  int32_t log_level = -1;         // --log-requests: a log line as each choice finishes (-1: none; 2+: its text)
  size_t log_max_len = 0;         // the most bytes of text (or ids) a log line shows (log_excerpt)
};

struct Choice {
  size_t index = 0;         // prompt-major: prompt p, sample s -> p * n + s
  size_t prompt_index = 0;
  std::string rid;
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_tokens = 0;
  std::vector<int32_t> output_ids;
  std::vector<TokenLogprob> logprobs;
  std::vector<TokenLogprob> prompt_logprobs;  // SamplingParams::logprob_start_len >= 0: once the prompt is read
  // SamplingParams::return_hidden_states: the rows so far ([n, hidden_size] row-major: the prompt's, then one per
  // generated token but the last).
  std::vector<float> hidden_states;
  int32_t hidden_size = 0;
  std::vector<int32_t> routed_experts;  // SamplingParams::return_routed_experts: the same rows' [layers, top-k] ids
  std::string text;         // the text shown so far (stop strings never appear in it)
  bool finished = false;
  FinishReason finish;
  Clock::time_point first_token_time{};
  Clock::time_point finish_time{};
};

// What changed in one choice after one engine output: output_ids / logprobs from *_begin on and text from
// text_begin on are new.
struct ChoiceUpdate {
  size_t choice = 0;
  size_t ids_begin = 0;
  size_t logprobs_begin = 0;
  size_t text_begin = 0;
  size_t hidden_begin = 0;  // rows of hidden_states
  size_t routes_begin = 0;  // entries of routed_experts
  bool finished = false;
};

// For request logs: `s` as a JSON string, cut after max_len bytes (at a character's start) with the bytes left out
// counted.
std::string log_excerpt(std::string_view s, size_t max_len);
// The same for token ids (the first max_len).
std::string log_excerpt(const std::vector<int32_t>& ids, size_t max_len);

class GenerationJob : public std::enable_shared_from_this<GenerationJob> {
 public:
  GenerationJob(EngineClient& engine, const TextCodec* codec, ServerMetrics* metrics, Executor post, JobSpec spec);
  ~GenerationJob();

  // Both run on the executor. on_update follows an engine output that finished a choice or brought its tokens since
  // the choice's last update to spec.stream_interval or more (every output that brought tokens at interval 1); the
  // update covers everything since that last one. on_done follows the last choice's finish (once).
  std::function<void(const ChoiceUpdate&)> on_update;
  std::function<void()> on_done;
  // Runs once as the job ends, whichever way: before the last on_update and on_done (so what it records is there when
  // the client has its answer), or from cancel() (the choices then as they stood).
  std::function<void(const GenerationJob&)> on_end;

  // Submits every choice to the engine (call on the executor). A client error from the engine (e.g. a prompt
  // too long) throws mlaserve::Error after aborting the choices already submitted.
  void start();
  // Aborts every unfinished choice (client gone, timeout); no callbacks after this.
  void cancel(const std::string& why);

  const std::vector<Choice>& choices() const { return choices_; }
  const JobSpec& spec() const { return spec_; }
  Clock::time_point start_time() const { return start_time_; }
  bool done() const { return done_; }

 private:
  struct TextState {
    std::unique_ptr<StreamDecoder> detok;  // null without a codec: no text
    StopStringMatcher stop;
    std::string regex_tail;  // stop_regex: the shown text's last StopRegexes::kWindow bytes (and the new text)
  };
  // stop_regex: `shown` appended to choice i's tail; with `search` (min_new_tokens reached) the pattern found there.
  std::optional<std::string> stop_regex_hit(size_t i, const std::string& shown, bool search);
  void handle_output(size_t i, const GenerateOutput& out);
  void submit_choice(size_t i);
  // The held samples after choice `first` (its prompt's first sample) go to the engine.
  void release_siblings(size_t first);
  static constexpr size_t kShareFrom = 64;  // prompt tokens from which n samples share one prefill
  void finish_choice(size_t i, FinishReason reason);

  EngineClient& engine_;
  const TextCodec* codec_;
  ServerMetrics* metrics_;
  Executor post_;
  JobSpec spec_;
  std::vector<Choice> choices_;
  std::vector<TextState> text_;
  std::vector<Clock::time_point> last_token_time_;
  std::vector<ChoiceUpdate> unsent_;  // per choice: where the next update starts
  std::vector<bool> submitted_;
  size_t num_finished_ = 0;
  bool cancelled_ = false;
  bool done_ = false;
  Clock::time_point start_time_;
};

}  // namespace mlaserve::server
