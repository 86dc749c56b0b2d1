// mlaserve serve: the HTTP server (native /generate + OpenAI-compatible API) in front of the engine.
// Flags follow SGLang's launch_server names so existing launch scripts work; a flag that is recognised but whose
// feature is not implemented says so and exits non-zero.
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <algorithm>
#include <limits>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "core/error.h"
#include "core/json_int.h"
#include "core/log.h"
#include "engine/engine_api.h"
#include "io/model_config.h"
#include "model/forward_batch.h"
#include "model/kv_cache.h"
#include "server/api.h"
#include "server/batches.h"
#include "server/http_server.h"
#include "server/text_codec.h"
#include "server/text_stream.h"
#include "server/tool_calls.h"

namespace mlaserve::cli {
namespace {

struct ServeArgs {
  std::string model_path, tokenizer_path, served_model_name;
  std::vector<std::string> served_model_names;  // --served-model-name's (vLLM's: several; the first is the model's)
  std::string weight_version = "default";  // SGLang's --weight-version
  std::string positional_model;      // `serve MODEL` (vLLM's form)
  std::string hf_overrides, json_model_override_args;  // vLLM's / SGLang's config.json overrides (a JSON object)
  std::string model_overrides;                         // resolved: the one of them given
  std::vector<std::string> ignored;  // performance-only flags of SGLang / vLLM given (no effect here)
  std::string host = "127.0.0.1";
  int port = 30000;
  int32_t tp = 1, dp = 1;
  bool enable_dp_attention = false, disable_radix_cache = false, trust_remote_code = false;
  bool hierarchical_cache = false;  // SGLang's --enable-hierarchical-cache (vLLM's --kv-offloading-size)
  double hicache_ratio = 2.0, hicache_size = 0.0, kv_offloading_size = 0.0;
  std::string hicache_write_policy = "write_through_selective";
  bool expert_parallel = false;  // vLLM's --enable-expert-parallel, SGLang's --enable-ep-moe / --ep-size = --tp
  int32_t ep_size = 0;           // SGLang's --ep-size (0: not given)
  std::string load_format = "auto", dtype = "auto", quantization, kv_cache_dtype = "auto";
  std::string expert_recorder_mode;          // SGLang's --expert-distribution-recorder-mode (empty: off)
  bool expert_distribution_metrics = false;  // SGLang's --enable-expert-distribution-metrics: recording from the start
  int64_t expert_recorder_buffer_size = -1;  // SGLang's --expert-distribution-recorder-buffer-size (counts kept whole)
  double mem_fraction_static = 0.0;
  int32_t max_running_requests = 0;
  int64_t max_total_tokens = 0;
  int32_t chunked_prefill_size = 8192;
  int32_t cuda_graph_max_bs = 256;
  bool disable_cuda_graph = false, disable_overlap_schedule = false, enable_metrics = false;
  bool enable_priority_scheduling = false, low_priority_values_first = false;  // SGLang's
  bool disable_priority_preemption = false;                                      // SGLang's
  int32_t priority_preemption_threshold = 10;                                    // SGLang's
  std::string scheduling_policy = "fcfs";                                       // vLLM's
  std::string schedule_policy = "fcfs";                                         // SGLang's
  std::string load_balance_method = "round_robin";
  BalanceThresholds balance;  // cache_aware's
  int32_t nnodes = 1, node_rank = 0;
  std::string dist_init_addr;
  double dist_timeout = 120.0;
  int32_t base_gpu_id = 0, gpu_id_step = 1;
  std::string api_key;
  std::string ssl_certfile, ssl_keyfile, ssl_keyfile_password, ssl_ca_certs;  // TLS (vLLM's and SGLang's flags)
  int ssl_cert_reqs = 0;
  bool ssl_refresh = false;  // vLLM's --enable-ssl-refresh
  std::string allowed_origins = "*";
  std::vector<std::string> origins;  // allowed_origins parsed (at validation)
  std::string device = "auto";
  uint64_t random_seed = 0;
  int32_t page_size = 16;
  int64_t context_length = 0;
  bool skip_tokenizer_init = false;
  int32_t stream_interval = 1;
  int32_t pipeline_parallel_size = 1;  // vLLM's / SGLang's: only 1 (no pipeline stages)
  int32_t max_logprobs = 20;           // vLLM's --max-logprobs: the most top logprobs a request may ask for (-1: any)
  // Requests' sampling defaults: vLLM's --generation-config (auto: the model's generation_config.json, vllm: none, or
  // a folder holding one) and SGLang's --sampling-defaults (model | openai).
  std::string generation_config = "auto", sampling_defaults = "model";
  std::string override_generation_config;  // vLLM's: JSON merged over the generation config's values
  server::SamplingDefaults defaults;       // resolved
  bool stream_output = false;
  bool enable_return_hidden_states = false;
  bool enable_return_routed_experts = false;
  bool allow_auto_truncate = false;
  bool request_id_headers = false;
  bool log_requests = false;  // SGLang's --log-requests, vLLM's --enable-log-requests
  int log_requests_level = 2;  // SGLang's --log-requests-level
  int64_t max_log_len = -1;    // vLLM's --max-log-len (-1: by the level)
  bool return_tokens_as_token_ids = false;  // vLLM's: OpenAI logprobs' tokens as "token_id:ID"
  std::string reasoning_parser;
  std::string tool_call_parser;
  std::string chat_template;
  std::string default_chat_template_kwargs;  // vLLM's: a JSON object of chat template variables
  nlohmann::json default_kwargs = nlohmann::json::object();  // (parsed)
  std::string response_role = "assistant";   // vLLM's --response-role
  bool trust_request_chat_template = false;  // vLLM's: requests' own chat_template taken
  std::string completion_template;
  std::string hicache_storage_backend;  // SGLang's L3 tier below the host tier (not implemented)
  std::string fp8_experts = "auto", int4_experts = "auto", shared_experts_fusion = "auto";
  // Speculative decoding: SGLang's --speculative-algorithm NGRAM and its sizes, or vLLM's --speculative-config JSON.
  std::string speculative_algorithm, speculative_config;
  int32_t speculative_num_draft_tokens = 0;  // 0: the default (4) with an algorithm
  int32_t ngram_min = 1, ngram_max = 3;
  int32_t spec_max_batch = 0;     // --speculative-disable-by-batch-size / vLLM's disable_by_batch_size
  int32_t spec_draft_tokens = 0;  // resolved at validation
  int32_t speculative_num_steps = 0, speculative_eagle_topk = 0;  // SGLang's EAGLE sizes (0: not given)
  bool spec_mtp = false;  // resolved: drafts from the checkpoint's MTP layer
  std::string speculative_draft_model_path;  // SGLang's (vLLM's speculative-config "model"): the model's own, if given
  // mlaserve's own.
  size_t max_body_bytes = 256u << 20;
  int num_http_threads = 0;  // 0: from the machine's cores (auto_http_threads)
  double request_timeout = 0.0;
  std::string kv_transfer_addr;       // prefill / decode disaggregation (ServerOptions::kv_transfer_addr)
  double kv_transfer_timeout = 60.0;
  std::string disaggregation_mode = "null";  // SGLang's (ServerOptions::disaggregation_mode)
  int disaggregation_bootstrap_port = 8998;
  int32_t max_n = 64;
  std::string batch_input, batch_output;  // run-batch
};

// DIR/generation_config.json parsed (null when there is none; discarded when it is not JSON).
nlohmann::json read_generation_config(const std::string& dir) {
  const auto p = std::filesystem::path(dir) / "generation_config.json";
  if (!std::filesystem::exists(p)) return nullptr;
  std::ifstream in(p);
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

// eos_token_id of generation_config.json (int or list), if the file exists.
std::vector<int32_t> generation_config_eos(const std::string& model_path) {
  std::vector<int32_t> ids;
  const nlohmann::json j = read_generation_config(model_path);
  if (!j.is_object() || !j.contains("eos_token_id")) return ids;
  const auto& e = j["eos_token_id"];
  auto add = [&](const nlohmann::json& v) {  // token ids only (a value past 32 bits is left out, not truncated)
    if (const auto id = json_integer(v, 0, std::numeric_limits<int32_t>::max()))
      ids.push_back(static_cast<int32_t>(*id));
  };
  if (e.is_array())
    for (const auto& v : e) add(v);
  else
    add(e);
  return ids;
}

// The sampling defaults in a generation config `j` (temperature, top_p, top_k, min_p, repetition_penalty and
// max_new_tokens: what vLLM takes from it) over `d`; a field of the wrong type or range names `where`.
void read_sampling_defaults(const nlohmann::json& j, const std::string& where, server::SamplingDefaults& d) {
  MLA_CHECK(j.is_object(), "{}: not a JSON object", where);
  auto number = [&](const char* key, double lo, double hi) -> std::optional<double> {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) return std::nullopt;
    MLA_CHECK(it->is_number() && it->get<double>() >= lo && it->get<double>() <= hi,
              "{}: '{}' must be a number in [{}, {}], got {}", where, key, lo, hi, it->dump());
    return it->get<double>();
  };
  if (auto v = number("temperature", 0.0, 100.0)) d.temperature = static_cast<float>(*v);
  if (auto v = number("top_p", 0.0, 1.0)) d.top_p = static_cast<float>(*v);
  if (auto v = number("min_p", 0.0, 1.0)) d.min_p = static_cast<float>(*v);
  if (auto v = number("repetition_penalty", 1e-6, 2.0)) d.repetition_penalty = static_cast<float>(*v);
  if (auto v = number("top_k", -1.0, 1e9)) d.top_k = *v <= 0 ? -1 : static_cast<int32_t>(*v);
  if (auto v = number("max_new_tokens", 1.0, 2147483647.0)) d.max_tokens = static_cast<int32_t>(*v);
}

// The sampling defaults of DIR/generation_config.json, none when it has none.
server::SamplingDefaults generation_config_sampling(const std::string& dir) {
  server::SamplingDefaults d;
  const nlohmann::json j = read_generation_config(dir);
  if (!j.is_null()) read_sampling_defaults(j, (std::filesystem::path(dir) / "generation_config.json").string(), d);
  return d;
}

// The defaults as /get_server_info shows them (and the startup log): {"temperature": 0.6, ...}, the set ones only.
nlohmann::json defaults_json(const server::SamplingDefaults& d) {
  nlohmann::json j = nlohmann::json::object();
  auto shortest = [](float f) { return std::stod(fmt::format("{}", f)); };  // 0.9, not 0.8999999761581421
  if (d.temperature) j["temperature"] = shortest(*d.temperature);
  if (d.top_p) j["top_p"] = shortest(*d.top_p);
  if (d.top_k) j["top_k"] = *d.top_k;
  if (d.min_p) j["min_p"] = shortest(*d.min_p);
  if (d.repetition_penalty) j["repetition_penalty"] = shortest(*d.repetition_penalty);
  if (d.max_tokens) j["max_tokens"] = *d.max_tokens;
  return j;
}

void not_implemented(bool cond, const std::string& what) {
  MLA_CHECK(!cond, "{}: recognised but not implemented yet", what);
}

// Every connection is a file descriptor: lift the soft limit to the hard one (thousands of streams).
void raise_fd_limit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
}

// Progress while the engine loads weights (make_engine blocks): elapsed time on stderr.
class LoadProgress {
 public:
  explicit LoadProgress(std::string what) : what_(std::move(what)), start_(std::chrono::steady_clock::now()) {
    tty_ = ::isatty(STDERR_FILENO);
    thread_ = std::thread([this] { loop(); });
  }
  ~LoadProgress() { finish(); }
  void finish() {
    {
      std::lock_guard lk(mu_);
      if (done_) return;
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
    if (tty_) std::cerr << "\n";
  }
  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  void loop() {
    static const char* spin = "|/-\\";
    std::unique_lock lk(mu_);
    for (int i = 0; !done_; ++i) {
      if (tty_)
        std::cerr << fmt::format("\r{} {} {:.1f} s", what_, spin[i % 4], elapsed()) << std::flush;
      else if (i > 0 && i % 10 == 0)
        MLA_LOG_INFO("{}... {:.0f} s", what_, elapsed());
      cv_.wait_for(lk, std::chrono::milliseconds(500));
    }
  }
  std::string what_;
  std::chrono::steady_clock::time_point start_;
  bool tty_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// Speculative decoding from SGLang's flags or vLLM's --speculative-config: the draft tokens per step and the n-gram
// sizes (spec_draft_tokens stays 0 without either).
void resolve_speculative(ServeArgs& s) {
  std::string algo = s.speculative_algorithm;
  std::transform(algo.begin(), algo.end(), algo.begin(), [](unsigned char c) { return std::toupper(c); });
  int32_t k = s.speculative_num_draft_tokens;
  if (!s.speculative_config.empty()) {
    MLA_CHECK(algo.empty(), "give either --speculative-algorithm or --speculative-config, not both");
    const nlohmann::json j = nlohmann::json::parse(s.speculative_config, nullptr, false);
    MLA_CHECK(j.is_object(), "--speculative-config: '{}' is not a JSON object", s.speculative_config);
    for (const auto& [key, v] : j.items()) {
      auto int_of = [&, key = key, v = v] {
        const auto i = json_integer(v, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max());
        MLA_CHECK(i, "--speculative-config: '{}' must be a 32-bit integer, got {}", key, v.dump());
        return static_cast<int32_t>(*i);
      };
      if (key == "method") {
        MLA_CHECK(v.is_string(), "--speculative-config: 'method' must be a string");
        algo = v.get<std::string>();
        std::transform(algo.begin(), algo.end(), algo.begin(), [](unsigned char c) { return std::toupper(c); });
      } else if (key == "num_speculative_tokens") {
        k = int_of();
        MLA_CHECK(k >= 1, "--speculative-config: 'num_speculative_tokens' must be at least 1, got {}", k);
      } else if (key == "prompt_lookup_min") {
        s.ngram_min = int_of();
      } else if (key == "prompt_lookup_max") {
        s.ngram_max = int_of();
      } else if (key == "disable_by_batch_size") {
        s.spec_max_batch = int_of();
      } else if (key == "model") {
        MLA_CHECK(v.is_string() || v.is_null(), "--speculative-config: 'model' must be a string");
        if (v.is_string()) s.speculative_draft_model_path = v.get<std::string>();
      } else {
        MLA_CHECK(false, "--speculative-config: '{}' is not supported (method, model, num_speculative_tokens, "
                  "prompt_lookup_min, prompt_lookup_max, disable_by_batch_size)", key);
      }
    }
    MLA_CHECK(!algo.empty(), "--speculative-config: 'method' is required");
  }
  if (algo.empty()) {
    MLA_CHECK(s.speculative_draft_model_path.empty(), "--speculative-draft-model-path needs --speculative-algorithm EAGLE");
    MLA_CHECK(s.speculative_num_steps == 0 && s.speculative_eagle_topk == 0,
              "--speculative-num-steps and --speculative-eagle-topk need --speculative-algorithm EAGLE");
    MLA_CHECK(k == 0 && s.spec_max_batch == 0,
              "--speculative-num-draft-tokens and --speculative-disable-by-batch-size need --speculative-algorithm NGRAM");
    return;
  }
  const std::string given = s.speculative_config.empty() ? s.speculative_algorithm : algo;
  if (algo == "EAGLE" || algo == "NEXTN" || algo == "MTP" || algo == "DEEPSEEK_MTP") {
    // The checkpoint's own MTP layer drafts a chain of tokens per step, each from the one before (SGLang's
    // --speculative-num-steps N --speculative-eagle-topk 1 --speculative-num-draft-tokens N + 1, its default for
    // DeepSeek 3 / 1 / 4; vLLM's num_speculative_tokens N, default 1). Its draft model is the checkpoint itself;
    // draft trees (top-k above 1) are not implemented.
    MLA_CHECK(s.speculative_eagle_topk <= 1,
              "speculative decoding {}: --speculative-eagle-topk {} (a draft tree) is not supported; use 1 (a chain of "
              "MTP drafts)", given, s.speculative_eagle_topk);
    const bool vllm = !s.speculative_config.empty();
    int32_t steps = 0;
    if (vllm) {
      steps = k == 0 ? 1 : k;
    } else if (s.speculative_num_steps > 0) {
      steps = s.speculative_num_steps;
      if (k != 0 && k != steps + 1)  // as SGLang does with a top-k of 1
        MLA_LOG_WARN("--speculative-num-draft-tokens {} becomes {} (--speculative-num-steps + 1 with top-k 1)", k,
                     steps + 1);
    } else {
      MLA_CHECK(k == 0 || k >= 2, "speculative decoding {}: --speculative-num-draft-tokens counts the token the drafts "
                "follow, so it must be at least 2, got {}", given, k);
      steps = k == 0 ? 3 : k - 1;
    }
    MLA_CHECK(steps >= 1 && steps <= kMaxMtpChain, "speculative decoding {}: {} MTP drafts per step; 1 to {} are "
              "supported", given, steps, kMaxMtpChain);
    MLA_CHECK(s.spec_max_batch >= 0, "speculative decoding: the batch size that disables it must be >= 0, got {}",
              s.spec_max_batch);
    if (!s.speculative_draft_model_path.empty()) {  // the checkpoint's own MTP layer: the model itself
      std::error_code ec1, ec2;
      const auto draft = std::filesystem::weakly_canonical(s.speculative_draft_model_path, ec1);
      const auto model = std::filesystem::weakly_canonical(s.model_path, ec2);
      MLA_CHECK(!ec1 && !ec2 && draft == model,
                "speculative decoding {}: the draft model '{}' is not the model '{}': MTP drafts come from the model's "
                "own MTP layer, a separate draft checkpoint is not supported",
                given, s.speculative_draft_model_path, s.model_path);
    }
    s.spec_mtp = true;
    s.spec_draft_tokens = steps;
    return;
  }
  MLA_CHECK(s.speculative_draft_model_path.empty(), "speculative decoding {} takes no draft model", given);
  MLA_CHECK(s.speculative_num_steps == 0 && s.speculative_eagle_topk == 0,
            "--speculative-num-steps and --speculative-eagle-topk are EAGLE's (MTP drafts), not {}'s", given);
  MLA_CHECK(algo == "NGRAM",
            "speculative decoding '{}' is not supported: NGRAM (vLLM's \"ngram\") and the checkpoint's MTP layer "
            "(EAGLE / NEXTN, vLLM's \"deepseek_mtp\" / \"mtp\") are",
            given);
  if (k == 0) k = 4;
  MLA_CHECK(k >= 1 && k <= 64, "speculative decoding: the draft tokens per step must be in [1, 64], got {}", k);
  MLA_CHECK(s.spec_max_batch >= 0, "speculative decoding: the batch size that disables it must be >= 0, got {}",
            s.spec_max_batch);
  MLA_CHECK(s.ngram_min >= 1 && s.ngram_max >= s.ngram_min && s.ngram_max <= 64,
            "speculative decoding: the n-gram sizes must satisfy 1 <= min ({}) <= max ({}) <= 64", s.ngram_min,
            s.ngram_max);
  s.spec_draft_tokens = k;
}

// --allowed-origins: a JSON list (vLLM's form, '["https://a.example"]') or origins separated by commas.
std::vector<std::string> parse_origins(const std::string& v) {
  std::vector<std::string> out;
  if (!v.empty() && v.front() == '[') {
    const nlohmann::json j = nlohmann::json::parse(v, nullptr, false);
    MLA_CHECK(j.is_array(), "--allowed-origins: '{}' is not a JSON list", v);
    for (const auto& o : j) {
      MLA_CHECK(o.is_string() && !o.get_ref<const std::string&>().empty(),
                "--allowed-origins: '{}' must list non-empty strings", v);
      out.push_back(o.get<std::string>());
    }
    return out;
  }
  for (size_t start = 0; start <= v.size();) {
    size_t end = v.find(',', start);
    if (end == std::string::npos) end = v.size();
    std::string o = v.substr(start, end - start);
    o.erase(0, o.find_first_not_of(' '));
    o.erase(o.find_last_not_of(' ') + 1);
    if (!o.empty()) out.push_back(std::move(o));
    start = end + 1;
  }
  return out;
}

// The TLS flags into the server's options.
void set_tls(const ServeArgs& a, server::ServerOptions& o) {
  o.ssl_certfile = a.ssl_certfile;
  o.ssl_keyfile = a.ssl_keyfile;
  o.ssl_keyfile_password = a.ssl_keyfile_password;
  o.ssl_ca_certs = a.ssl_ca_certs;
  o.ssl_cert_reqs = a.ssl_cert_reqs;
  o.ssl_refresh = a.ssl_refresh;
}

nlohmann::json server_args_json(const ServeArgs& a) {
  nlohmann::json j;
  j["model_path"] = a.model_path;
  j["tokenizer_path"] = a.tokenizer_path;
  j["served_model_name"] = a.served_model_name;
  j["host"] = a.host;
  j["allowed_origins"] = a.origins;
  j["port"] = a.port;
  j["tp_size"] = a.tp;
  j["dp_size"] = a.dp;
  j["enable_dp_attention"] = a.enable_dp_attention;
  j["ep_size"] = a.expert_parallel ? a.tp : 1;
  j["disable_shared_experts_fusion"] = a.shared_experts_fusion == "off";  // (SGLang's; ours: shared_experts_fusion)
  j["shared_experts_fusion"] = a.shared_experts_fusion;
  j["disable_radix_cache"] = a.disable_radix_cache;
  j["enable_hierarchical_cache"] = a.hierarchical_cache || a.kv_offloading_size > 0.0;
  j["hicache_ratio"] = a.hicache_ratio;
  j["hicache_size"] = a.hicache_size;
  j["hicache_write_policy"] = a.hicache_write_policy;
  j["load_format"] = a.load_format;
  j["dtype"] = a.dtype;
  j["kv_cache_dtype"] = a.kv_cache_dtype;
  j["expert_distribution_recorder_mode"] =
      a.expert_recorder_mode.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.expert_recorder_mode);
  j["enable_expert_distribution_metrics"] = a.expert_distribution_metrics;
  j["expert_distribution_recorder_buffer_size"] = a.expert_recorder_buffer_size;
  j["base_gpu_id"] = a.base_gpu_id;
  j["gpu_id_step"] = a.gpu_id_step;
  j["mem_fraction_static"] = a.mem_fraction_static;
  j["max_running_requests"] = a.max_running_requests;
  j["max_total_tokens"] = a.max_total_tokens;
  j["chunked_prefill_size"] = a.chunked_prefill_size;
  j["stream_interval"] = a.stream_interval;
  j["stream_output"] = a.stream_output;
  j["enable_return_hidden_states"] = a.enable_return_hidden_states;
  j["enable_return_routed_experts"] = a.enable_return_routed_experts;
  j["max_logprobs"] = a.max_logprobs;
  j["allow_auto_truncate"] = a.allow_auto_truncate;
  j["sampling_defaults"] = a.sampling_defaults;
  j["generation_config"] = a.generation_config;
  j["default_sampling_params"] = defaults_json(a.defaults);
  j["load_balance_method"] = a.load_balance_method;
  j["cache_threshold"] = a.balance.cache;
  j["balance_abs_threshold"] = a.balance.abs;
  j["balance_rel_threshold"] = a.balance.rel;
  j["enable_priority_scheduling"] = a.enable_priority_scheduling;
  j["schedule_policy"] = a.schedule_policy;
  j["schedule_low_priority_values_first"] = a.low_priority_values_first;
  j["disable_priority_preemption"] = a.disable_priority_preemption;
  j["priority_scheduling_preemption_threshold"] = a.priority_preemption_threshold;
  j["scheduling_policy"] = a.scheduling_policy;
  j["speculative_algorithm"] = a.spec_mtp ? nlohmann::json("EAGLE")
                              : a.spec_draft_tokens > 0 ? nlohmann::json("NGRAM")
                                                        : nlohmann::json(nullptr);
  // SGLang counts the token a draft follows (EAGLE's draft tokens: steps + 1).
  j["speculative_num_draft_tokens"] = a.spec_mtp ? a.spec_draft_tokens + 1 : a.spec_draft_tokens;
  if (a.spec_mtp) {
    j["speculative_num_steps"] = a.spec_draft_tokens;
    j["speculative_eagle_topk"] = 1;
  }
  j["speculative_ngram_min_match_window_size"] = a.ngram_min;
  j["speculative_ngram_max_match_window_size"] = a.ngram_max;
  j["speculative_disable_by_batch_size"] = a.spec_max_batch;
  j["page_size"] = a.page_size;
  j["context_length"] = a.context_length;
  j["device"] = a.device;
  j["random_seed"] = a.random_seed;
  j["nnodes"] = a.nnodes;
  j["node_rank"] = a.node_rank;
  j["dist_init_addr"] = a.dist_init_addr;
  j["skip_tokenizer_init"] = a.skip_tokenizer_init;
  j["api_key_set"] = !a.api_key.empty();
  j["ssl_certfile"] = a.ssl_certfile.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.ssl_certfile);
  j["ssl_keyfile"] = a.ssl_keyfile.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.ssl_keyfile);
  j["ssl_ca_certs"] = a.ssl_ca_certs.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.ssl_ca_certs);
  j["ssl_cert_reqs"] = a.ssl_cert_reqs;
  j["enable_ssl_refresh"] = a.ssl_refresh;
  j["max_body_bytes"] = a.max_body_bytes;
  j["num_http_threads"] = a.num_http_threads;
  j["request_timeout"] = a.request_timeout;
  j["kv_transfer_addr"] = a.kv_transfer_addr;
  j["kv_transfer_timeout"] = a.kv_transfer_timeout;
  j["disaggregation_mode"] = a.disaggregation_mode;
  j["disaggregation_bootstrap_port"] = a.disaggregation_bootstrap_port;
  return j;
}

// vLLM's run-batch: the requests of an OpenAI batch file (JSONL of {custom_id, method, url, body}) run through the
// server's routes without HTTP (one batch per url: server/batches.h), every answer written to `output` in the input's
// order. Returns the exit code: 1 when the file breaks the batch rules (the errors printed).
int run_batch_file(server::Api& api, const std::string& input, const std::string& output) {
  std::ifstream in(input, std::ios::binary);
  MLA_CHECK(in, "--input-file: cannot read '{}'", input);
  std::vector<std::string> urls;                   // distinct, in order of appearance
  std::map<std::string, std::string> by_url;       // url -> its lines
  std::vector<std::string> order;                  // custom ids in input order
  std::set<std::string> seen;
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    MLA_CHECK(j.is_object() && j.contains("url") && j["url"].is_string() && j.contains("custom_id") &&
                  j["custom_id"].is_string(),
              "{} line {}: expected a JSON object with string 'custom_id' and 'url'", input, n);
    const std::string url = j["url"];
    MLA_CHECK(url == "/v1/chat/completions" || url == "/v1/completions" || url == "/v1/responses",
              "{} line {}: url '{}' is not /v1/chat/completions, /v1/completions or /v1/responses", input, n,
              url.substr(0, 100));
    MLA_CHECK(seen.insert(j["custom_id"].get<std::string>()).second, "{} line {}: custom_id '{}' appears twice", input,
              n, j["custom_id"].get<std::string>());
    if (!by_url.count(url)) urls.push_back(url);
    by_url[url] += line + "\n";
    order.push_back(j["custom_id"]);
  }
  MLA_CHECK(!order.empty(), "{}: no requests", input);
  server::BatchService& svc = api.batches();
  std::map<std::string, std::string> answers;  // custom id -> output line
  bool failed = false;
  for (const std::string& url : urls) {
    const auto file = svc.store_file(input, "batch", std::move(by_url[url]));
    const auto created =
        svc.create_batch({{"input_file_id", file["id"]}, {"endpoint", url}, {"completion_window", "24h"}});
    const auto done = svc.wait(created["id"]);
    if (done["status"] != "completed") {
      failed = true;
      std::cerr << fmt::format("{}: the requests for {} were refused: {}\n", input, url, done["errors"].dump());
      continue;
    }
    for (const char* key : {"output_file_id", "error_file_id"}) {
      if (done[key].is_null()) continue;
      std::istringstream lines(*svc.file_content(done[key]));
      for (std::string l; std::getline(lines, l);)
        answers[nlohmann::json::parse(l)["custom_id"].get<std::string>()] = l;
    }
  }
  if (failed) return 1;
  std::ofstream out(output, std::ios::binary | std::ios::trunc);
  MLA_CHECK(out, "--output-file: cannot write '{}'", output);
  for (const std::string& id : order) out << answers.at(id) << "\n";
  out.close();
  MLA_CHECK(out, "--output-file: writing '{}' failed", output);
  std::cout << fmt::format("mlaserve: {} requests of {} answered into {}", order.size(), input, output) << std::endl;
  return 0;
}

// `serve`, and `run-batch` (the same flags, and an input and output file instead of listening).
Runner serve_setup(CLI::App& app, bool run_batch) {
  auto a = std::make_shared<ServeArgs>();
  if (run_batch) {
    app.add_option("-i,--input-file", a->batch_input, "OpenAI batch file (JSONL requests)")->required();
    app.add_option("-o,--output-file", a->batch_output, "where the answers go (JSONL, in the input's order)")
        ->required();
  }
  app.add_option("--model-path,--model", a->model_path, "checkpoint directory (config.json + safetensors)");
  app.add_option("model", a->positional_model, "the checkpoint directory, as `vllm serve MODEL` takes it");
  app.add_option("--weight-version", a->weight_version,
                 "the weights' version (SGLang's; /get_weight_version, set again by weight updates)")
      ->capture_default_str();
  app.add_option("--hf-overrides", a->hf_overrides,
                 "a JSON object whose keys replace config.json's (vLLM's; e.g. '{\"max_position_embeddings\": 8192}')");
  app.add_option("--json-model-override-args", a->json_model_override_args,
                 "the same, SGLang's name");
  app.add_option("--tokenizer-path,--tokenizer", a->tokenizer_path, "tokenizer directory (default: --model-path)");
  app.add_option("--served-model-name", a->served_model_names,
                 "the model's name in the OpenAI API (default: --model-path); with several (vLLM's), requests may use "
                 "any and /v1/models lists each");
  app.add_option("--host", a->host, "address to listen on")->capture_default_str();
  app.add_option("--port", a->port, "port to listen on (0: any free port)")->capture_default_str();
  app.add_option("--tp,--tp-size,--tensor-parallel-size", a->tp, "tensor parallel size")->capture_default_str();
  app.add_option("--dp,--dp-size,--data-parallel-size", a->dp, "data parallel size")->capture_default_str();
  app.add_flag("--enable-dp-attention", a->enable_dp_attention, "data-parallel attention, tensor-parallel MoE");
  app.add_flag("--enable-expert-parallel,--enable-ep-moe", a->expert_parallel,
               "routed experts split by expert over the --tp ranks instead of by their width (vLLM's, SGLang's)");
  app.add_option("--ep-size,--expert-parallel-size", a->ep_size,
                 "SGLang's: --tp (routed experts split by expert) or 1 (by width)");
  app.add_flag("--disable-radix-cache,--no-enable-prefix-caching", a->disable_radix_cache, "no prefix cache");
  app.add_flag("--enable-hierarchical-cache", a->hierarchical_cache,
               "the prefix cache keeps pages it evicts from the device in host memory and copies them back on a hit");
  app.add_option("--hicache-ratio", a->hicache_ratio, "host tier size: this many times the device's KV pool")
      ->capture_default_str();
  app.add_option("--hicache-size", a->hicache_size, "host tier size per rank in GiB (overrides --hicache-ratio)");
  app.add_option("--hicache-write-policy", a->hicache_write_policy,
                 "write_back | write_through | write_through_selective (pages are written when they leave the "
                 "device, whichever is given)");
  app.add_option("--kv-offloading-size", a->kv_offloading_size,
                 "vLLM's: a host tier of this many GiB over all ranks (the hierarchical cache)");
  app.add_flag("--trust-remote-code", a->trust_remote_code, "accepted for compatibility; no effect");
  app.add_option("--load-format", a->load_format, "auto|safetensors|dummy")->capture_default_str();
  app.add_option("--dtype", a->dtype, "auto|bfloat16")->capture_default_str();
  app.add_option("--quantization", a->quantization,
                 "fp8: quantize a bf16 checkpoint's routed experts to FP8 at load (else only the checkpoint's own)");
  app.add_option("--kv-cache-dtype", a->kv_cache_dtype, kKvCacheDtypeHelp)->capture_default_str();
  app.add_option("--expert-distribution-recorder-mode", a->expert_recorder_mode,
                 "stat (or stat_approx, the same): count the routed experts per layer for "
                 "/start_expert_distribution_record, /stop_... and /dump_... (written to "
                 "$SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, default /tmp)");
  app.add_flag("--enable-expert-distribution-metrics", a->expert_distribution_metrics,
               "record the expert distribution from the start (with --expert-distribution-recorder-mode; SGLang's "
               "defaults to stat)");
  app.add_option("--expert-distribution-recorder-buffer-size", a->expert_recorder_buffer_size,
                 "accepted for compatibility: the counts are kept whole (summed over the recording), not per step");
  app.add_option("--mem-fraction-static,--gpu-memory-utilization", a->mem_fraction_static,
                 "fraction of device memory for weights + KV cache");
  app.add_option("--max-running-requests,--max-num-seqs", a->max_running_requests,
                 "cap on the running batch (0: from memory)");
  app.add_option("--max-total-tokens", a->max_total_tokens, "KV-cache size in tokens (0: from memory)");
  app.add_option("--chunked-prefill-size,--max-num-batched-tokens", a->chunked_prefill_size, "prefill tokens per step")
      ->capture_default_str();
  app.add_option("--cuda-graph-max-bs", a->cuda_graph_max_bs,
                 "largest decode batch (per DP group) recorded as a CUDA graph")
      ->capture_default_str();
  app.add_flag("--disable-cuda-graph,--enforce-eager", a->disable_cuda_graph, "no CUDA graphs");
  app.add_flag("--disable-overlap-schedule", a->disable_overlap_schedule, "no CPU/GPU overlap in the scheduler");
  app.add_flag("--enable-priority-scheduling", a->enable_priority_scheduling,
               "admit waiting requests by their `priority` (higher first), retract the lowest first");
  app.add_flag("--schedule-low-priority-values-first", a->low_priority_values_first,
               "with --enable-priority-scheduling: lower `priority` values first");
  app.add_option("--priority-scheduling-preemption-threshold", a->priority_preemption_threshold,
                 "with --enable-priority-scheduling: a waiting request that does not fit retracts running ones whose "
                 "priority is lower than its own by more than this")
      ->capture_default_str();
  app.add_flag("--disable-priority-preemption", a->disable_priority_preemption,
               "with --enable-priority-scheduling: never retract running requests for waiting ones");
  app.add_option_function<std::string>(
         "--schedule-policy",
         [a](const std::string& v) {
           a->schedule_policy = v;
           if (v != "fcfs" && v != "lpm") a->ignored.push_back("--schedule-policy " + v);
         },
         "SGLang's: fcfs (default) or lpm (waiting requests with the longest cached prefix first, while at most 128 "
         "wait); random, dfs-weight, lof and priority are accepted without effect")
      ->check(CLI::IsMember({"fcfs", "lpm", "random", "dfs-weight", "lof", "priority"}));
  app.add_option("--scheduling-policy", a->scheduling_policy,
                 "fcfs | priority (vLLM's: requests by their `priority`, lower first)")
      ->capture_default_str();
  app.add_flag("--enable-metrics", a->enable_metrics, "accepted for compatibility; /metrics is always on");
  app.add_option("--speculative-algorithm", a->speculative_algorithm,
                 "speculative decoding: NGRAM (drafts from earlier occurrences of the last tokens), or EAGLE / NEXTN "
                 "(drafts from the checkpoint's MTP layer)");
  app.add_option("--speculative-num-steps", a->speculative_num_steps,
                 "EAGLE: chained MTP drafts per step (default 3, or --speculative-num-draft-tokens - 1)");
  app.add_option("--speculative-eagle-topk", a->speculative_eagle_topk, "EAGLE: drafts per step (1: no tree)");
  app.add_option("--speculative-draft-model-path", a->speculative_draft_model_path,
                 "EAGLE: the draft model, the model itself (its MTP layer)");
  app.add_option("--speculative-num-draft-tokens", a->speculative_num_draft_tokens,
                 "draft tokens checked per step (NGRAM: default 4; EAGLE: with the token they follow)");
  app.add_option("--speculative-ngram-min-match-window-size", a->ngram_min,
                 "NGRAM: shortest run of last tokens looked up")
      ->capture_default_str();
  app.add_option("--speculative-ngram-max-match-window-size", a->ngram_max,
                 "NGRAM: longest run of last tokens looked up (tried first)")
      ->capture_default_str();
  app.add_option("--speculative-disable-by-batch-size", a->spec_max_batch,
                 "no drafts in steps with more decoding requests than this (0: no limit)")
      ->capture_default_str();
  app.add_option("--speculative-config", a->speculative_config,
                 "vLLM's: JSON {\"method\": \"ngram\", \"num_speculative_tokens\": k, \"prompt_lookup_min\": n, "
                 "\"prompt_lookup_max\": m}");
  app.add_option("--load-balance-method", a->load_balance_method,
                 "DP load balancing: round_robin, shortest_queue (fewest tokens in flight; minimum_tokens is the "
                 "same) or cache_aware (while the DP ranks are balanced, the one probably caching the longest prefix "
                 "of the prompt)")
      ->check(CLI::IsMember({"round_robin", "shortest_queue", "minimum_tokens", "cache_aware"}))
      ->capture_default_str();
  // (ranges checked by make_engine: check_balance_thresholds)
  app.add_option("--cache-threshold", a->balance.cache,
                 "cache_aware: the share (0-1) of the prompt a DP rank must probably cache for the prompt to go there")
      ->capture_default_str();
  app.add_option("--balance-abs-threshold", a->balance.abs,
                 "cache_aware: the ranks count as balanced while their requests in flight differ by at most this")
      ->capture_default_str();
  app.add_option("--balance-rel-threshold", a->balance.rel,
                 "cache_aware: ... or while the most requests in flight are at most this (>= 1) times the fewest")
      ->capture_default_str();
  app.add_option("--nnodes", a->nnodes, "number of nodes")->capture_default_str();
  app.add_option("--node-rank", a->node_rank, "this node's rank")->capture_default_str();
  app.add_option("--dist-init-addr", a->dist_init_addr, "rendezvous address for multi-node (host:port of node 0)");
  app.add_option("--dist-timeout", a->dist_timeout, "multi-node rendezvous timeout (s)")->capture_default_str();
  app.add_option("--base-gpu-id", a->base_gpu_id, "the first GPU this server uses (SGLang's)")->capture_default_str();
  app.add_option("--gpu-id-step", a->gpu_id_step, "GPUs between the ranks' devices (SGLang's)")->capture_default_str();
  app.add_option("--api-key", a->api_key, "require 'Authorization: Bearer <key>'");
  app.add_option("--ssl-certfile", a->ssl_certfile, "serve HTTPS: the server's PEM certificate (chain)");
  app.add_option("--ssl-keyfile", a->ssl_keyfile, "serve HTTPS: the certificate's PEM private key");
  app.add_option("--ssl-keyfile-password", a->ssl_keyfile_password, "the password of an encrypted --ssl-keyfile");
  app.add_option("--ssl-ca-certs", a->ssl_ca_certs, "PEM CA certificates that client certificates are checked against");
  app.add_flag("--enable-ssl-refresh", a->ssl_refresh,
               "new connections use the certificate files as they are now when they changed (vLLM's)");
  app.add_option("--ssl-cert-reqs", a->ssl_cert_reqs,
                 "client certificates: 0 not asked (default), 1 checked when given, 2 required (Python's ssl.CERT_*)")
      ->capture_default_str();
  app.add_option("--allowed-origins", a->allowed_origins,
                 "browser origins given CORS headers: '*' (default), origins separated by commas or a JSON list, "
                 "or '' for none")
      ->capture_default_str();
  app.add_option("--device", a->device, "auto|cpu|cuda")->capture_default_str();
  app.add_option("--random-seed,--seed", a->random_seed, "seed (dummy weights, sampling)")->capture_default_str();
  app.add_option("--page-size,--block-size", a->page_size, "tokens per KV-cache page")->capture_default_str();
  app.add_option("--context-length,--max-model-len", a->context_length, "context length (0: the model's)");
  app.add_flag("--skip-tokenizer-init", a->skip_tokenizer_init, "no tokenizer: token ids in and out only");
  app.add_option("--generation-config", a->generation_config,
                 "requests' default temperature / top_p / top_k / min_p / repetition_penalty: auto (the model's "
                 "generation_config.json), vllm (none), or a folder holding a generation_config.json")
      ->capture_default_str();
  app.add_option("--override-generation-config", a->override_generation_config,
                 "JSON over the generation config's values, e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 512}' "
                 "(with --generation-config vllm: the only ones)");
  app.add_option("--sampling-defaults", a->sampling_defaults,
                 "model (the model's generation_config.json, as --generation-config auto) | openai (none)")
      ->capture_default_str();
  app.add_option("--max-logprobs", a->max_logprobs,
                 "the most top logprobs (or prompt logprobs' alternatives) a request may ask for (-1: no limit)")
      ->capture_default_str();
  app.add_option("--pipeline-parallel-size,--pp-size", a->pipeline_parallel_size, "pipeline stages (1)")
      ->capture_default_str();
  app.add_option("--stream-interval", a->stream_interval, "tokens per streamed chunk (>= 1)")->capture_default_str();
  app.add_flag("--return-tokens-as-token-ids", a->return_tokens_as_token_ids,
               "OpenAI logprobs name tokens \"token_id:ID\" (a request's return_tokens_as_token_ids wins), as vLLM's");
  app.add_flag("--log-requests,--enable-log-requests", a->log_requests,
               "log each generation request as it arrives and as it finishes (SGLang's / vLLM's names)");
  app.add_option("--log-requests-level", a->log_requests_level,
                 "what --log-requests shows: 0 shape and counts, 1 and sampling parameters, 2 and prompt / output "
                 "text (first 2048 bytes), 3 all of it (SGLang's)")
      ->check(CLI::Range(0, 3))
      ->capture_default_str();
  app.add_option("--max-log-len", a->max_log_len,
                 "the most bytes of prompt / output text (or token ids) a request log line shows (vLLM's)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--enable-request-id-headers", a->request_id_headers,
               "responses carry X-Request-Id (the request's own, else a new one), as vLLM's");
  app.add_flag("--allow-auto-truncate", a->allow_auto_truncate,
               "a prompt too long for the context keeps its first tokens instead of a 400 (SGLang's)");
  app.add_flag("--stream-output", a->stream_output,
               "streamed /generate chunks carry only what is new (text, output_ids, logprobs), as SGLang's");
  app.add_flag("--enable-return-hidden-states", a->enable_return_hidden_states,
               "requests may ask for return_hidden_states: the final hidden state of every position, as SGLang's");
  app.add_flag("--enable-return-routed-experts", a->enable_return_routed_experts,
               "requests may ask for return_routed_experts: every position's routed experts per layer, as SGLang's");
  app.add_option("--reasoning-parser", a->reasoning_parser,
                 "split chat output into reasoning_content and content (deepseek-r1; deepseek-v3: V3.1's, when "
                 "chat_template_kwargs turn thinking on; kimi_k2: an output that opens <think>; or vLLM's "
                 "deepseek_r1 / deepseek_v3)");
  app.add_option("--tool-call-parser", a->tool_call_parser,
                 "parse tool calls out of chat output (deepseekv3; deepseekv31: V3.1's call form for tool_choice; "
                 "kimi_k2: Kimi-K2's)");
  app.add_option("--chat-template", a->chat_template, "a Jinja chat template file replacing the tokenizer's");
  app.add_option("--default-chat-template-kwargs", a->default_chat_template_kwargs,
                 "a JSON object of chat template variables every chat request has unless it sets them, e.g. "
                 "'{\"thinking\": true}' (vLLM's)");
  app.add_option("--response-role", a->response_role, "the role chat answers are given (vLLM's)")
      ->capture_default_str();
  app.add_flag("--trust-request-chat-template", a->trust_request_chat_template,
               "chat requests may bring their own Jinja template (chat_template), as vLLM's; refused otherwise");
  app.add_option("--hicache-storage-backend", a->hicache_storage_backend,
                 "SGLang's storage tier below the host tier (file, mooncake, ...): recognised, not implemented");
  app.add_option("--completion-template", a->completion_template,
                 "deepseek_coder: completions' suffix as DeepSeek's fill in the middle (always on with its tokens)");
  app.add_option("--fp8-experts", a->fp8_experts,
                 "FP8 routed experts: auto|on (kept FP8: half the memory)|off (bf16 at load)")
      ->capture_default_str();
  app.add_option("--int4-experts", a->int4_experts,
                 "4-bit routed experts (AWQ, GPTQ, compressed-tensors): auto|on (kept INT4; auto: on)|off (bf16)")
      ->capture_default_str();
  app.add_option("--shared-experts-fusion", a->shared_experts_fusion,
                 "shared experts read as more routed experts: auto (where the routed experts are kept INT4)|on|off")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_flag_callback("--disable-shared-experts-fusion", [a] { a->shared_experts_fusion = "off"; },
                        "--shared-experts-fusion off (SGLang's)");
  app.add_option("--max-body-bytes", a->max_body_bytes, "largest request body accepted")->capture_default_str();
  app.add_option("--num-http-threads", a->num_http_threads,
                 "HTTP io threads (0: half the cores, 4 to 16; streaming many requests needs several)")
      ->capture_default_str();
  app.add_option("--request-timeout", a->request_timeout, "abort requests running longer (s; 0: never)");
  app.add_option("--kv-transfer-addr", a->kv_transfer_addr,
                 "prefill / decode disaggregation (vLLM's kv_transfer_params): the address, HOST or HOST:PORT, that "
                 "this server's prefill answers tell decode servers to read its KV at (default: the Host header the "
                 "prefill request came with)");
  app.add_option("--kv-transfer-timeout", a->kv_transfer_timeout,
                 "seconds a decode request's read of a prefill server's KV may take (each read of at most 64 MiB); "
                 "past it the prompt is computed here")
      ->capture_default_str();
  app.add_option("--disaggregation-mode", a->disaggregation_mode,
                 "SGLang's prefill / decode disaggregation through its router's bootstrap fields: null (off) | "
                 "prefill (also serves --disaggregation-bootstrap-port) | decode; the KV moves over HTTP")
      ->capture_default_str();
  app.add_option("--disaggregation-bootstrap-port", a->disaggregation_bootstrap_port,
                 "prefill mode: the port decode servers read the KV at (SGLang's router reads it from "
                 "/get_server_info); decode mode: a request's bootstrap_port default")
      ->capture_default_str();
  app.add_option("--max-n", a->max_n, "largest n (parallel samples) accepted")->capture_default_str();
  // SGLang's and vLLM's flags that choose how they compute, not what (their kernels, compilers, schedulers' tuning,
  // expert-parallel MoE and its all-to-all (experts run tensor-parallel here, with the same results), host-memory cache
  // tiers, model downloads, logging and debugging): accepted so that their launch commands (DeepSeek's recipes
  // included) run, and logged as having no effect.
  for (const char* flag :
       {"--enable-torch-compile", "--disable-custom-all-reduce", "--enable-mixed-chunk", "--enable-cache-report",
        "--skip-server-warmup", "--disable-log-requests", "--disable-log-stats",
        "--enable-auto-tool-choice", "--enable-prefix-caching", "--enable-dp-lm-head", "--enable-two-batch-overlap",
        "--enable-flashinfer-mla", "--disable-cuda-graph-padding",
        "--show-time-cost", "--enable-nan-detection", "--enable-nccl-nvls",
        "--enable-deepep-moe", "--enable-eplb", "--enable-chunked-prefill",
        "--no-enable-chunked-prefill", "--async-scheduling", "--enable-memory-saver", "--sleep-on-idle", "--enable-symm-mem", "--disable-fastapi-docs",
        "--weight-loader-disable-mmap", "--disable-async-output-proc", "--multi-step-stream-outputs",
        "--triton-attention-reduce-in-fp32", "--disable-outlines-disk-cache",
        "--enable-prompt-tokens-details"})
    app.add_flag_callback(flag, [a, flag] { a->ignored.push_back(flag); }, "accepted for compatibility; no effect");
  for (const char* opt :
       {"--torch-compile-max-bs", "--attention-backend", "--grammar-backend", "--sampling-backend",
        "--watchdog-timeout", "--max-prefill-tokens", "--decode-log-interval", "--tokenizer-mode", "--cuda-graph-bs",
        "--moe-dense-tp-size", "--schedule-conservativeness", "--num-continuous-decode-steps",
        "--triton-attention-num-kv-splits", "--download-dir", "--revision", "--mm-attention-backend",
        "--file-storage-path", "--moe-a2a-backend", "--deepep-mode", "--nccl-port", "--swap-space",
        "--uvicorn-log-level", "--distributed-executor-backend", "--compilation-config", "--max-seq-len-to-capture",
        "--ep-num-redundant-experts", "--init-expert-location", "--crash-dump-folder", "--num-scheduler-steps",
        "--scheduler-delay-factor", "--preemption-mode", "--num-reserved-decode-tokens", "--hicache-io-backend",
        "--hicache-mem-layout", "--kv-offloading-backend", "--otlp-traces-endpoint", "--collect-detailed-traces",
        "--tokenizer-revision", "--code-revision", "--max-num-partial-prefills", "--long-prefill-token-threshold",
        "--chat-template-content-format", "--disaggregation-transfer-backend", "--disaggregation-ib-device",
        "--hicache-storage-prefetch-policy", "--hicache-storage-backend-extra-config"}) {
    const bool list = std::string_view(opt) == "--cuda-graph-bs";
    app.add_option_function<std::vector<std::string>>(
           opt,
           [a, opt](const std::vector<std::string>& v) {
             std::string given = opt;
             for (const std::string& x : v) given += " " + x;
             a->ignored.push_back(given);
           },
           "accepted for compatibility; no effect")
        ->expected(1, list ? CLI::detail::expected_max_vector_size : 1);
  }
  return [a, run_batch]() -> int {
    ServeArgs& s = *a;
    MLA_CHECK(s.model_path.empty() || s.positional_model.empty() || s.model_path == s.positional_model,
              "the model is given twice: '{}' and --model-path '{}'", s.positional_model, s.model_path);
    if (s.model_path.empty()) s.model_path = s.positional_model;
    MLA_CHECK(!s.model_path.empty(), "--model-path is required (or the model as the first argument)");
    // SGLang's --ep-size: expert parallelism over the --tp ranks (its only other value, 1, is none).
    MLA_CHECK(s.ep_size == 0 || s.ep_size == 1 || s.ep_size == s.tp,
              "--ep-size {}: expert parallelism spans the --tp ranks, so it is 1 or --tp ({})", s.ep_size, s.tp);
    if (s.ep_size > 1) s.expert_parallel = true;
    MLA_CHECK(s.hf_overrides.empty() || s.json_model_override_args.empty(),
              "give either --hf-overrides or --json-model-override-args, not both");
    const std::string overrides_flag = s.hf_overrides.empty() ? "--json-model-override-args" : "--hf-overrides";
    s.model_overrides = s.hf_overrides.empty() ? s.json_model_override_args : s.hf_overrides;
    nlohmann::json overrides = nlohmann::json::object();
    if (!s.model_overrides.empty()) {
      overrides = nlohmann::json::parse(s.model_overrides, nullptr, false);
      MLA_CHECK(overrides.is_object(), "{}: '{}' is not a JSON object", overrides_flag, s.model_overrides);
      MLA_LOG_INFO("{}: config.json's keys replaced by {}", overrides_flag, overrides.dump());
    }
    for (const std::string& f : s.ignored) MLA_LOG_INFO("{}: accepted for compatibility, no effect here", f);
    // --quantization naming the checkpoint's own method (an FP8 or AWQ checkpoint: quantization_names) is accepted:
    // those load from their quantization_config. fp8 on a checkpoint without one quantizes its routed experts at
    // load; another method, or fp8 on an AWQ checkpoint, is refused (recognised, not implemented: exit non-zero).
    if (!s.quantization.empty() && s.load_format != "dummy" && std::filesystem::exists(s.model_path + "/config.json")) {
      const ModelConfig checkpoint = ModelConfig::from_file(s.model_path, overrides);
      const QuantMethod q = checkpoint.quant;
      if (quantization_names(s.quantization, checkpoint)) s.quantization.clear();
      MLA_CHECK(s.quantization != "fp8" || q == QuantMethod::None,
                "--quantization fp8: {} is an {} checkpoint (quantizing it again is not supported)", s.model_path,
                q == QuantMethod::Gptq ? "GPTQ" : q == QuantMethod::CtInt ? "integer compressed-tensors" : "AWQ");
    }
    not_implemented(!s.quantization.empty() && s.quantization != "fp8",
                    fmt::format("--quantization {} (quantizing at load is fp8 only; FP8, AWQ and GPTQ checkpoints "
                                "load without the flag)",
                                s.quantization));
    not_implemented(s.dtype != "auto" && s.dtype != "bfloat16" && s.dtype != "bf16",
                    fmt::format("--dtype {} (activations are bfloat16, the dtype of DeepSeek's checkpoints: use auto or "
                                "bfloat16)",
                                s.dtype));
    MLA_CHECK(s.max_logprobs >= -1, "--max-logprobs must be >= -1, got {}", s.max_logprobs);
    MLA_CHECK(s.pipeline_parallel_size >= 1, "--pipeline-parallel-size must be >= 1, got {}", s.pipeline_parallel_size);
    not_implemented(s.pipeline_parallel_size > 1,
                    fmt::format("--pipeline-parallel-size {} (layers in pipeline stages; --tp, --dp and "
                                "--enable-dp-attention spread a model over GPUs)",
                                s.pipeline_parallel_size));
    not_implemented(!s.completion_template.empty() && s.completion_template != "deepseek_coder",
                    fmt::format("--completion-template {} (deepseek_coder's fill in the middle is built in)",
                                s.completion_template));
    not_implemented(!s.hicache_storage_backend.empty(),
                    fmt::format("--hicache-storage-backend {} (the prefix cache keeps a device and, with "
                                "--enable-hierarchical-cache, a host tier; no storage tier below them)",
                                s.hicache_storage_backend));
    (void)parse_kv_cache_dtype(s.kv_cache_dtype);  // a clear error before any loading
    MLA_CHECK(s.nnodes >= 1 && s.node_rank >= 0 && s.node_rank < s.nnodes, "--node-rank {} must be in [0, --nnodes {})",
              s.node_rank, s.nnodes);
    MLA_CHECK(s.nnodes == 1 || !s.dist_init_addr.empty(), "--nnodes {} needs --dist-init-addr host:port", s.nnodes);
    MLA_CHECK(s.port >= 0 && s.port <= 65535, "--port must be in [0, 65535], got {}", s.port);
    {  // the TLS files, before any loading
      server::ServerOptions tls;
      set_tls(s, tls);
      server::HttpServer::check_tls(tls);
    }
    MLA_CHECK(s.base_gpu_id >= 0, "--base-gpu-id must be >= 0, got {}", s.base_gpu_id);
    MLA_CHECK(s.gpu_id_step >= 1, "--gpu-id-step must be >= 1, got {}", s.gpu_id_step);
    MLA_CHECK(s.num_http_threads >= 0 && s.num_http_threads <= 256, "--num-http-threads must be in [0, 256]");
    if (s.num_http_threads == 0)
      s.num_http_threads = static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency() / 2, 4, 16));
    MLA_CHECK(s.max_body_bytes >= 1024, "--max-body-bytes must be at least 1024");
    MLA_CHECK(s.max_n >= 1, "--max-n must be at least 1");
    MLA_CHECK(s.stream_interval >= 1, "--stream-interval must be at least 1, got {}", s.stream_interval);
    MLA_CHECK(s.scheduling_policy == "fcfs" || s.scheduling_policy == "priority",
              "--scheduling-policy '{}' is not known (fcfs or priority)", s.scheduling_policy);
    MLA_CHECK(!s.low_priority_values_first || s.enable_priority_scheduling,
              "--schedule-low-priority-values-first needs --enable-priority-scheduling");
    MLA_CHECK(s.priority_preemption_threshold >= 0, "--priority-scheduling-preemption-threshold must be >= 0, got {}",
              s.priority_preemption_threshold);
    MLA_CHECK(!(s.enable_priority_scheduling && s.scheduling_policy == "priority"),
              "give either --enable-priority-scheduling (higher values first) or --scheduling-policy priority (lower "
              "values first), not both");
    resolve_speculative(s);
    MLA_CHECK(s.sampling_defaults == "model" || s.sampling_defaults == "openai",
              "--sampling-defaults: expected model or openai, got '{}'", s.sampling_defaults);
    if (s.generation_config != "vllm" && s.sampling_defaults == "model") {
      const std::string dir = s.generation_config == "auto" ? s.model_path : s.generation_config;
      MLA_CHECK(s.generation_config == "auto" || std::filesystem::is_directory(dir),
                "--generation-config: expected auto, vllm or a folder, got '{}'", s.generation_config);
      s.defaults = generation_config_sampling(dir);
    }
    if (!s.default_chat_template_kwargs.empty()) {
      s.default_kwargs = nlohmann::json::parse(s.default_chat_template_kwargs, nullptr, /*allow_exceptions=*/false);
      MLA_CHECK(s.default_kwargs.is_object(), "--default-chat-template-kwargs: not a JSON object: '{}'",
                s.default_chat_template_kwargs);
    }
    MLA_CHECK(!s.response_role.empty(), "--response-role: an empty role");
    if (!s.override_generation_config.empty()) {
      const auto j = nlohmann::json::parse(s.override_generation_config, nullptr, /*allow_exceptions=*/false);
      MLA_CHECK(!j.is_discarded(), "--override-generation-config: not JSON: '{}'", s.override_generation_config);
      read_sampling_defaults(j, "--override-generation-config", s.defaults);
    }
    if (!s.defaults.empty()) {
      MLA_LOG_INFO("requests' sampling defaults from generation_config.json and --override-generation-config "
                   "(--generation-config vllm or --sampling-defaults openai: the override only): {}",
                   defaults_json(s.defaults).dump());
    }
    s.origins = parse_origins(s.allowed_origins);
    MLA_CHECK(s.reasoning_parser.empty() || server::known_reasoning_parser(s.reasoning_parser),
              "--reasoning-parser '{}' is not known (known: deepseek-r1, deepseek-v3, kimi_k2, or vLLM's "
              "deepseek_r1, deepseek_v3)", s.reasoning_parser);
    MLA_CHECK(s.tool_call_parser.empty() || server::known_tool_call_parser(s.tool_call_parser),
              "--tool-call-parser '{}' is not known (known: {})", s.tool_call_parser, server::kToolCallParsers);
    MLA_CHECK(s.chat_template.empty() || std::filesystem::is_regular_file(s.chat_template),
              "--chat-template: '{}' is not a file", s.chat_template);
    MLA_CHECK(s.request_timeout >= 0, "--request-timeout must be >= 0");
    MLA_CHECK(s.kv_transfer_timeout > 0, "--kv-transfer-timeout must be > 0, got {}", s.kv_transfer_timeout);
    const std::string& mode = s.disaggregation_mode;
    MLA_CHECK(mode == "null" || mode == "prefill" || mode == "decode",
              "--disaggregation-mode: expected null, prefill or decode, got '{}'", s.disaggregation_mode);
    MLA_CHECK(s.disaggregation_bootstrap_port >= 0 && s.disaggregation_bootstrap_port <= 65535,
              "--disaggregation-bootstrap-port: {} is not a port", s.disaggregation_bootstrap_port);
    MLA_CHECK(s.disaggregation_mode == "null" || s.nnodes == 1,
              "--disaggregation-mode {}: the KV transfer needs the server on one node (--nnodes {})",
              s.disaggregation_mode, s.nnodes);
    MLA_CHECK(std::filesystem::is_directory(s.model_path), "--model-path: '{}' is not a directory", s.model_path);
    if (s.tokenizer_path.empty()) s.tokenizer_path = s.model_path;
    for (const std::string& n : s.served_model_names) MLA_CHECK(!n.empty(), "--served-model-name: an empty name");
    s.served_model_name = s.served_model_names.empty() ? s.model_path : s.served_model_names[0];
    if (s.trust_remote_code) MLA_LOG_DEBUG("--trust-remote-code: no effect (no remote code is ever run)");

    std::unique_ptr<server::TextCodec> codec;
    if (!s.skip_tokenizer_init) {
      codec = server::load_text_codec(s.tokenizer_path, s.chat_template);
      MLA_CHECK(codec != nullptr,
                "this build has no tokenizer library; start with --skip-tokenizer-init to serve token ids only");
      MLA_LOG_INFO("tokenizer: {}", s.tokenizer_path);
    }

    EngineArgs ea;
    ea.model_path = s.model_path;
    ea.device = s.device;
    ea.load_format = s.load_format;
    ea.fp8_experts = s.fp8_experts;
    ea.int4_experts = s.int4_experts;
    ea.shared_experts_fusion = s.shared_experts_fusion;
    ea.quantization = s.quantization;
    ea.seed = s.random_seed;
    ea.tp_size = s.tp;
    ea.dp_size = s.dp;
    ea.enable_dp_attention = s.enable_dp_attention;
    ea.expert_parallel = s.expert_parallel;
    ea.load_balance_method = s.load_balance_method;
    ea.balance = s.balance;
    ea.page_size = s.page_size;
    ea.max_running_requests = s.max_running_requests;
    ea.max_total_tokens = s.max_total_tokens;
    ea.mem_fraction_static = s.mem_fraction_static;
    ea.model_overrides = s.model_overrides;
    ea.chunked_prefill_size = s.chunked_prefill_size;
    ea.disable_radix_cache = s.disable_radix_cache;
    MLA_CHECK(s.hicache_write_policy == "write_back" || s.hicache_write_policy == "write_through" ||
                  s.hicache_write_policy == "write_through_selective",
              "--hicache-write-policy: expected write_back, write_through or write_through_selective, got '{}'",
              s.hicache_write_policy);
    MLA_CHECK(s.kv_offloading_size >= 0.0, "--kv-offloading-size must be >= 0, got {}", s.kv_offloading_size);
    ea.enable_hierarchical_cache = s.hierarchical_cache || s.kv_offloading_size > 0.0;
    ea.hicache_ratio = s.hicache_ratio;
    ea.hicache_size =
        s.kv_offloading_size > 0.0 && s.hicache_size <= 0.0 ? s.kv_offloading_size / s.tp : s.hicache_size;
    ea.context_length = s.context_length;
    ea.extra_eos_token_ids = generation_config_eos(s.model_path);
    ea.nnodes = s.nnodes;
    ea.node_rank = s.node_rank;
    ea.dist_init_addr = s.dist_init_addr;
    ea.disable_overlap_schedule = s.disable_overlap_schedule;
    ea.priority_scheduling = s.enable_priority_scheduling || s.scheduling_policy == "priority";
    ea.longest_prefix_first = s.schedule_policy == "lpm";
    // SGLang preempts for higher priorities; vLLM's priority policy retracts by priority only when decode runs short.
    ea.priority_preemption = s.enable_priority_scheduling && !s.disable_priority_preemption;
    ea.priority_preemption_threshold = s.priority_preemption_threshold;
    ea.spec_draft_tokens = s.spec_draft_tokens;
    ea.spec_mtp = s.spec_mtp;
    ea.spec_ngram_min = s.ngram_min;
    ea.spec_ngram_max = s.ngram_max;
    ea.spec_max_batch = s.spec_max_batch;
    ea.cuda_graph_max_bs = s.cuda_graph_max_bs;
    ea.kv_cache_dtype = s.kv_cache_dtype;
    // SGLang: the metrics flag alone records with the stat mode.
    ea.expert_distribution_recorder_mode =
        s.expert_recorder_mode.empty() && s.expert_distribution_metrics ? "stat" : s.expert_recorder_mode;
    ea.expert_distribution_record_at_start = s.expert_distribution_metrics;
    ea.return_routed_experts = s.enable_return_routed_experts;
    ea.disable_cuda_graph = s.disable_cuda_graph;
    ea.dist_timeout_s = s.dist_timeout;
    ea.base_gpu_id = s.base_gpu_id;
    ea.gpu_id_step = s.gpu_id_step;
    if (s.node_rank > 0) {
      // Nodes other than 0 run their ranks for node 0's engine; only node 0 serves HTTP.
      MLA_LOG_INFO("node {} of {}: following node 0 at {}", s.node_rank, s.nnodes, s.dist_init_addr);
      run_follower_node(ea);
      return 0;
    }

    std::unique_ptr<EngineClient> engine;
    {
      LoadProgress progress(fmt::format("loading {} ({} weights)", s.model_path, s.load_format));
      engine = make_engine(ea);
      progress.finish();
      MLA_LOG_INFO("model loaded in {:.1f} s; context length {}", progress.elapsed(), engine->max_context_len());
    }

    server::ServerOptions so;
    so.host = s.host;
    so.port = s.port;
    so.api_key = s.api_key;
    so.allowed_origins = s.origins;
    so.served_model_name = s.served_model_name;
    if (s.served_model_names.size() > 1)
      so.served_model_aliases.assign(s.served_model_names.begin() + 1, s.served_model_names.end());
    so.model_path = s.model_path;
    so.weight_version = s.weight_version;
    if (const char* d = std::getenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"); d && *d)
      so.expert_distribution_dir = d;
    for (const char* env : {"VLLM_TORCH_PROFILER_DIR", "SGLANG_TORCH_PROFILER_DIR"})  // (SGLang's wins)
      if (const char* d = std::getenv(env); d && *d) so.profile_dir = d;
    so.tokenizer_path = s.skip_tokenizer_init ? "" : s.tokenizer_path;
    so.max_body_bytes = s.max_body_bytes;
    set_tls(s, so);
    so.num_threads = s.num_http_threads;
    so.request_timeout_s = s.request_timeout;
    so.kv_transfer_addr = s.kv_transfer_addr;
    so.kv_transfer_timeout_s = s.kv_transfer_timeout;
    so.disaggregation_mode = s.disaggregation_mode;
    so.disaggregation_bootstrap_port = s.disaggregation_bootstrap_port;
    so.parse.max_n = s.max_n;
    so.parse.defaults = s.defaults;
    so.parse.max_top_logprobs = s.max_logprobs < 0 ? (1 << 30) : s.max_logprobs;
    so.parse.return_tokens_as_token_ids = s.return_tokens_as_token_ids;
    so.stream_interval = s.stream_interval;
    so.stream_output = s.stream_output;
    so.enable_return_hidden_states = s.enable_return_hidden_states;
    so.enable_return_routed_experts = s.enable_return_routed_experts;
    so.allow_auto_truncate = s.allow_auto_truncate;
    so.request_id_headers = s.request_id_headers;
    so.log_requests = s.log_requests;
    so.log_requests_level = s.log_requests_level;
    so.max_log_len = s.max_log_len;
    so.reasoning_parser = s.reasoning_parser;
    so.parse.default_chat_template_kwargs = s.default_kwargs;
    so.response_role = s.response_role;
    so.tool_call_parser = s.tool_call_parser;
    so.trust_request_chat_template = s.trust_request_chat_template;
    so.priority_scheduling = ea.priority_scheduling;
    so.priority_higher_first = s.enable_priority_scheduling && !s.low_priority_values_first;
    so.server_args = server_args_json(s);
    raise_fd_limit();
    server::Api api(*engine, codec.get(), so);
    if (run_batch) {
      int rc = 1;
      try {
        rc = run_batch_file(api, s.batch_input, s.batch_output);
      } catch (...) {
        engine->shutdown();
        throw;
      }
      engine->shutdown();
      return rc;
    }
    server::HttpServer http(api, so);
    try {
      http.start();
    } catch (...) {
      engine->shutdown();
      throw;
    }
    // Prefill mode: the bootstrap port, where decode servers read the KV (plain HTTP, the same routes).
    std::optional<server::HttpServer> bootstrap;
    if (s.disaggregation_mode == "prefill") {
      server::ServerOptions bo = so;
      bo.port = s.disaggregation_bootstrap_port;
      bo.ssl_certfile.clear();
      bo.ssl_keyfile.clear();
      bo.num_threads = 2;
      bootstrap.emplace(api, bo);
      try {
        bootstrap->start();
      } catch (...) {
        http.stop();
        engine->shutdown();
        throw;
      }
      MLA_LOG_INFO("prefill mode: decode servers read the KV at {}:{}", s.host, bootstrap->port());
    }
    const char* scheme = so.ssl_certfile.empty() ? "http" : "https";
    std::cout << fmt::format("mlaserve: serving '{}' on {}://{}:{}", so.served_model_name, scheme, s.host,
                             http.port())
              << std::endl;
    MLA_LOG_INFO("ready: {}://{}:{} ({} http threads)", scheme, s.host, http.port(), so.num_threads);
    http.wait_for_signal();
    engine->shutdown();  // aborts what is left; outputs still post to the live io threads
    if (bootstrap) bootstrap->stop();
    http.stop();
    MLA_LOG_INFO("stopped");
    return 0;
  };
}

const RegisterCommand reg("serve", "serve a model over HTTP (native /generate and OpenAI-compatible API)",
                          [](CLI::App& app) { return serve_setup(app, false); });
const RegisterCommand reg_batch("run-batch",
                                "answer an OpenAI batch file offline (vLLM's run-batch): -i in.jsonl -o out.jsonl",
                                [](CLI::App& app) { return serve_setup(app, true); });

}  // namespace
}  // namespace mlaserve::cli
