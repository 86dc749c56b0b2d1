// make_engine: EngineArgs (the server's flags) -> loaded ranks, sized KV pools and running engine(s).
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/log.h"
#include "engine/dp_controller.h"
#include "engine/engine.h"

namespace mlaserve {

namespace {

ParallelConfig parallel_config(const EngineArgs& a, int32_t dp_groups) {
  ParallelConfig pc;
  pc.tp_size = a.tp_size;
  pc.dp_size = dp_groups;
  pc.expert_parallel = a.expert_parallel;
  pc.device = a.device;
  if (a.mem_fraction_static > 0.0) pc.backend.mem_fraction_static = a.mem_fraction_static;
  pc.nnodes = a.nnodes;
  pc.node_rank = a.node_rank;
  pc.dist_init_addr = a.dist_init_addr;
  pc.dist_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.dist_timeout_s * 1000));
  pc.cuda_graph_max_bs = a.disable_cuda_graph ? 0 : a.cuda_graph_max_bs;
  pc.kv_cache_fp8 = parse_kv_cache_dtype(a.kv_cache_dtype);
  pc.count_experts = !a.expert_distribution_recorder_mode.empty();
  pc.capture_routes = a.return_routed_experts;
  return pc;
}

LoadOptions load_options(const EngineArgs& a) {
  LoadOptions lo;
  lo.dummy = a.load_format == "dummy";
  lo.fp8_experts = parse_keep_quantized(a.fp8_experts, "--fp8-experts");
  lo.int4_experts = parse_keep_quantized(a.int4_experts, "--int4-experts");
  lo.shared_experts_fusion = parse_keep_quantized(a.shared_experts_fusion, "--shared-experts-fusion");
  MLA_CHECK(a.quantization.empty() || a.quantization == "fp8", "quantization: expected fp8 or none, got '{}'",
            a.quantization);
  lo.quantize_fp8 = a.quantization == "fp8";
  lo.seed = a.seed;
  lo.config_overrides = a.model_overrides;
  return lo;
}

// The model as this run uses it: config.json with the overrides, and with MTP drafts the checkpoint's MTP layer too.
ModelConfig run_config(const EngineArgs& a) {
  ModelConfig cfg = ModelConfig::from_file(
      a.model_path, a.model_overrides.empty() ? nlohmann::json::object() : nlohmann::json::parse(a.model_overrides));
  if (!a.spec_mtp) return cfg;
  MLA_CHECK(cfg.num_nextn_predict_layers >= 1,
            "speculative decoding with MTP drafts (--speculative-algorithm EAGLE / NEXTN, vLLM's deepseek_mtp): '{}' "
            "has no MTP layer (num_nextn_predict_layers is 0 in its config.json)", a.model_path);
  cfg.mtp_layers = 1;
  return cfg;
}

// Host memory this machine has available (MemAvailable), in bytes.
int64_t host_bytes_available() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
}

// The hierarchical cache's host slots per DP group (every rank of the group keeps that many pages in host memory):
// --hicache-size GiB per rank when > 0, else --hicache-ratio times the device's pool. Refused when the host memory of
// every rank of this process is more than the machine has available.
int32_t host_pages(const EngineArgs& a, int32_t num_pages, int64_t bytes_per_token) {
  MLA_CHECK(!a.disable_radix_cache,
            "--enable-hierarchical-cache keeps the prefix cache's evicted pages in host memory: it needs the prefix "
            "cache (drop --disable-radix-cache)");
  MLA_CHECK(a.hicache_ratio >= 0.0 && a.hicache_size >= 0.0,
            "--hicache-ratio ({}) and --hicache-size ({}) must be >= 0", a.hicache_ratio, a.hicache_size);
  const int64_t page_bytes = bytes_per_token * a.page_size;
  const double pages = a.hicache_size > 0.0 ? a.hicache_size * static_cast<double>(int64_t{1} << 30) / page_bytes
                                            : a.hicache_ratio * num_pages;
  MLA_CHECK(pages >= 1.0, "--enable-hierarchical-cache: --hicache-size {} / --hicache-ratio {} give the host tier no "
            "page of {} bytes", a.hicache_size, a.hicache_ratio, page_bytes);
  const int64_t n = static_cast<int64_t>(std::min(pages, 2.0e9));
  const int64_t ranks_here = std::max(1, a.tp_size / std::max(1, a.nnodes)) * (a.enable_dp_attention ? 1 : a.dp_size);
  const int64_t want = n * page_bytes * ranks_here, have = host_bytes_available();
  MLA_CHECK(want <= have, "--enable-hierarchical-cache: the host tier needs {:.2f} GiB of host memory ({} rank(s) x {} "
            "pages of {} bytes) but {:.2f} GiB is available; lower --hicache-ratio or --hicache-size",
            static_cast<double>(want) / (1 << 30), ranks_here, n, page_bytes, static_cast<double>(have) / (1 << 30));
  MLA_LOG_INFO("hierarchical cache: a host tier of {} tokens ({} pages, {:.2f} GiB) per rank", n * a.page_size, n,
               static_cast<double>(n * page_bytes) / (1 << 30));
  return static_cast<int32_t>(n);
}

std::unique_ptr<EngineClient> make_replica(const EngineArgs& a, const ModelConfig& cfg, int32_t dp_groups,
                                           int32_t replica = 0) {
  ParallelConfig pc = parallel_config(a, dp_groups);
  pc.device_offset = a.base_gpu_id + replica * a.tp_size * a.gpu_id_step;  // on GPUs, replica r uses its own devices
  pc.device_step = a.gpu_id_step;
  auto ranks = std::make_unique<RankSet>(cfg, pc, a.model_path, load_options(a));

  EngineOptions o;
  o.page_size = a.page_size;
  o.chunked_prefill_size = a.chunked_prefill_size;
  o.enable_radix_cache = !a.disable_radix_cache;
  o.context_len = a.context_length > 0 ? a.context_length : cfg.max_position_embeddings;
  o.load_balance_method = a.load_balance_method;
  o.balance = a.balance;
  o.overlap = !a.disable_overlap_schedule;
  o.priority_scheduling = a.priority_scheduling;
  o.longest_prefix_first = a.longest_prefix_first;
  o.priority_preemption = a.priority_preemption;
  o.priority_preemption_threshold = a.priority_preemption_threshold;
  o.spec_draft_tokens = a.spec_draft_tokens;
  o.spec_ngram_min = a.spec_ngram_min;
  o.spec_ngram_max = a.spec_ngram_max;
  o.spec_max_batch = a.spec_max_batch;
  o.record_experts = a.expert_distribution_record_at_start;
  for (int64_t e : cfg.eos_token_ids) o.eos_token_ids.push_back(static_cast<int32_t>(e));
  for (int32_t e : a.extra_eos_token_ids)
    if (std::find(o.eos_token_ids.begin(), o.eos_token_ids.end(), e) == o.eos_token_ids.end()) o.eos_token_ids.push_back(e);

  // KV pool per rank: --max-total-tokens, else a share of memory (--mem-fraction-static of RAM minus the weights
  // on CPU; by default 2 GiB of cache per CPU replica, split over its ranks).
  const int64_t bpt = KvCache::bytes_per_token(cfg, ranks->kv_dtype());
  int64_t tokens = a.max_total_tokens;
  if (tokens <= 0 && ranks->kv_bytes_free() >= 0) {
    // A device with a fixed memory budget (the backend took --mem-fraction-static of it up front).
    tokens = ranks->kv_bytes_free() / bpt;
  } else if (tokens <= 0) {
    int64_t budget = (int64_t{2} << 30) / a.tp_size;
    if (a.mem_fraction_static > 0.0) {
      const int64_t ram = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
      budget = static_cast<int64_t>(a.mem_fraction_static * static_cast<double>(ram)) / a.tp_size -
               ranks->weight_bytes_per_rank();
      MLA_CHECK(budget > 0, "--mem-fraction-static {} leaves no memory for the KV cache after {} bytes of weights per rank",
                a.mem_fraction_static, ranks->weight_bytes_per_rank());
    }
    tokens = std::min<int64_t>(budget / bpt, int64_t{4} << 20);
  }
  o.num_pages = static_cast<int32_t>(tokens / a.page_size);
  MLA_CHECK(o.num_pages > 0, "the KV cache would hold no page of {} tokens", a.page_size);
  if (a.enable_hierarchical_cache) o.host_pages = host_pages(a, o.num_pages, bpt);
  o.max_running_requests = a.max_running_requests > 0 ? a.max_running_requests : 256;
  MLA_LOG_INFO("KV cache per rank: {} tokens ({} pages of {}), {:.2f} GiB; max running requests {} per DP group",
               static_cast<int64_t>(o.num_pages) * a.page_size, o.num_pages, a.page_size,
               static_cast<double>(static_cast<int64_t>(o.num_pages) * a.page_size * bpt) / (1 << 30),
               o.max_running_requests);
  return std::make_unique<Engine>(std::move(ranks), o);
}

}  // namespace

void run_follower_node(const EngineArgs& a) {
  MLA_CHECK(a.node_rank > 0, "run_follower_node is for --node-rank > 0");
  ModelConfig cfg = run_config(a);
  RankSet ranks(cfg, parallel_config(a, a.enable_dp_attention ? a.dp_size : 1), a.model_path, load_options(a));
  MLA_LOG_INFO("node {}: ranks loaded; serving node 0's steps", a.node_rank);
  ranks.follow();
}

std::unique_ptr<EngineClient> make_engine(const EngineArgs& a) {
  MLA_CHECK(a.tp_size >= 1, "--tp must be >= 1, got {}", a.tp_size);
  MLA_CHECK(a.dp_size >= 1, "--dp must be >= 1, got {}", a.dp_size);
  MLA_CHECK(!a.enable_dp_attention || a.tp_size % a.dp_size == 0,
            "--enable-dp-attention needs --dp ({}) to divide --tp ({})", a.dp_size, a.tp_size);
  MLA_CHECK(a.load_format == "auto" || a.load_format == "safetensors" || a.load_format == "dummy",
            "--load-format: expected auto, safetensors or dummy, got '{}'", a.load_format);
  MLA_CHECK(a.page_size > 0, "--page-size must be positive, got {}", a.page_size);
  check_balance_thresholds(a.balance);
  MLA_CHECK(a.mem_fraction_static >= 0.0 && a.mem_fraction_static < 1.0,
            "--mem-fraction-static must be in (0, 1), got {}", a.mem_fraction_static);
  MLA_CHECK(a.max_total_tokens >= 0, "--max-total-tokens must be >= 0");
  MLA_CHECK(a.max_running_requests >= 0, "--max-running-requests must be >= 0");
  MLA_CHECK(a.cuda_graph_max_bs >= 0, "--cuda-graph-max-bs must be >= 0, got {}", a.cuda_graph_max_bs);
  MLA_CHECK(a.node_rank == 0, "make_engine runs on node 0; other nodes use run_follower_node");
  const std::string& rec = a.expert_distribution_recorder_mode;
  MLA_CHECK(rec.empty() || rec == "stat" || rec == "stat_approx",
            "--expert-distribution-recorder-mode: '{}' is not supported here; stat (or stat_approx: the same, exact "
            "counts) records the routed experts per layer", rec);
  MLA_CHECK(!a.expert_distribution_record_at_start || !rec.empty(),
            "--enable-expert-distribution-metrics needs --expert-distribution-recorder-mode stat");
  MLA_CHECK(a.nnodes == 1 || a.enable_dp_attention || a.dp_size == 1,
            "--dp replicas across nodes are not supported; use --enable-dp-attention or one replica");
  ModelConfig cfg = run_config(a);
  MLA_LOG_INFO("{}", cfg.summary());
  if (a.context_length > cfg.max_position_embeddings) {
    // Refused unless asked for by SGLang's or vLLM's variable, as both do.
    auto set = [](const char* name) {
      const char* v = std::getenv(name);
      const std::string s = v ? v : "";
      return !s.empty() && s != "0" && s != "false" && s != "False";
    };
    MLA_CHECK(set("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN") || set("VLLM_ALLOW_LONG_MAX_MODEL_LEN"),
              "--context-length {} is longer than the model's max_position_embeddings ({}, config.json): positions "
              "past it are not what the model was trained for; set SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 (or "
              "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) to serve that length anyway",
              a.context_length, cfg.max_position_embeddings);
    MLA_LOG_WARN("--context-length {} is longer than the model's max_position_embeddings ({}): outputs past {} "
                 "positions may be wrong",
                 a.context_length, cfg.max_position_embeddings, cfg.max_position_embeddings);
  }
  if (a.enable_dp_attention || a.dp_size == 1) return make_replica(a, cfg, a.enable_dp_attention ? a.dp_size : 1);
  std::vector<std::unique_ptr<EngineClient>> replicas;
  for (int32_t r = 0; r < a.dp_size; ++r) replicas.push_back(make_replica(a, cfg, 1, r));
  int64_t cache_tokens = 0;  // one replica's prefix cache (device and host tiers)
  if (!a.disable_radix_cache)
    for (const RankStats& s : replicas[0]->stats()) cache_tokens += s.kv_tokens_total + s.kv_host_tokens_total;
  return std::make_unique<DpController>(std::move(replicas), a.load_balance_method, cache_tokens, a.balance);
}

}  // namespace mlaserve
