// Options shared by every command that loads a model, and the loading itself.
#pragma once

#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "engine/offline.h"
#include "backend/backend_factory.h"
#include "engine/rank_set.h"

namespace mlaserve::cli {

struct ModelArgs {
  std::string model_path;
  std::string device = "auto";
  std::string load_format = "auto";
  std::string fp8_experts = "auto";
  std::string int4_experts = "auto";
  std::string shared_experts_fusion = "auto";
  std::string quantization;
  std::string mla_form = "auto";
  int32_t page_size = 16;
  uint64_t seed = 0;
  int32_t tp = 1;
  int32_t dp = 1;
  bool enable_dp_attention = false;
  bool expert_parallel = false;
  int32_t nnodes = 1;
  int32_t node_rank = 0;
  std::string dist_init_addr;
  double dist_timeout = 120.0;  // seconds
  double mem_fraction_static = 0.85;
  double scratch_gb = 0.0;
  int32_t cuda_graph_max_bs = 256;
  bool disable_cuda_graph = false;
  std::string kv_cache_dtype = "auto";

  void add_to(CLI::App& app);
  MlaForm form() const;
  LoadOptions load_options() const;
  void validate() const;
  BackendOptions backend_options() const;
  // The layout, device and graph settings of these args (one replica).
  ParallelConfig parallel_config() const;
};

// Runs prompts offline in the layout the args ask for: --tp N (one replica of N ranks), --dp D (D replicas,
// prompts round-robin), --tp N --dp D --enable-dp-attention (D attention-DP groups in one replica).
// On a node other than 0 (--node-rank > 0) it serves node 0's steps and returns an empty result.
OfflineResult run_offline_layout(const ModelArgs& args, const std::vector<std::vector<int32_t>>& prompts,
                                 const OfflineOptions& opts, ModelConfig* config_out = nullptr);

// One model on one backend (single-rank tools such as bench-one-batch).
struct LoadedModel {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<DeepseekModel> model;
};
LoadedModel load_model(const ModelArgs& args);

}  // namespace mlaserve::cli
