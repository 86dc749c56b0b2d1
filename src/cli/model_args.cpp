#include "cli/model_args.h"

#include "core/error.h"
#include "core/log.h"
#include "io/model_config.h"
#include "model/kv_cache.h"
#ifdef MLASERVE_HAS_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace mlaserve::cli {

void ModelArgs::add_to(CLI::App& app) {
  app.add_option("--model-path", model_path, "checkpoint directory (config.json + safetensors)")->required();
  app.add_option("--device", device, "auto|cpu|cuda")->capture_default_str();
  app.add_option("--load-format", load_format, "auto|safetensors|dummy (dummy: random weights from config.json)")
      ->capture_default_str();
  app.add_option("--mla-form", mla_form, "auto|expanded|absorbed (auto: expanded for prefill, absorbed for decode)")
      ->capture_default_str();
  app.add_option("--page-size", page_size, "tokens per latent-cache page")->capture_default_str();
  app.add_option("--seed", seed, "seed of dummy weights")->capture_default_str();
  app.add_option("--tp", tp, "tensor parallel size")->capture_default_str();
  app.add_option("--mem-fraction-static", mem_fraction_static,
                 "cuda: fraction of GPU memory taken for weights + the latent KV pool")
      ->capture_default_str();
  app.add_option("--scratch-gb", scratch_gb, "cuda: GiB of activation scratch (0: min(8, what is left))")
      ->capture_default_str();
}

MlaForm ModelArgs::form() const {
  if (mla_form == "auto") return MlaForm::Auto;
  if (mla_form == "expanded") return MlaForm::Expanded;
  if (mla_form == "absorbed") return MlaForm::Absorbed;
  fail("--mla-form: expected auto, expanded or absorbed, got '{}'", mla_form);
}

std::unique_ptr<Backend> make_backend(const ModelArgs& args) {
  std::string device = args.device;
  if (device == "auto") {
#ifdef MLASERVE_HAS_CUDA
    device = cuda_device_count() > 0 ? "cuda" : "cpu";
#else
    device = "cpu";
#endif
  }
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") {
#ifdef MLASERVE_HAS_CUDA
    CudaBackendOptions o;
    o.mem_fraction_static = args.mem_fraction_static;
    o.scratch_bytes = static_cast<int64_t>(args.scratch_gb * (1LL << 30));
    return make_cuda_backend(0, o);
#else
    fail("--device cuda: this build has no CUDA backend (configure with -DMLASERVE_CUDA=ON)");
#endif
  }
  fail("--device: expected auto, cpu or cuda, got '{}'", args.device);
}

LoadedModel load_model(const ModelArgs& args) {
  MLA_CHECK(args.load_format == "auto" || args.load_format == "safetensors" || args.load_format == "dummy",
            "--load-format: expected auto, safetensors or dummy, got '{}'", args.load_format);
  MLA_CHECK(args.page_size > 0, "--page-size must be positive, got {}", args.page_size);
  MLA_CHECK(args.tp == 1, "--tp {}: tensor parallelism is recognised but not implemented in this command yet", args.tp);
  (void)args.form();
  LoadedModel lm;
  lm.backend = make_backend(args);
  ModelConfig cfg = ModelConfig::from_file(args.model_path);
  MLA_LOG_INFO("{}", cfg.summary());
  lm.model = std::make_unique<DeepseekModel>(cfg, *lm.backend);
  LoadOptions lo;
  lo.dummy = args.load_format == "dummy";
  lo.seed = args.seed;
  lm.model->load(args.model_path, lo);
  const int64_t free_bytes = lm.backend->persistent_bytes_free();
  if (free_bytes >= 0) {
    const int64_t per_token = KvCache::bytes_per_token(cfg, lm.backend->act_dtype());
    MLA_LOG_INFO("KV cache: {} tokens fit in the {:.2f} GiB left for it ({} bytes per token)", free_bytes / per_token,
                 static_cast<double>(free_bytes) / (1 << 30), per_token);
  }
  return lm;
}

}  // namespace mlaserve::cli
