// Options shared by every command that loads a model, and the loading itself.
#pragma once

#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "backend/backend.h"
#include "model/deepseek_model.h"

namespace mlaserve::cli {

struct ModelArgs {
  std::string model_path;
  std::string device = "auto";
  std::string load_format = "auto";
  std::string mla_form = "auto";
  int32_t page_size = 16;
  uint64_t seed = 0;
  int32_t tp = 1;
  double mem_fraction_static = 0.85;
  double scratch_gb = 0.0;

  void add_to(CLI::App& app);
  MlaForm form() const;
};

struct LoadedModel {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<DeepseekModel> model;
};

// The backend --device names (auto: cuda when this build has it and a GPU is present, else cpu).
std::unique_ptr<Backend> make_backend(const ModelArgs& args);
LoadedModel load_model(const ModelArgs& args);

}  // namespace mlaserve::cli
