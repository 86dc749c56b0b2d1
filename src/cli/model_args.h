// Options shared by every command that loads a model, and the loading itself.
#pragma once

#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "engine/offline.h"
#include "engine/rank_set.h"

namespace mlaserve::cli {

struct ModelArgs {
  std::string model_path;
  std::string device = "auto";
  std::string load_format = "auto";
  std::string mla_form = "auto";
  int32_t page_size = 16;
  uint64_t seed = 0;
  int32_t tp = 1;
  int32_t dp = 1;
  bool enable_dp_attention = false;

  void add_to(CLI::App& app);
  MlaForm form() const;
  LoadOptions load_options() const;
  void validate() const;
};

// Runs prompts offline in the layout the args ask for: --tp N (one replica of N ranks), --dp D (D replicas,
// prompts round-robin), --tp N --dp D --enable-dp-attention (D attention-DP groups in one replica).
OfflineResult run_offline_layout(const ModelArgs& args, const std::vector<std::vector<int32_t>>& prompts,
                                 const OfflineOptions& opts, ModelConfig* config_out = nullptr);

}  // namespace mlaserve::cli
