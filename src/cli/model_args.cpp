#include "cli/model_args.h"

#include "core/error.h"
#include "core/log.h"
#include "io/model_config.h"
#include "model/kv_cache.h"

namespace mlaserve::cli {

void ModelArgs::add_to(CLI::App& app) {
  app.add_option("--model-path", model_path, "checkpoint directory (config.json + safetensors)")->required();
  app.add_option("--device", device, "auto|cpu|cuda")->capture_default_str();
  app.add_option("--load-format", load_format, "auto|safetensors|dummy (dummy: random weights from config.json)")
      ->capture_default_str();
  app.add_option("--fp8-experts", fp8_experts,
                 "FP8 routed experts: auto|on (kept FP8: half the memory)|off (bf16 at load)")
      ->capture_default_str();
  app.add_option("--int4-experts", int4_experts,
                 "4-bit routed experts (AWQ, GPTQ, compressed-tensors): auto|on (kept INT4; auto: on)|off (bf16)")
      ->capture_default_str();
  app.add_option("--shared-experts-fusion", shared_experts_fusion,
                 "shared experts read as more routed experts: auto (where the routed experts are kept INT4)|on|off")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->capture_default_str();
  app.add_flag_callback("--disable-shared-experts-fusion", [this] { shared_experts_fusion = "off"; },
                        "--shared-experts-fusion off (SGLang's)");
  app.add_option("--quantization", quantization, "fp8: quantize a bf16 checkpoint's routed experts to FP8 at load")
      ->check(CLI::IsMember({"fp8"}));
  app.add_option("--mla-form", mla_form, "auto|expanded|absorbed (auto: expanded for prefill, absorbed for decode)")
      ->capture_default_str();
  app.add_option("--page-size", page_size, "tokens per latent-cache page")->capture_default_str();
  app.add_option("--seed", seed, "seed of dummy weights")->capture_default_str();
  app.add_option("--tp,--tp-size", tp, "tensor parallel size")->capture_default_str();
  app.add_option("--dp,--dp-size", dp, "data parallel size")->capture_default_str();
  app.add_flag("--enable-dp-attention", enable_dp_attention,
               "attention data-parallel over --dp groups inside the --tp ranks (MoE stays tensor-parallel)");
  app.add_flag("--enable-expert-parallel,--enable-ep-moe", expert_parallel,
               "routed experts split by expert over the --tp ranks instead of by their width");
  app.add_option("--nnodes", nnodes, "number of nodes (one process per node)")->capture_default_str();
  app.add_option("--node-rank", node_rank, "this node's rank in [0, --nnodes)")->capture_default_str();
  app.add_option("--dist-init-addr", dist_init_addr, "host:port where node 0 serves the rendezvous");
  app.add_option("--dist-timeout", dist_timeout, "seconds to wait for every node")->capture_default_str();
  app.add_option("--mem-fraction-static", mem_fraction_static,
                 "cuda: fraction of GPU memory taken for weights + the latent KV pool")
      ->capture_default_str();
  app.add_option("--scratch-gb", scratch_gb, "cuda: GiB of activation scratch (0: min(8, what is left))")
      ->capture_default_str();
  app.add_option("--cuda-graph-max-bs", cuda_graph_max_bs,
                 "cuda: largest decode batch (per DP group) recorded as a CUDA graph")
      ->capture_default_str();
  app.add_flag("--disable-cuda-graph", disable_cuda_graph, "cuda: run every step eagerly");
  app.add_option("--kv-cache-dtype", kv_cache_dtype, kKvCacheDtypeHelp)->capture_default_str();
}

ParallelConfig ModelArgs::parallel_config() const {
  ParallelConfig pc;
  pc.tp_size = tp;
  pc.dp_size = enable_dp_attention ? dp : 1;
  pc.expert_parallel = expert_parallel;
  pc.device = device;
  pc.backend = backend_options();
  pc.nnodes = nnodes;
  pc.node_rank = node_rank;
  pc.dist_init_addr = dist_init_addr;
  pc.dist_timeout = std::chrono::milliseconds(static_cast<int64_t>(dist_timeout * 1000));
  pc.cuda_graph_max_bs = disable_cuda_graph ? 0 : cuda_graph_max_bs;
  pc.kv_cache_fp8 = parse_kv_cache_dtype(kv_cache_dtype);
  return pc;
}

MlaForm ModelArgs::form() const {
  if (mla_form == "auto") return MlaForm::Auto;
  if (mla_form == "expanded") return MlaForm::Expanded;
  if (mla_form == "absorbed") return MlaForm::Absorbed;
  fail("--mla-form: expected auto, expanded or absorbed, got '{}'", mla_form);
}

LoadOptions ModelArgs::load_options() const {
  LoadOptions lo;
  lo.dummy = load_format == "dummy";
  lo.fp8_experts = parse_keep_quantized(fp8_experts, "--fp8-experts");
  lo.int4_experts = parse_keep_quantized(int4_experts, "--int4-experts");
  lo.shared_experts_fusion = parse_keep_quantized(shared_experts_fusion, "--shared-experts-fusion");
  lo.quantize_fp8 = quantization == "fp8";
  lo.seed = seed;
  return lo;
}

void ModelArgs::validate() const {
  MLA_CHECK(load_format == "auto" || load_format == "safetensors" || load_format == "dummy",
            "--load-format: expected auto, safetensors or dummy, got '{}'", load_format);
  (void)parse_kv_cache_dtype(kv_cache_dtype);
  MLA_CHECK(page_size > 0, "--page-size must be positive, got {}", page_size);
  MLA_CHECK(cuda_graph_max_bs >= 0, "--cuda-graph-max-bs must be >= 0, got {}", cuda_graph_max_bs);
  MLA_CHECK(tp >= 1, "--tp must be >= 1, got {}", tp);
  MLA_CHECK(dp >= 1, "--dp must be >= 1, got {}", dp);
  MLA_CHECK(!enable_dp_attention || tp % dp == 0, "--enable-dp-attention needs --dp ({}) to divide --tp ({})", dp, tp);
  MLA_CHECK(nnodes >= 1 && node_rank >= 0 && node_rank < nnodes, "--node-rank {} must be in [0, --nnodes {})", node_rank,
            nnodes);
  MLA_CHECK(nnodes == 1 || !dist_init_addr.empty(), "--nnodes {} needs --dist-init-addr host:port", nnodes);
  MLA_CHECK(nnodes == 1 || enable_dp_attention || dp == 1, "--dp replicas across nodes are not supported; use "
            "--enable-dp-attention or one replica");
  (void)form();
}

OfflineResult run_offline_layout(const ModelArgs& args, const std::vector<std::vector<int32_t>>& prompts,
                                 const OfflineOptions& opts, ModelConfig* config_out) {
  args.validate();
  ModelConfig cfg = ModelConfig::from_file(args.model_path);
  MLA_LOG_INFO("{}", cfg.summary());
  if (config_out) *config_out = cfg;
  ParallelConfig pc = args.parallel_config();
  if (args.node_rank > 0) {
    RankSet ranks(cfg, pc, args.model_path, args.load_options());
    ranks.follow();
    return {};
  }
  const int32_t replicas = args.enable_dp_attention ? 1 : args.dp;
  if (replicas == 1) {
    RankSet ranks(cfg, pc, args.model_path, args.load_options());
    return run_offline(ranks, prompts, opts);
  }
  // Independent replicas: prompt j runs on replica j % replicas.
  OfflineResult all;
  all.prompt_logits.resize(prompts.size());
  all.greedy.resize(prompts.size());
  for (int32_t r = 0; r < replicas; ++r) {
    std::vector<std::vector<int32_t>> mine;
    std::vector<size_t> idx;
    for (size_t j = r; j < prompts.size(); j += static_cast<size_t>(replicas)) {
      mine.push_back(prompts[j]);
      idx.push_back(j);
    }
    if (mine.empty()) continue;
    pc.device_offset = r * args.tp;  // on GPUs, replica r uses its own devices
    RankSet ranks(cfg, pc, args.model_path, args.load_options());
    OfflineResult res = run_offline(ranks, mine, opts);
    for (size_t k = 0; k < idx.size(); ++k) {
      all.prompt_logits[idx[k]] = res.prompt_logits[k];
      all.greedy[idx[k]] = res.greedy[k];
    }
  }
  return all;
}

BackendOptions ModelArgs::backend_options() const {
  BackendOptions o;
  o.mem_fraction_static = mem_fraction_static;
  o.scratch_bytes = static_cast<int64_t>(scratch_gb * (1LL << 30));
  return o;
}

LoadedModel load_model(const ModelArgs& args) {
  args.validate();
  MLA_CHECK(args.tp == 1 && args.dp == 1 && args.nnodes == 1, "this command runs one rank: drop --tp / --dp / --nnodes");
  LoadedModel lm;
  lm.backend = make_backend(args.device, 0, args.backend_options());
  ModelConfig cfg = ModelConfig::from_file(args.model_path);
  MLA_LOG_INFO("{}", cfg.summary());
  lm.model = std::make_unique<DeepseekModel>(cfg, *lm.backend);
  lm.model->load(args.model_path, args.load_options());
  const int64_t free_bytes = lm.backend->persistent_bytes_free();
  if (free_bytes >= 0) {
    const DType kv = KvCache::dtype_on(*lm.backend, parse_kv_cache_dtype(args.kv_cache_dtype));
    const int64_t per_token = KvCache::bytes_per_token(cfg, kv);
    MLA_LOG_INFO("KV cache: {} tokens fit in the {:.2f} GiB left for it ({} bytes per token)", free_bytes / per_token,
                 static_cast<double>(free_bytes) / (1 << 30), per_token);
  }
  return lm;
}

}  // namespace mlaserve::cli
