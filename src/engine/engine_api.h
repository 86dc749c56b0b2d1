// The engine's public face: what the server (or any other front end) submits and what it gets back.
// No JSON, no text: token ids in, token ids (+ logprobs) out. Text-level concerns (tokenizing, chat templates,
// detokenizing, stop strings) belong to the front end, which aborts a request with FinishReason::Stop when it
// matches a stop string.
//
// Threading: submit / abort / stats / flush_cache may be called from any thread. `on_output` is called on an
// engine thread: it must be cheap and thread-safe (typically: post to the connection's executor).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mlaserve {

// Constrained decoding (structured output): an automaton over token ids that the front end builds (it knows the
// tokens' text). State 0 is the start; the engine keeps each request's state, asks for the tokens allowed in it
// before every draw and moves it with every generated token. One constraint may serve many requests at once, from
// several engine threads (implementations are thread-safe).
class TokenConstraint {
 public:
  static constexpr int32_t kDead = -1;
  virtual ~TokenConstraint() = default;
  // The tokens allowed next (bit t % 32 of word t / 32; ids past the mask are not allowed). Stop tokens (EOS and
  // stop_token_ids) are never in it: the engine allows them where accepting() holds.
  virtual std::shared_ptr<const std::vector<uint32_t>> allowed(int32_t state) = 0;
  // The state after `token` (kDead if it was not allowed). allowed() and next() may throw (an automaton grown too
  // large): the engine then aborts that request alone.
  virtual int32_t next(int32_t state, int32_t token) = 0;
  // Whether the output may end in `state` (its text so far is a whole match).
  virtual bool accepting(int32_t state) = 0;
};

struct SamplingParams {
  int32_t max_new_tokens = 128;
  float temperature = 1.0f;  // 0: greedy
  float top_p = 1.0f;
  int32_t top_k = -1;  // <= 0: all
  float min_p = 0.0f;
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  // The first min_new_tokens tokens are never a stop token (EOS unless ignore_eos, stop_token_ids: their logits are
  // -inf for those draws), and stop strings are not looked for in their text.
  int32_t min_new_tokens = 0;
  // (token id, bias) added to the token's logit before penalties and temperature (OpenAI logit_bias); ids unique.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // Only these tokens may be drawn (vLLM's allowed_token_ids; stop tokens too only when listed); empty: every token.
  std::vector<int32_t> allowed_token_ids;
  // Token sequences never generated (vLLM's bad_words, tokenized): a sequence's last token is banned wherever the
  // generated tokens end with the rest of it (a one-token sequence is always banned). Under overlap scheduling a
  // request with a sequence of two or more tokens plans its next step only after its previous token is back.
  std::vector<std::vector<int32_t>> bad_words_ids;
  // A reasoning model's thinking budget (SGLang's thinking_budget, vLLM's thinking_token_budget): >= 0: once that many
  // tokens follow an open think_start_ids (the prompt's, or one the model wrote) without think_end_ids, the next draws
  // are think_end_ids, one token each. Under overlap scheduling the draws from the budget on wait for their previous
  // token. -1: no budget.
  int32_t thinking_budget = -1;
  std::vector<int32_t> think_start_ids, think_end_ids;
  std::optional<uint64_t> seed;  // per-request seed: same seed, same prompt -> same sample
  bool return_logprob = false;   // logprob of every generated token
  int32_t top_logprobs_num = 0;  // and the top-N alternatives at each step
  // SGLang's token_ids_logprob: these tokens' logprobs too wherever logprobs are reported (each generated token's,
  // and the prompt positions' of logprob_start_len); like the top-N ones, of the model's log-softmax.
  std::vector<int32_t> token_ids_logprob;
  // >= 0: also the logprob of every prompt token from this position on, given the tokens before it (the raw
  // model's log-softmax), with top_logprobs_num alternatives; position 0 has none (NaN). Prompt tokens served from
  // the prefix cache are computed again from there. -1: none.
  int32_t logprob_start_len = -1;
  // Structured output: only tokens the constraint allows are drawn, and a stop token only where it accepts (the
  // request then ends there; with ignore_eos, or when nothing else is allowed, it ends once its text is complete).
  // Under overlap scheduling such a request's next step is planned only after its previous token is back.
  std::shared_ptr<TokenConstraint> constraint;
  // SGLang's return_hidden_states: the model's last hidden state (after its final norm: what lm_head reads) at every
  // prompt position and at every generated token's position but the last, i.e. of each row whose logits drew the
  // next token (GenerateOutput::hidden_states). Prompt tokens served from the prefix cache are computed again.
  bool return_hidden_states = false;
  // SGLang's return_routed_experts (the engine must capture them: EngineClient::captures_routes): the routed expert
  // ids of the same positions, every layer's (GenerateOutput::routed_experts).
  bool return_routed_experts = false;
  // Whether the request's positions' rows come back (hidden states or routed experts).
  bool wants_rows() const { return return_hidden_states || return_routed_experts; }

  // Whether each generated token's logprob is reported, and whether its logits must reach the host for that.
  bool wants_logprobs() const { return return_logprob || top_logprobs_num > 0; }
  bool wants_host_logits() const { return top_logprobs_num > 0 || (return_logprob && !token_ids_logprob.empty()); }

  // The tokens that end the text: stop_token_ids, and the model's EOS ids unless ignore_eos.
  std::vector<int32_t> stop_tokens(const std::vector<int32_t>& eos) const {
    std::vector<int32_t> stops = stop_token_ids;
    if (!ignore_eos) stops.insert(stops.end(), eos.begin(), eos.end());
    return stops;
  }
  bool is_stop_token(const std::vector<int32_t>& eos, int32_t id) const {
    auto in = [id](const std::vector<int32_t>& v) { return std::find(v.begin(), v.end(), id) != v.end(); };
    return in(stop_token_ids) || (!ignore_eos && in(eos));
  }
};

enum class FinishKind { None, Length, Stop, Abort };

struct FinishReason {
  FinishKind kind = FinishKind::None;
  // Stop: the matched stop token id (matched_token >= 0) or stop string (front end); Abort: a message.
  int32_t matched_token = -1;
  std::string matched_text;
  std::string message;
};

struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // top_logprobs_num alternatives, best first
  std::vector<std::pair<int32_t, float>> ids;  // token_ids_logprob's, in that order
  int32_t rank = 0;  // 1 + the number of tokens more likely than `token` (0: not computed)
};

struct GenerateOutput {
  std::vector<int32_t> new_tokens;  // generated since the previous output of this request
  std::vector<TokenLogprob> new_logprobs;  // parallel to new_tokens when return_logprob
  // With logprob_start_len >= 0: prompt positions [logprob_start_len, prompt length), all in one output (the one
  // that brings the first token, or the last output of a request that generates none).
  std::vector<TokenLogprob> prompt_logprobs;
  // With return_hidden_states: rows of hidden_size floats, row-major, of the positions reported since the previous
  // output (a request's rows in all: its prompt's, then one per generated token but the last).
  std::vector<float> hidden_states;
  int32_t hidden_size = 0;
  // With return_routed_experts: the same positions' routed experts, [rows, num_hidden_layers, num_experts_per_tok]
  // row-major (dense layers 0, as SGLang's).
  std::vector<int32_t> routed_experts;
  bool finished = false;
  FinishReason finish;
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;  // total so far
  int32_t cached_tokens = 0;      // prompt tokens served from the prefix cache
};

// Prefill / decode disaggregation (vLLM's kv_transfer_params): latent KV rows of a prompt's first tokens, read out of
// one server's prefix cache (EngineClient::export_kv) and handed to another with the request (GenerateRequest::
// kv_prefix), which caches them and computes only the rest of the prompt.
// The most bytes of rows one EngineClient::export_kv call reads (a longer prefix is read on from its `end`).
inline constexpr size_t kMaxKvExportBytes = size_t{64} << 20;
// The bytes an export leaves before its rows (KvRows::offset): room for the answer's header line, which
// server/kv_transfer.h writes there so that the rows go out without a copy.
inline constexpr size_t kKvExportHeaderRoom = 512;
struct KvRows {
  int32_t begin = 0, end = 0;  // the tokens [begin, end) these rows hold
  int32_t cached = 0;          // export_kv: the length of the prefix cached there (end <= cached)
  int64_t layers = 0;          // the cache's layers (the model's, then the MTP layer's)
  int64_t row_bytes = 0;       // one token's row in one layer
  std::string dtype;           // the cache's element type (dtype_name)
  // The rows in token order, [end - begin][layers][row_bytes] (each token's rows of every layer together, whatever
  // the page size), at bytes[offset, size): the bytes before them are an export's header room, or the header line
  // an answer came with.
  std::string bytes;
  size_t offset = 0;
  std::string error;  // export_kv: why nothing could be read (empty: fine)
  int64_t token_bytes() const { return layers * row_bytes; }
  const char* rows() const { return bytes.data() + offset; }
  size_t rows_size() const { return bytes.size() - offset; }
  bool same_layout(const KvRows& o) const { return layers == o.layers && row_bytes == o.row_bytes && dtype == o.dtype; }
};
// A prompt's rows handed to a server with its request: consecutive parts (one per read), from token 0 or from what
// that server had cached itself.
using KvPrefix = std::vector<KvRows>;

struct GenerateRequest {
  std::string rid;  // unique among live requests
  std::vector<int32_t> input_ids;
  SamplingParams sampling;
  int32_t data_parallel_rank = -1;  // pin to a DP rank (-1: the controller decides)
  // Without a pinned rank: the DP rank of this live request (whose prefix cache holds what this one shares), if it
  // still runs; empty or finished: the controller decides.
  std::string follow_rid;
  // With priority scheduling (EngineOptions::priority_scheduling): lower values are admitted first (vLLM's
  // convention), and retraction takes the lowest priority first; otherwise it must be 0.
  int32_t priority = 0;
  // vLLM's cache_salt / SGLang's extra_key: the request shares cached prefixes only with requests of the same salt
  // ("": none).
  std::string cache_salt;
  // Rows [begin, end) of input_ids' latent KV computed elsewhere (begin > 0: the tokens before were cached here when
  // they were read; not used if they no longer are): cached before the request is scheduled, so only the rest is
  // computed. Rows of another layout (layers, row bytes, element type) are not used (logged); null: none.
  std::shared_ptr<const KvPrefix> kv_prefix;
  std::function<void(const GenerateOutput&)> on_output;
};

// Per DP rank, for /get_server_info (internal_states) and /metrics.
struct RankStats {
  int64_t kv_tokens_total = 0;
  int64_t kv_tokens_free = 0;    // free pages * page size
  int64_t kv_tokens_cached = 0;  // held only by the prefix cache (evictable)
  int64_t kv_host_tokens_total = 0;   // the hierarchical cache's host tier (0: none)
  int64_t kv_host_tokens_cached = 0;  // of those, holding the prefix cache's evicted pages
  int32_t num_running_reqs = 0;
  int32_t num_queue_reqs = 0;
  int64_t prompt_tokens_total = 0;      // counters since start
  int64_t generation_tokens_total = 0;
  int64_t cached_prompt_tokens_total = 0;
  int64_t host_loaded_tokens_total = 0;  // of those, copied back from the host tier
  int64_t num_requests_finished = 0;
  int64_t num_retractions = 0;
  int64_t forward_steps = 0;
  int64_t overlapped_steps = 0;  // launched before the previous step finished (its ids fed on the device)
  int64_t spec_draft_tokens = 0;     // speculative decoding: draft tokens checked
  int64_t spec_accepted_tokens = 0;  // of those, the ones kept
  int64_t spec_checks = 0;           // request steps that checked drafts
};

// SGLang's /update_weights_from_disk: another checkpoint of the same model loaded into the running weights.
struct WeightUpdate {
  std::string model_path;
  // Abort the running and waiting requests first (else they finish on the old weights before the update).
  bool abort_all_requests = false;
  // Drop the prefix cache afterwards (its KV came from the old weights); SGLang's default.
  bool flush_cache = true;
};
struct WeightUpdateResult {
  bool ok = false;
  std::string message;
  std::string previous_model_path;  // where the weights came from before (when ok)
};

// SGLang's /pause_generation modes, and vLLM's /pause waiting for the requests in flight.
enum class PauseMode {
  Abort,    // the running and waiting requests end (aborted)
  Retract,  // running requests go back to waiting (their KV to the prefix cache); computed again after continuing
  InPlace,  // requests stay as they are and go on after continuing (with the KV they have)
  Drain,    // the requests submitted so far run to their end first
};

// SGLang's expert distribution recorder (/start_expert_distribution_record, /stop_..., /dump_...).
enum class ExpertRecordOp {
  Start,  // counting from zero
  Stop,   // the counts so far kept for the dump; later steps are not counted
  Dump,   // the counts (so far, or until the stop), then zero again (recording goes on if it was on)
};
struct ExpertRecord {
  bool ok = false;
  std::string message;  // why not (ok false)
  // Dump: the routed (token, expert) pairs per layer, [num_layers * num_experts] row-major (dense layers' rows 0).
  int64_t num_layers = 0, num_experts = 0;
  std::vector<int64_t> counts;
  bool recording = false;  // after the operation
};

// SGLang's /get_weights_by_name: the first rows of a checkpoint tensor as the model holds it (one DP rank's).
struct WeightValues {
  bool ok = false;
  std::string message;         // why not (ok false)
  std::vector<int64_t> shape;  // the checkpoint tensor's
  int64_t rows = 0, cols = 0;  // of values (a vector: rows 1, cols its elements read)
  std::vector<float> values;   // [rows, cols] row-major, F32 (the values the model computes with)
};

// SGLang's and vLLM's /start_profile and /stop_profile.
struct ProfileRequest {
  bool start = true;      // false: stop
  std::string output_dir;  // where the trace goes (start)
  int64_t num_steps = 0;   // start: > 0 stops by itself after that many steps
  std::string tag;         // in the trace file's name
};
struct ProfileResult {
  bool ok = false;
  std::string message;
  std::vector<std::string> paths;  // the traces written (a stop, or a start whose num_steps ran out before)
};

class EngineClient {
 public:
  virtual ~EngineClient() = default;
  // Validates and queues; throws mlaserve::Error (a client error) for a bad request, e.g. a prompt longer than
  // the context or empty input.
  virtual void submit(GenerateRequest req) = 0;
  // Frees the request's slot and pages at once; its on_output gets a final output with `finish` (unless it has
  // already finished). Unknown rids are ignored.
  virtual void abort(const std::string& rid, FinishReason reason) = 0;
  virtual std::vector<RankStats> stats() const = 0;
  // Drops every prefix-cache entry not in use. Returns false if requests are running (nothing done).
  virtual bool flush_cache() = 0;
  // Loads u.model_path's weights in place of the running ones once no request runs (those running finish first,
  // unless u.abort_all_requests; requests submitted meanwhile wait for the update). `done` gets the result (on an
  // engine thread; a failed update leaves the previous weights). Default: refused.
  virtual void update_weights(WeightUpdate u, std::function<void(const WeightUpdateResult&)> done) {
    (void)u;
    done(WeightUpdateResult{false, "this engine cannot update its weights", {}});
  }
  // Stops running steps until continue_generation (requests submitted meanwhile wait; a weight update runs at once,
  // requests paused in place keeping their KV); `done` gets whether it paused, once it has (on an engine thread).
  // Default: refused.
  virtual void pause_generation(PauseMode mode, std::function<void(bool)> done) {
    (void)mode;
    done(false);
  }
  // SGLang's /release_memory_occupation: once no request holds KV (running ones finish first; while paused, requests
  // kept in place are an error), the weights' and KV cache's device memory is given back (RankSet::release_memory)
  // and no step runs (requests wait) until resume_memory, which takes it again and loads the weights again. `done`
  // gets the outcome (on an engine thread). Default: refused.
  virtual void release_memory(std::function<void(const WeightUpdateResult&)> done) {
    done(WeightUpdateResult{false, "this engine cannot release its memory", {}});
  }
  virtual void resume_memory(std::function<void(const WeightUpdateResult&)> done) {
    done(WeightUpdateResult{false, "this engine cannot release its memory", {}});
  }
  // Expert distribution recording (EngineArgs::expert_distribution_recorder_mode): `done` gets the outcome (on an
  // engine thread), in order with the steps (a step issued before counts, one after does not). Default: refused.
  virtual void expert_record(ExpertRecordOp op, std::function<void(const ExpertRecord&)> done) {
    (void)op;
    ExpertRecord r;
    r.message = "this engine does not record the experts' distribution";
    done(r);
  }
  // SGLang's /get_weights_by_name: the first `rows` rows (of a vector: elements) of checkpoint tensor `name`, put
  // together from the tensor-parallel ranks (DeepseekModel::read_weight), one entry per DP rank (attention-DP group
  // or --dp replica; each the same tensor); `done` gets them (on an engine thread), after the steps issued before.
  // An entry with ok false says why (no such tensor: its message names it). Default: refused.
  virtual void get_weights(std::string name, int64_t rows, std::function<void(const std::vector<WeightValues>&)> done) {
    (void)name, (void)rows;
    WeightValues v;
    v.message = "this engine cannot read its weights";
    done({v});
  }
  // A trace of the engine's steps (StepTrace) from a start to a stop (or num_steps), and on CUDA the profiler API's
  // capture range (cudaProfilerStart / Stop: nsys --capture-range=cudaProfilerApi). `done` gets the outcome (on an
  // engine thread); a start while recording, or a stop without one, is refused. Default: refused.
  virtual void profile(const ProfileRequest& r, std::function<void(const ProfileResult&)> done) {
    (void)r;
    ProfileResult res;
    res.message = "this engine cannot profile";
    done(res);
  }
  // The latent KV rows of tokens[begin, min(cached, begin + max_tokens)) of the longest prefix of `tokens` cached on
  // the device under `salt` (any DP rank's, or DP rank `rank`'s when >= 0), at most kMaxKvExportBytes of them (at
  // least one token's); `done` gets them, or an error (on an engine thread). max_tokens 0: only `cached` (the step
  // in flight not waited for). Default: refused.
  virtual void export_kv(std::vector<int32_t> tokens, std::string salt, int32_t begin, int32_t max_tokens,
                         std::function<void(KvRows)> done, int32_t rank = -1) {
    (void)tokens, (void)salt, (void)begin, (void)max_tokens, (void)rank;
    KvRows r;
    r.error = "this engine cannot export its KV cache";
    done(std::move(r));
  }
  // Whether the memory is released (release_memory; vLLM's /is_sleeping).
  virtual bool memory_released() const { return false; }
  // Ends a pause (a no-op when not paused); false when not supported.
  virtual bool continue_generation() { return false; }
  virtual bool is_paused() const { return false; }
  // The DP rank (attention-DP group or replica) the load balancer would send a request with this prompt and salt to
  // now (a request submitted with that data_parallel_rank goes there); -1: there is one rank.
  virtual int32_t choose_rank(std::span<const int32_t> prompt, std::string_view salt) {
    (void)prompt, (void)salt;
    return -1;
  }
  virtual int64_t max_context_len() const = 0;
  // The width of return_hidden_states' rows (the model's hidden size); 0: unknown.
  virtual int64_t hidden_size() const { return 0; }
  virtual std::vector<int32_t> eos_token_ids() const = 0;
  // Stops the engine threads; pending requests are aborted.
  virtual void shutdown() = 0;
};

// cache_aware load balancing's thresholds (the names of SGLang's router flags): a request goes to the rank probably
// caching the longest prefix of its prompt while the ranks are balanced (their requests in flight differ by at most
// `abs`, or the most is at most `rel` times the fewest) and that rank caches at least `cache` of the prompt.
struct BalanceThresholds {
  double cache = 0.3;  // --cache-threshold, in [0, 1]
  int64_t abs = 8;     // --balance-abs-threshold, >= 0
  double rel = 1.5;    // --balance-rel-threshold, >= 1
};

// What it takes to build an engine (the server maps SGLang's flags onto this).
struct EngineArgs {
  std::string model_path;
  // vLLM's --hf-overrides / SGLang's --json-model-override-args: a JSON object whose keys replace config.json's.
  std::string model_overrides;
  std::string device = "auto";
  std::string load_format = "auto";
  std::string fp8_experts = "auto";  // FP8 checkpoints' routed experts: auto | on (kept FP8) | off (bf16 at load)
  std::string int4_experts = "auto";  // 4-bit checkpoints' routed experts: auto | on (kept INT4) | off (bf16 at load)
  std::string shared_experts_fusion = "auto";  // auto | on | off (LoadOptions::shared_experts_fusion)
  std::string quantization;          // "fp8": a bf16 checkpoint's routed experts quantized to FP8 at load
  std::string kv_cache_dtype = "auto";  // auto | bf16 | fp8_e4m3 (fp8) | fp8_e5m2: the latent cache's element type
  uint64_t seed = 0;
  int32_t tp_size = 1;
  int32_t dp_size = 1;
  bool enable_dp_attention = false;
  bool expert_parallel = false;  // vLLM's --enable-expert-parallel / SGLang's --ep-size: routed experts split by expert
  std::string load_balance_method = "round_robin";
  BalanceThresholds balance;  // cache_aware's
  int32_t page_size = 16;
  int32_t max_running_requests = 0;  // 0: derived from memory
  int64_t max_total_tokens = 0;      // 0: derived from --mem-fraction-static
  double mem_fraction_static = 0.0;  // 0: backend default
  int32_t chunked_prefill_size = 8192;
  bool disable_radix_cache = false;
  // SGLang's hierarchical cache: the prefix cache keeps pages it evicts from the device in host memory (per rank:
  // hicache_size GiB when > 0, else hicache_ratio times the device's KV pool) and copies them back on a hit.
  bool enable_hierarchical_cache = false;
  double hicache_ratio = 2.0;
  double hicache_size = 0.0;
  bool disable_overlap_schedule = false;
  bool priority_scheduling = false;  // EngineOptions::priority_scheduling
  bool longest_prefix_first = false;  // EngineOptions::longest_prefix_first (SGLang's --schedule-policy lpm)
  bool priority_preemption = false;  // EngineOptions::priority_preemption
  int32_t priority_preemption_threshold = 10;
  int32_t spec_draft_tokens = 0;     // EngineOptions::spec_draft_tokens (n-gram speculative decoding; 0: off)
  bool spec_mtp = false;             // the drafts (spec_draft_tokens 1) come from the checkpoint's MTP layer
  int32_t spec_ngram_min = 1;
  int32_t spec_ngram_max = 3;
  int32_t spec_max_batch = 0;
  // SGLang's --expert-distribution-recorder-mode: "stat" (or "stat_approx", the same here) counts the routed experts
  // per layer for /dump_expert_distribution_record; empty: off.
  std::string expert_distribution_recorder_mode;
  bool expert_distribution_record_at_start = false;  // --enable-expert-distribution-metrics: recording from the start
  bool return_routed_experts = false;  // --enable-return-routed-experts: requests may ask for their routed experts
  int32_t cuda_graph_max_bs = 256;   // decode steps up to this many tokens per DP group replay CUDA graphs
  bool disable_cuda_graph = false;
  int64_t context_length = 0;        // 0: config's max_position_embeddings
  std::vector<int32_t> extra_eos_token_ids;  // e.g. from generation_config.json
  // Several nodes (one process each): node 0 runs the engine, other nodes serve its steps.
  int32_t nnodes = 1;
  int32_t node_rank = 0;
  std::string dist_init_addr;
  double dist_timeout_s = 120.0;
  // GPUs: local rank i of DP replica r runs on device base_gpu_id + (r * tp_size + i) * gpu_id_step (SGLang's
  // --base-gpu-id / --gpu-id-step).
  int32_t base_gpu_id = 0;
  int32_t gpu_id_step = 1;
};

std::unique_ptr<EngineClient> make_engine(const EngineArgs& args);
// On nodes other than 0: load this node's ranks and serve node 0's steps until it shuts down.
void run_follower_node(const EngineArgs& args);

}  // namespace mlaserve
