#include "cli/model_args.h"

#include "backend/backend_factory.h"

#include "core/error.h"
#include "core/log.h"
#include "io/model_config.h"

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
}

MlaForm ModelArgs::form() const {
  if (mla_form == "auto") return MlaForm::Auto;
  if (mla_form == "expanded") return MlaForm::Expanded;
  if (mla_form == "absorbed") return MlaForm::Absorbed;
  fail("--mla-form: expected auto, expanded or absorbed, got '{}'", mla_form);
}

LoadedModel load_model(const ModelArgs& args) {
  MLA_CHECK(args.load_format == "auto" || args.load_format == "safetensors" || args.load_format == "dummy",
            "--load-format: expected auto, safetensors or dummy, got '{}'", args.load_format);
  MLA_CHECK(args.page_size > 0, "--page-size must be positive, got {}", args.page_size);
  MLA_CHECK(args.tp == 1, "--tp {}: tensor parallelism is recognised but not implemented in this command yet", args.tp);
  (void)args.form();
  LoadedModel lm;
  lm.backend = make_backend(args.device);
  ModelConfig cfg = ModelConfig::from_file(args.model_path);
  MLA_LOG_INFO("{}", cfg.summary());
  lm.model = std::make_unique<DeepseekModel>(cfg, *lm.backend);
  LoadOptions lo;
  lo.dummy = args.load_format == "dummy";
  lo.seed = args.seed;
  lm.model->load(args.model_path, lo);
  return lm;
}

}  // namespace mlaserve::cli
