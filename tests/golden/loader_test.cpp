// Checkpoint loading against the model: every loader error names the tensor (and file), extra tensors are
// ignored, other float dtypes load to the same model, and dummy weights are deterministic and sensible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/dtype.h"
#include "engine/offline.h"
#include "io/safetensors.h"
#include "model/deepseek_model.h"
#include "test_util.h"

using namespace mlaserve;
namespace fs = std::filesystem;

namespace {

// Copies a golden checkpoint into `dir` as one model.safetensors after applying `edit` to the tensor map.
void rewrite_checkpoint(const std::string& family, const fs::path& dir,
                        const std::function<void(std::map<std::string, Tensor>&)>& edit) {
  fs::copy_file(test::golden_dir(family) + "/config.json", dir / "config.json", fs::copy_options::overwrite_existing);
  Checkpoint src(test::golden_dir(family));
  std::map<std::string, Tensor> ts;
  for (const auto& n : src.names()) {
    const TensorInfo& i = src.get(n);
    Tensor t = Tensor::empty_host(i.shape, i.dtype);
    std::memcpy(t.data(), i.data, i.nbytes);
    ts[n] = t;
  }
  edit(ts);
  write_safetensors((dir / "model.safetensors").string(), ts);
}

std::string load_error(const fs::path& dir) {
  auto be = make_cpu_backend();
  try {
    DeepseekModel m(ModelConfig::from_file(dir.string()), *be);
    m.load(dir.string(), {});
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<float> logits_of(const std::string& dir, const LoadOptions& lo, const std::vector<int32_t>& prompt) {
  auto be = make_cpu_backend();
  DeepseekModel m(ModelConfig::from_file(dir), *be);
  m.load(dir, lo);
  OfflineOptions o;
  o.prompt_logits = true;
  OfflineResult r = run_offline(m, {prompt}, o);
  const Tensor& t = r.prompt_logits[0];
  return std::vector<float>(t.data_as<float>(), t.data_as<float>() + t.numel());
}

const std::vector<int32_t> kPrompt{5, 17, 300, 2, 99, 41, 7};

}  // namespace

TEST(Loader, MissingTensorIsNamed) {
  auto dir = test::temp_dir("ld");
  rewrite_checkpoint("v2lite", dir, [](std::map<std::string, Tensor>& ts) { ts.erase("model.layers.1.mlp.experts.3.up_proj.weight"); });
  auto e = load_error(dir);
  EXPECT_NE(e.find("missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"), std::string::npos) << e;
}

TEST(Loader, UnexpectedShapeNamesTensorAndFile) {
  auto dir = test::temp_dir("ld");
  rewrite_checkpoint("v2lite", dir, [](std::map<std::string, Tensor>& ts) {
    ts["model.layers.0.self_attn.o_proj.weight"] = Tensor::empty_host({128, 120}, DType::BF16);
  });
  auto e = load_error(dir);
  EXPECT_NE(e.find("'model.layers.0.self_attn.o_proj.weight' has shape [128, 120], expected [128, 128]"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
}

TEST(Loader, QuantizedDtypeWithoutConfigIsRefused) {
  auto dir = test::temp_dir("ld");
  rewrite_checkpoint("v2", dir, [](std::map<std::string, Tensor>& ts) {
    ts["model.layers.2.self_attn.kv_b_proj.weight"] = Tensor::empty_host({8 * 56, 64}, DType::F8_E4M3);
  });
  auto e = load_error(dir);
  EXPECT_NE(e.find("'model.layers.2.self_attn.kv_b_proj.weight' has dtype F8_E4M3"), std::string::npos) << e;
}

TEST(Loader, ExtraTensorsAreIgnoredAndF32LoadsTheSameModel) {
  auto dir = test::temp_dir("ld");
  rewrite_checkpoint("v3", dir, [](std::map<std::string, Tensor>& ts) {
    // V3's MTP layer lives past num_hidden_layers; it must be ignored.
    ts["model.layers.4.self_attn.kv_b_proj.weight"] = Tensor::empty_host({256, 64}, DType::BF16);
    ts["model.layers.4.eh_proj.weight"] = Tensor::empty_host({128, 256}, DType::BF16);
    // Store every bf16 tensor as f32 (exact), so the model must be identical.
    for (auto& [n, t] : ts) {
      if (t.dtype() != DType::BF16) continue;
      Tensor f = Tensor::empty_host(t.shape(), DType::F32);
      for (int64_t i = 0; i < t.numel(); ++i) f.data_as<float>()[i] = bf16_to_f32(t.data_as<uint16_t>()[i]);
      t = f;
    }
  });
  auto a = logits_of(dir.string(), {}, kPrompt);
  auto b = logits_of(test::golden_dir("v3"), {}, kPrompt);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_NEAR(a[i], b[i], 1e-5f * (1 + std::fabs(b[i])));
}

TEST(Loader, DummyWeightsAreDeterministicAndSensible) {
  // Dummy needs only config.json.
  auto dir = test::temp_dir("dummy");
  fs::copy_file(test::golden_dir("v3") + "/config.json", dir / "config.json");
  LoadOptions lo;
  lo.dummy = true;
  auto a = logits_of(dir.string(), lo, kPrompt);
  auto b = logits_of(dir.string(), lo, kPrompt);
  EXPECT_EQ(a, b);
  lo.seed = 1;
  auto c = logits_of(dir.string(), lo, kPrompt);
  EXPECT_NE(a, c);
  double s = 0, s2 = 0;
  for (float v : a) {
    ASSERT_TRUE(std::isfinite(v));
    s += v;
    s2 += double(v) * v;
  }
  const double sd = std::sqrt(s2 / a.size() - (s / a.size()) * (s / a.size()));
  EXPECT_GT(sd, 0.1);
  EXPECT_LT(sd, 10.0);

  auto be = make_cpu_backend();
  ModelConfig cfg = ModelConfig::from_file(dir.string());
  DeepseekModel m(cfg, *be);
  lo.seed = 0;
  m.load(dir.string(), lo);
  const LayerWeights& w = m.layer_weights(3);
  ASSERT_TRUE(w.is_moe);
  // Norms near 1, never zero.
  for (int64_t i = 0; i < w.input_norm.numel(); ++i) EXPECT_NEAR(w.input_norm.data_as<float>()[i], 1.0f, 0.2f);
  // Routers spread tokens over experts: unit-scale inputs, every expert used, none hogging.
  const int64_t T = 512, E = cfg.n_routed_experts, k = cfg.num_experts_per_tok, H = cfg.hidden_size;
  Tensor x = be->alloc({T, H}, DType::F32);
  be->fill_random(x, 99, 0.0f, 1.0f, H, 0, 0);
  Tensor logits = be->alloc({T, E}, DType::F32), ids = be->alloc({T, k}, DType::I32), wts = be->alloc({T, k}, DType::F32);
  be->linear(x, w.router, logits);
  const RouterParams rp = RouterParams::from_config(cfg);
  be->moe_route(logits, &w.router_bias, rp, ids, wts);
  std::vector<int> count(static_cast<size_t>(E), 0);
  for (int64_t i = 0; i < T * k; ++i) ++count[static_cast<size_t>(ids.data_as<int32_t>()[i])];
  const double mean = double(T * k) / E;
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_GT(count[e], mean / 4) << "expert " << e;
    EXPECT_LT(count[e], mean * 3) << "expert " << e;
  }
}
