// Checkpoint loading against the model: every loader error names the tensor (and file), extra tensors are
// ignored, other float dtypes load to the same model, and dummy weights are deterministic and sensible.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_kernels.h"
#include "backend/forwarding_backend.h"
#include "core/dtype.h"
#include "core/random.h"
#include "engine/offline.h"
#include "engine/rank_set.h"
#include "io/safetensors.h"
#include "json_mutation.h"
#include "model/deepseek_model.h"
#include "test_util.h"

using namespace mlaserve;
namespace fs = std::filesystem;

namespace {

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
  test::rewrite_checkpoint("v2lite", dir, [](std::map<std::string, Tensor>& ts) {
    ts.erase("model.layers.1.mlp.experts.3.up_proj.weight");
  });
  auto e = load_error(dir);
  EXPECT_NE(e.find("missing tensor 'model.layers.1.mlp.experts.3.up_proj.weight'"), std::string::npos) << e;
}

TEST(Loader, UnexpectedShapeNamesTensorAndFile) {
  auto dir = test::temp_dir("ld");
  test::rewrite_checkpoint("v2lite", dir, [](std::map<std::string, Tensor>& ts) {
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
  test::rewrite_checkpoint("v2", dir, [](std::map<std::string, Tensor>& ts) {
    ts["model.layers.2.self_attn.kv_b_proj.weight"] = Tensor::empty_host({8 * 56, 64}, DType::F8_E4M3);
  });
  auto e = load_error(dir);
  EXPECT_NE(e.find("'model.layers.2.self_attn.kv_b_proj.weight' is F8_E4M3 but config.json has no FP8 "
                   "quantization_config"),
            std::string::npos)
      << e;
}

namespace {

// Whether a golden tensor is a linear layer's weight that FP8 checkpoints store quantized (not the embedding,
// lm_head, norms or the router).
bool quantizable(const std::string& n, const Tensor& t) {
  return t.dim() == 2 && n.ends_with(".weight") && n.find("embed_tokens") == std::string::npos &&
         n.find("lm_head") == std::string::npos && n.find("norm") == std::string::npos &&
         !n.ends_with("mlp.gate.weight");
}

float value_of(const Tensor& t, int64_t i) {
  return t.dtype() == DType::BF16 ? bf16_to_f32(t.data_as<uint16_t>()[i]) : t.data_as<float>()[i];
}

// The FP8 checkpoint formats: quant_method fp8 (DeepSeek-V3's blocks with `weight_scale_inv`, AutoFP8's tensor
// scales with a static `input_scale`) or llm-compressor's compressed-tensors (`weight_scale` of each block, tensor or
// output channel).
enum class Fp8Format { Fp8, CompressedTensors };

// Writes the golden family's FP8 checkpoint (block scales of br x bc; one scale per tensor when br == 0; one per
// output channel when br < 0, compressed-tensors only; only the routed experts with `experts_only`) to `fp8` and its
// dequantized model (those weights as F32, the rest unchanged) to `ref`.
void write_fp8_pair(const std::string& family, const fs::path& fp8, const fs::path& ref, int64_t br, int64_t bc,
                    bool experts_only = false, Fp8Format format = Fp8Format::Fp8) {
  const bool ct = format == Fp8Format::CompressedTensors;
  std::map<std::string, Tensor> q_ts, r_ts;
  test::rewrite_checkpoint(family, ref, [&](std::map<std::string, Tensor>& ts) {
    for (auto& [n, t] : ts) {
      if (!quantizable(n, t) || (experts_only && n.find("mlp.experts.") == std::string::npos)) {
        q_ts[n] = t;
        continue;
      }
      const int64_t R = t.size(0), C = t.size(1);
      const int64_t bR = br > 0 ? br : br == 0 ? R : 1, bC = br > 0 ? bc : C;  // (a tensor: one block; a row each)
      const int64_t sr = (R + bR - 1) / bR, sc = (C + bC - 1) / bC;
      Tensor q = Tensor::empty_host({R, C}, DType::F8_E4M3), s = Tensor::empty_host({sr, sc}, DType::F32);
      Tensor d = Tensor::empty_host({R, C}, DType::F32);
      for (int64_t i = 0; i < sr; ++i)
        for (int64_t j = 0; j < sc; ++j) {
          float amax = 0.0f;
          for (int64_t r = i * bR; r < std::min(R, (i + 1) * bR); ++r)
            for (int64_t c = j * bC; c < std::min(C, (j + 1) * bC); ++c)
              amax = std::max(amax, std::fabs(value_of(t, r * C + c)));
          float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
          if (ct && br < 0) scale = bf16_to_f32(f32_to_bf16(scale));  // (stored in BF16 below)
          s.data_as<float>()[i * sc + j] = scale;
          for (int64_t r = i * bR; r < std::min(R, (i + 1) * bR); ++r)
            for (int64_t c = j * bC; c < std::min(C, (j + 1) * bC); ++c) {
              const uint8_t code = test::nearest_e4m3(value_of(t, r * C + c) / scale);
              q.data_as<uint8_t>()[r * C + c] = code;
              d.data_as<float>()[r * C + c] = f8e4m3_to_f32(code) * scale;
            }
        }
      const std::string stem = n.substr(0, n.size() - 7);
      q_ts[n] = q;
      if (ct) {  // [sr, sc] blocks, [1] a tensor, [R, 1] channels (F32 or, for channels, BF16 of the same values)
        Tensor w = s;
        if (br == 0) {
          w = Tensor::empty_host({1}, DType::F32);
          w.data_as<float>()[0] = s.data_as<float>()[0];
        } else if (br < 0) {
          w = Tensor::empty_host({R, 1}, DType::BF16);
          for (int64_t r = 0; r < R; ++r) w.data_as<uint16_t>()[r] = f32_to_bf16(s.data_as<float>()[r]);
        }
        q_ts[stem + ".weight_scale"] = w;
      } else if (br) {
        q_ts[stem + ".weight_scale_inv"] = s;
      } else {
        Tensor scalar = Tensor::empty_host({}, DType::F32);
        scalar.data_as<float>()[0] = s.data_as<float>()[0];
        q_ts[stem + ".weight_scale"] = scalar;
        Tensor in = Tensor::empty_host({}, DType::F32);  // a static activation scale: unused when dequantizing
        in.data_as<float>()[0] = 0.5f;
        q_ts[stem + ".input_scale"] = in;
      }
      t = d;
    }
  });
  auto cfg = nlohmann::json::parse(test::read_text(ref / "config.json"));
  cfg["quantization_config"] = br ? nlohmann::json{{"quant_method", "fp8"}, {"fmt", "e4m3"},
                                                   {"activation_scheme", "dynamic"}, {"weight_block_size", {br, bc}}}
                                  : nlohmann::json{{"quant_method", "fp8"}, {"activation_scheme", "static"}};
  if (ct) {
    nlohmann::json weights{{"num_bits", 8}, {"type", "float"}, {"symmetric", true}, {"dynamic", false},
                           {"strategy", br > 0 ? "block" : br == 0 ? "tensor" : "channel"}};
    if (br > 0) weights["block_structure"] = {br, bc};
    cfg["quantization_config"] = {
        {"quant_method", "compressed-tensors"}, {"format", "float-quantized"}, {"quantization_status", "compressed"},
        {"ignore", {"lm_head"}},
        {"config_groups",
         {{"group_0", {{"targets", {"Linear"}}, {"weights", weights},
                       {"input_activations", {{"num_bits", 8}, {"type", "float"}, {"strategy", "token"},
                                              {"dynamic", true}, {"symmetric", true}}}}}}}};
  }
  test::write_text(fp8 / "config.json", cfg.dump(2));
  write_safetensors((fp8 / "model.safetensors").string(), q_ts);
}

// A CPU backend that takes FP8 and INT4 experts (Backend::takes_fp8_experts, takes_int4_experts), as the CUDA one
// does.
class TakesFp8Experts : public ForwardingBackend {
 public:
  explicit TakesFp8Experts(std::unique_ptr<Backend> b) : ForwardingBackend(*b), own_(std::move(b)) {}
  bool takes_fp8_experts() const override { return true; }
  bool takes_int4_experts() const override { return true; }

 private:
  std::unique_ptr<Backend> own_;
};

// `tp` CPU ranks of the checkpoint in `dir` (taking FP8 / INT4 experts when `fp8_experts`; quantizing the routed
// experts to FP8 at load with `quantize_fp8`; experts whole on each rank with `expert_parallel`; `fusion`: the shared
// experts' --shared-experts-fusion).
std::unique_ptr<RankSet> fp8_ranks(const fs::path& dir, int32_t tp, bool fp8_experts, bool quantize_fp8 = false,
                                   bool expert_parallel = false,
                                   LoadOptions::KeepQuantized fusion = LoadOptions::KeepQuantized::Auto) {
  ParallelConfig pc;
  pc.tp_size = tp;
  pc.expert_parallel = expert_parallel;
  pc.device = "cpu";
  if (fp8_experts)
    pc.wrap_backend = [](std::unique_ptr<Backend> b, int32_t) -> std::unique_ptr<Backend> {
      return std::make_unique<TakesFp8Experts>(std::move(b));
    };
  LoadOptions lo;
  lo.fp8_experts = fp8_experts ? LoadOptions::KeepQuantized::On : LoadOptions::KeepQuantized::Off;
  lo.int4_experts = lo.fp8_experts;
  lo.quantize_fp8 = quantize_fp8;
  lo.shared_experts_fusion = fusion;
  return std::make_unique<RankSet>(ModelConfig::from_file(dir.string()), pc, dir.string(), lo);
}

// The prompt's logits on fp8_ranks; `weight_bytes` gets a rank's.
std::vector<float> ranks_logits(const fs::path& dir, int32_t tp, bool fp8_experts = false,
                                int64_t* weight_bytes = nullptr, bool quantize_fp8 = false,
                                bool expert_parallel = false,
                                LoadOptions::KeepQuantized fusion = LoadOptions::KeepQuantized::Auto) {
  const auto r = fp8_ranks(dir, tp, fp8_experts, quantize_fp8, expert_parallel, fusion);
  RankSet& ranks = *r;
  if (weight_bytes) *weight_bytes = ranks.weight_bytes_per_rank();
  OfflineOptions o;
  o.prompt_logits = true;
  const Tensor t = run_offline(ranks, {kPrompt}, o).prompt_logits[0];
  return std::vector<float>(t.data_as<float>(), t.data_as<float>() + t.numel());
}

}  // namespace

// An FP8 checkpoint (DeepSeek-V3's block format with edge blocks cut short, AutoFP8's per-tensor scales, and
// llm-compressor's compressed-tensors with `weight_scale` per output channel (BF16), per tensor or per block) loads as
// the model of its dequantized weights, on one rank and as tp 2 (each rank dequantizing its slices); compressed-tensors
// block-scaled experts stay FP8 on a backend that takes them, the same model in less memory.
TEST(Loader, Fp8CheckpointsAreTheirDequantizedModels) {
  struct Case {
    std::string family;
    int64_t br, bc;
    Fp8Format format;
  };
  const Fp8Format fp8 = Fp8Format::Fp8, ct = Fp8Format::CompressedTensors;
  for (const Case& c : {Case{"v3", 32, 48, fp8}, Case{"v2", 0, 0, fp8}, Case{"v2lite", 128, 128, fp8},
                        Case{"v3", -1, 0, ct}, Case{"v2", 0, 0, ct}, Case{"v3", 32, 48, ct},
                        Case{"v2lite", 16, 16, ct}}) {
    SCOPED_TRACE(c.family + " blocks " + std::to_string(c.br) + "x" + std::to_string(c.bc) +
                 (c.format == ct ? " compressed-tensors" : ""));
    auto dir = test::temp_dir("fp8"), ref = test::temp_dir("fp8ref");
    write_fp8_pair(c.family, dir, ref, c.br, c.bc, false, c.format);
    for (int32_t tp : {1, 2}) {
      const auto a = ranks_logits(dir, tp), b = ranks_logits(ref, tp);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "logit " << i << " tp " << tp;
    }
    // And it is not the bf16 model: quantization moved the logits.
    const auto orig = logits_of(test::golden_dir(c.family), {}, kPrompt), a = ranks_logits(dir, 1);
    double diff = 0.0;
    for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, static_cast<double>(std::fabs(a[i] - orig[i])));
    EXPECT_GT(diff, 1e-4);
    if (c.format == ct && c.br == 16) {
      int64_t kept_bytes = 0, plain_bytes = 0;
      const auto k = ranks_logits(dir, 1, /*fp8_experts=*/true, &kept_bytes, false, false,
                                  LoadOptions::KeepQuantized::Off);  // (the shared experts apart, as in `a`)
      ranks_logits(dir, 1, false, &plain_bytes);
      for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(k[i], a[i]) << "logit " << i << " experts kept FP8";
      EXPECT_LT(kept_bytes, plain_bytes);
    }
  }
}

// Routed experts kept in FP8 (a backend that takes them: F8 codes and block scales in memory, dequantized by
// moe_experts) give the model of the dequantized weights bit for bit, in less memory; where a rank's slices are not
// whole blocks (v3's 24 expert rows per rank at tp 2 in 16-row blocks) the loader dequantizes them as before. Under
// expert parallelism (tp 2) every rank holds whole experts, kept FP8 in every case, the model of one rank's.
TEST(Loader, Fp8ExpertsKeptQuantizedAreTheSameModel) {
  struct Case {
    std::string family;
    int64_t b;
    bool tp2_kept;
  };
  for (const Case& c : {Case{"v3", 8, true}, Case{"v3", 16, false}, Case{"v2lite", 16, true}}) {
    SCOPED_TRACE(c.family + " blocks " + std::to_string(c.b));
    auto fp8 = test::temp_dir("fp8k"), ref = test::temp_dir("fp8kref");
    write_fp8_pair(c.family, fp8, ref, c.b, c.b);
    for (int32_t tp : {1, 2}) {
      int64_t kept_bytes = 0, plain_bytes = 0;
      // (the shared experts apart in both: fused, SharedExpertsFuseIntoQuantizedExperts)
      const auto off = LoadOptions::KeepQuantized::Off;
      const auto a = ranks_logits(fp8, tp, /*fp8_experts=*/true, &kept_bytes, false, false, off);
      const auto b = ranks_logits(fp8, tp, /*fp8_experts=*/false, &plain_bytes, false, false, off);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "logit " << i << " tp " << tp;
      if (tp == 1 || c.tp2_kept) EXPECT_LT(kept_bytes, plain_bytes) << "tp " << tp;
      else EXPECT_EQ(kept_bytes, plain_bytes) << "tp " << tp;
    }
    int64_t kept_bytes = 0, plain_bytes = 0;
    const auto a = ranks_logits(fp8, 2, true, &kept_bytes, false, /*expert_parallel=*/true);
    const auto b = ranks_logits(fp8, 2, false, &plain_bytes, false, /*expert_parallel=*/true);
    const auto one = ranks_logits(fp8, 1);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "logit " << i << " expert parallel";
    EXPECT_LT(kept_bytes, plain_bytes) << "expert parallel";
    double diff = 0.0, scale = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
      diff = std::max(diff, static_cast<double>(std::fabs(a[i] - one[i])));
      scale = std::max(scale, static_cast<double>(std::fabs(one[i])));
    }
    EXPECT_LT(diff, 1e-4 * scale) << "expert parallel against one rank";
  }
}

// /get_weights_by_name of routed experts kept FP8: the values the model computes with, bf16(code * block scale), the
// same as the model dequantized at load reads, on one rank, two by width and two by whole experts.
TEST(Loader, Fp8ExpertsKeptReadBackAsTheDequantizedModel) {
  auto fp8 = test::temp_dir("fp8r"), ref = test::temp_dir("fp8rref");
  write_fp8_pair("v2lite", fp8, ref, 16, 16);
  struct Layout {
    int32_t tp;
    bool ep;
  };
  for (const Layout& L : {Layout{1, false}, Layout{2, false}, Layout{2, true}}) {
    SCOPED_TRACE(fmt::format("tp {}{}", L.tp, L.ep ? " expert parallel" : ""));
    auto kept = fp8_ranks(fp8, L.tp, true, false, L.ep), plain = fp8_ranks(fp8, L.tp, false, false, L.ep);
    EXPECT_LT(kept->weight_bytes_per_rank(), plain->weight_bytes_per_rank());
    for (const char* n : {"model.layers.1.mlp.experts.3.gate_proj.weight",
                          "model.layers.1.mlp.experts.3.up_proj.weight",
                          "model.layers.2.mlp.experts.6.down_proj.weight"}) {
      const auto a = kept->read_weight(n, 1 << 20), b = plain->read_weight(n, 1 << 20);
      ASSERT_TRUE(a && b) << n << " " << bool(a) << bool(b);
      std::vector<float> want = test::checkpoint_values(ref.string(), n);  // code * scale in F32
      for (float& x : want) x = bf16_to_f32(f32_to_bf16(x));
      EXPECT_EQ(a->values, want) << n;
      EXPECT_EQ(b->values, want) << n;
    }
  }
}

// cpu::quantize_fp8: each block's scale is its largest magnitude / 448 (edge blocks cut short; 1 for zeros), its
// codes the nearest to w / scale; so the largest element comes back as itself (within f32 rounding) and every
// element within half a code step.
TEST(Loader, QuantizeFp8Blocks) {
  const int64_t R = 40, C = 72, b = 16, sr = 3, sc = 5;
  std::vector<float> w(static_cast<size_t>(R * C));
  uint64_t st = 11;
  for (float& v : w) v = static_cast<float>(static_cast<int64_t>((st = splitmix64(st)) % 20001) - 10000) * 1e-4f;
  for (int64_t r = 16; r < 32; ++r)
    for (int64_t c = 16; c < 32; ++c) w[static_cast<size_t>(r * C + c)] = 0.0f;  // block (1, 1): zeros
  w[5 * C + 70] = 3.5f;                                                            // block (0, 4)'s largest
  std::vector<uint8_t> codes(w.size());
  std::vector<float> scales(static_cast<size_t>(sr * sc)), back(w.size());
  cpu::quantize_fp8(w.data(), R, C, b, b, codes.data(), scales.data());
  cpu::dequant_fp8(codes.data(), scales.data(), 1, R, C, b, b, back.data());
  for (int64_t i = 0; i < sr; ++i)
    for (int64_t j = 0; j < sc; ++j) {
      float amax = 0.0f;
      for (int64_t r = i * b; r < std::min(R, (i + 1) * b); ++r)
        for (int64_t c = j * b; c < std::min(C, (j + 1) * b); ++c) amax = std::max(amax, std::fabs(w[r * C + c]));
      EXPECT_EQ(scales[static_cast<size_t>(i * sc + j)], amax > 0 ? amax / 448.0f : 1.0f) << i << "," << j;
    }
  EXPECT_NEAR(back[5 * C + 70], 3.5f, 1e-6f);
  for (size_t i = 0; i < w.size(); ++i) {
    const int64_t r = static_cast<int64_t>(i) / C, c = static_cast<int64_t>(i) % C;
    const float s = scales[static_cast<size_t>(r / b * sc + c / b)];
    ASSERT_EQ(codes[i], test::nearest_e4m3(w[i] / s)) << i;
    // half a code step: 1/16 of the value's power of two, 2^-10 in the subnormal range (scaled)
    const float a = std::fabs(w[i] / s), step = a < 0x1p-6f ? 0x1p-9f : std::ldexp(1.0f, std::ilogb(a) - 3);
    ASSERT_LE(std::fabs(back[i] - w[i]), step / 2 * s * 1.0001f) << i;
  }
  EXPECT_EQ(codes[17 * C + 17], 0);
}

// --quantization fp8 (LoadOptions::quantize_fp8) on a bf16 checkpoint: its routed experts quantized at load (blocks
// of the largest power of two dividing a rank's expert width: v3's 48 rows give 16 x 16 blocks at tp 1, 8 x 8 at
// tp 2) are the model of the FP8 checkpoint of the same experts in the same blocks (written by this test's own
// quantizer), bit for bit: kept FP8 (a backend that takes them: less memory) or dequantized again. And not the
// bf16 model.
TEST(Loader, QuantizeFp8AtLoadIsTheFp8Checkpoint) {
  const fs::path bf16 = test::golden_dir("v3");
  for (int32_t tp : {1, 2}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    const int64_t b = tp == 1 ? 16 : 8;
    auto fp8 = test::temp_dir("fp8q"), ref = test::temp_dir("fp8qref");
    write_fp8_pair("v3", fp8, ref, b, b, /*experts_only=*/true);
    int64_t kept_bytes = 0, plain_bytes = 0;
    const auto want = ranks_logits(fp8, tp);
    const auto kept = ranks_logits(bf16, tp, /*fp8_experts=*/true, &kept_bytes, /*quantize_fp8=*/true);
    const auto again = ranks_logits(bf16, tp, /*fp8_experts=*/false, &plain_bytes, /*quantize_fp8=*/true);
    ASSERT_EQ(kept.size(), want.size());
    ASSERT_EQ(again.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_EQ(kept[i], want[i]) << "logit " << i;
      ASSERT_EQ(again[i], want[i]) << "logit " << i;
    }
    EXPECT_LT(kept_bytes, plain_bytes);
    const auto orig = ranks_logits(bf16, tp);
    double diff = 0.0;
    for (size_t i = 0; i < want.size(); ++i) diff = std::max(diff, static_cast<double>(std::fabs(want[i] - orig[i])));
    EXPECT_GT(diff, 1e-4);
  }
}

namespace {

uint16_t to_f16(float f) {  // round to nearest even; finite normal or zero results only (test data)
  if (f == 0.0f) return 0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  int32_t e = static_cast<int32_t>((u >> 23) & 0xff) - 127 + 15;
  uint32_t m = u & 0x7fffffu;
  uint32_t h = (static_cast<uint32_t>(e) << 10) | (m >> 13);
  const uint32_t rest = m & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

// Each of I input channels' group in groups of gs: channel i's group is (i * mul + add) mod I / gs with act order
// (a permutation when mul is prime to I), else i / gs.
std::vector<int32_t> test_groups(int64_t I, int64_t gs, bool act_order, int64_t mul, int64_t add) {
  std::vector<int32_t> gidx(static_cast<size_t>(I));
  for (int64_t i = 0; i < I; ++i)
    gidx[static_cast<size_t>(i)] = static_cast<int32_t>((act_order ? (i * mul + add) % I : i) / gs);
  return gidx;
}

// The smallest and largest of row o's values in group k (0 included), over [O, I] tensor t.
std::pair<float, float> group_range(const Tensor& t, int64_t o, int64_t I, const std::vector<int32_t>& gidx,
                                    int64_t k) {
  float lo = 0.0f, hi = 0.0f;
  for (int64_t i = 0; i < I; ++i)
    if (gidx[static_cast<size_t>(i)] == k) {
      lo = std::min(lo, value_of(t, o * I + i));
      hi = std::max(hi, value_of(t, o * I + i));
    }
  return {lo, hi};
}

// An I32 vector tensor of `v` (act order's group of each input channel).
Tensor i32_tensor(const std::vector<int32_t>& v) {
  Tensor t = Tensor::empty_host({static_cast<int64_t>(v.size())}, DType::I32);
  std::copy(v.begin(), v.end(), t.data_as<int32_t>());
  return t;
}

// Rewrites the golden family into `ref` through `quantize` (each quantizable linear but the kv_a projection: its
// packed tensors into `q_ts`, the tensor replaced by its dequantized form); the other tensors are copied to `q_ts`.
void rewrite_packed(const std::string& family, const fs::path& ref, std::map<std::string, Tensor>& q_ts,
                    const std::function<void(const std::string&, Tensor&)>& quantize) {
  test::rewrite_checkpoint(family, ref, [&](std::map<std::string, Tensor>& ts) {
    for (auto& [n, t] : ts) {
      if (!quantizable(n, t) || n.find("kv_a_proj") != std::string::npos)
        q_ts[n] = t;
      else
        quantize(n, t);
    }
  });
}

// Writes the golden family's AutoAWQ "gemm" checkpoint (4-bit, groups of `g` input channels, zero points; every
// quantizable linear except the kv_a projection, which stays as it was) to `awq` and its dequantized model to `ref`.
void write_awq_pair(const std::string& family, const fs::path& awq, const fs::path& ref, int64_t g) {
  static constexpr int kPackOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // nibble k holds output channel 8 j + order[k]
  std::map<std::string, Tensor> q_ts;
  rewrite_packed(family, ref, q_ts, [&](const std::string& n, Tensor& t) {
    const int64_t O = t.size(0), I = t.size(1), G = I / g;
    std::vector<uint8_t> qv(static_cast<size_t>(O * I)), zv(static_cast<size_t>(O * G));
    Tensor sc = Tensor::empty_host({G, O}, DType::F16), d = Tensor::empty_host({O, I}, DType::F32);
    for (int64_t o = 0; o < O; ++o)
      for (int64_t k = 0; k < G; ++k) {
        float lo = 0.0f, hi = 0.0f;
        for (int64_t i = k * g; i < (k + 1) * g; ++i) {
          lo = std::min(lo, value_of(t, o * I + i));
          hi = std::max(hi, value_of(t, o * I + i));
        }
        const uint16_t s16 = to_f16(hi > lo ? (hi - lo) / 15.0f : 1.0f);
        const float s = f16_to_f32(s16);
        const int zero = std::clamp(static_cast<int>(std::lround(-lo / s)), 0, 15);
        sc.data_as<uint16_t>()[k * O + o] = s16;
        zv[static_cast<size_t>(o * G + k)] = static_cast<uint8_t>(zero);
        for (int64_t i = k * g; i < (k + 1) * g; ++i) {
          const int qi = std::clamp(static_cast<int>(std::lround(value_of(t, o * I + i) / s)) + zero, 0, 15);
          qv[static_cast<size_t>(o * I + i)] = static_cast<uint8_t>(qi);
          d.data_as<float>()[o * I + i] = static_cast<float>(qi - zero) * s;
        }
      }
    // v [O, N] (4-bit values) -> [N, O / 8] int32 words in AutoAWQ's order.
    auto pack = [&](const std::vector<uint8_t>& v, int64_t N) {
      Tensor p = Tensor::empty_host({N, O / 8}, DType::I32);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t j = 0; j < O / 8; ++j) {
          uint32_t word = 0;
          for (int k = 0; k < 8; ++k)
            word |= uint32_t{v[static_cast<size_t>((8 * j + kPackOrder[k]) * N + n)]} << (4 * k);
          p.data_as<uint32_t>()[n * (O / 8) + j] = word;
        }
      return p;
    };
    Tensor qw = pack(qv, I), qz = pack(zv, G);
    const std::string stem = n.substr(0, n.size() - 7);
    q_ts[stem + ".qweight"] = qw;
    q_ts[stem + ".qzeros"] = qz;
    q_ts[stem + ".scales"] = sc;
    t = d;
  });
  auto cfg = nlohmann::json::parse(test::read_text(ref / "config.json"));
  cfg["quantization_config"] = {{"quant_method", "awq"}, {"bits", 4}, {"group_size", g}, {"zero_point", true},
                                {"version", "gemm"}};
  test::write_text(awq / "config.json", cfg.dump(2));
  write_safetensors((awq / "model.safetensors").string(), q_ts);
}

// Writes the golden family's GPTQ checkpoint (AutoGPTQ's packing: `bits`-bit values along the input channels of
// qweight and the output channels of qzeros; groups of `g` input channels, 0: one group; with `act_order` a g_idx
// that assigns the input channels to groups out of order; `v2`: zeros stored as they are, else less one) to `gptq` and
// its dequantized model to `ref`; the kv_a projection stays as it was.
void write_gptq_pair(const std::string& family, const fs::path& gptq, const fs::path& ref, int bits, int64_t g,
                     bool act_order, bool v2) {
  const int64_t p = 32 / bits;
  const int maxq = (1 << bits) - 1;
  std::map<std::string, Tensor> q_ts;
  rewrite_packed(family, ref, q_ts, [&](const std::string& n, Tensor& t) {
    const int64_t O = t.size(0), I = t.size(1), gs = g > 0 ? g : I, G = (I + gs - 1) / gs;
    const std::vector<int32_t> gidx = test_groups(I, gs, act_order, 7, 3);
    std::vector<uint32_t> qv(static_cast<size_t>(O * I)), zv(static_cast<size_t>(O * G));
    Tensor sc = Tensor::empty_host({G, O}, DType::F16), d = Tensor::empty_host({O, I}, DType::F32);
    for (int64_t o = 0; o < O; ++o)
      for (int64_t k = 0; k < G; ++k) {
        const auto [lo, hi] = group_range(t, o, I, gidx, k);
        const uint16_t s16 = to_f16(hi > lo ? (hi - lo) / static_cast<float>(maxq) : 1.0f);
        const float s = f16_to_f32(s16);
        const int zero = std::clamp(static_cast<int>(std::lround(-lo / s)), v2 ? 0 : 1, maxq);
        sc.data_as<uint16_t>()[k * O + o] = s16;
        zv[static_cast<size_t>(k * O + o)] = static_cast<uint32_t>(v2 ? zero : zero - 1);  // as stored
        for (int64_t i = 0; i < I; ++i)
          if (gidx[static_cast<size_t>(i)] == k) {
            const int qi = std::clamp(static_cast<int>(std::lround(value_of(t, o * I + i) / s)) + zero, 0, maxq);
            qv[static_cast<size_t>(i * O + o)] = static_cast<uint32_t>(qi);
            d.data_as<float>()[o * I + i] = static_cast<float>(qi - zero) * s;
          }
      }
    Tensor qw = Tensor::empty_host({I / p, O}, DType::I32), qz = Tensor::empty_host({G, O / p}, DType::I32);
    for (int64_t r = 0; r < I / p; ++r)
      for (int64_t o = 0; o < O; ++o) {
        uint32_t word = 0;
        for (int64_t k = 0; k < p; ++k) word |= qv[static_cast<size_t>((r * p + k) * O + o)] << (bits * k);
        qw.data_as<uint32_t>()[r * O + o] = word;
      }
    for (int64_t k = 0; k < G; ++k)
      for (int64_t c = 0; c < O / p; ++c) {
        uint32_t word = 0;
        for (int64_t j = 0; j < p; ++j) word |= zv[static_cast<size_t>(k * O + c * p + j)] << (bits * j);
        qz.data_as<uint32_t>()[k * (O / p) + c] = word;
      }
    const std::string stem = n.substr(0, n.size() - 7);
    q_ts[stem + ".qweight"] = qw;
    q_ts[stem + ".qzeros"] = qz;
    q_ts[stem + ".scales"] = sc;
    if (act_order) q_ts[stem + ".g_idx"] = i32_tensor(gidx);
    t = d;
  });
  auto cfg = nlohmann::json::parse(test::read_text(ref / "config.json"));
  cfg["quantization_config"] = {{"quant_method", "gptq"}, {"bits", bits}, {"group_size", g > 0 ? g : -1},
                                {"desc_act", act_order}, {"sym", false},
                                {"checkpoint_format", v2 ? "gptq_v2" : "gptq"}};
  test::write_text(gptq / "config.json", cfg.dump(2));
  write_safetensors((gptq / "model.safetensors").string(), q_ts);
}

// Writes the golden family's compressed-tensors integer checkpoint to `ct` and its dequantized model to `ref`: every
// quantizable linear but kv_a as llm-compressor stores it, pack-quantized (`bits` values per int32 word along the
// input channels, plus 2^(bits - 1); zero points packed along the output channels) or int-quantized (I8 `weight`),
// groups of `g` input channels (0: one per channel), act order through weight_g_idx, symmetric or with zero points,
// bf16 scales.
void write_ct_int_pair(const std::string& family, const fs::path& ct, const fs::path& ref, int bits, int64_t g,
                       bool act_order, bool symmetric, bool packed) {
  const int64_t p = packed ? 32 / bits : 1;
  const int qmin = -(1 << (bits - 1)), qmax = (1 << (bits - 1)) - 1;
  std::map<std::string, Tensor> q_ts;
  rewrite_packed(family, ref, q_ts, [&](const std::string& n, Tensor& t) {
    const int64_t O = t.size(0), I = t.size(1), gs = g > 0 ? g : I, G = (I + gs - 1) / gs;
    const std::vector<int32_t> gidx = test_groups(I, gs, act_order, 5, 1);
    std::vector<int32_t> qv(static_cast<size_t>(O * I)), zv(static_cast<size_t>(O * G));
    Tensor sc = Tensor::empty_host({O, G}, DType::BF16), d = Tensor::empty_host({O, I}, DType::F32);
    for (int64_t o = 0; o < O; ++o)
      for (int64_t k = 0; k < G; ++k) {
        const auto [lo, hi] = group_range(t, o, I, gidx, k);
        float s = symmetric ? std::max(-lo, hi) / static_cast<float>(qmax)
                            : (hi - lo) / static_cast<float>(qmax - qmin);
        const uint16_t s16 = f32_to_bf16(s > 0.0f ? s : 1.0f);
        s = bf16_to_f32(s16);
        const int zero = symmetric ? 0 : std::clamp(qmin - static_cast<int>(std::lround(lo / s)), qmin, qmax);
        sc.data_as<uint16_t>()[o * G + k] = s16;
        zv[static_cast<size_t>(o * G + k)] = zero;
        for (int64_t i = 0; i < I; ++i)
          if (gidx[static_cast<size_t>(i)] == k) {
            const int qi = std::clamp(static_cast<int>(std::lround(value_of(t, o * I + i) / s)) + zero, qmin, qmax);
            qv[static_cast<size_t>(o * I + i)] = qi;
            d.data_as<float>()[o * I + i] = static_cast<float>(qi - zero) * s;
          }
      }
    const std::string stem = n.substr(0, n.size() - 7);
    const uint32_t offset = 1u << (bits - 1), mask = (1u << bits) - 1u;
    if (packed) {
      const int64_t W = (I + p - 1) / p;
      Tensor qw = Tensor::empty_host({O, W}, DType::I32);
      for (int64_t o = 0; o < O; ++o)
        for (int64_t w = 0; w < W; ++w) {
          uint32_t word = 0;
          for (int64_t k = 0; k < p && w * p + k < I; ++k)
            word |= ((static_cast<uint32_t>(qv[static_cast<size_t>(o * I + w * p + k)]) + offset) & mask) << (bits * k);
          qw.data_as<uint32_t>()[o * W + w] = word;
        }
      q_ts[stem + ".weight_packed"] = qw;
      Tensor shape = Tensor::empty_host({2}, DType::I64);
      shape.data_as<int64_t>()[0] = O;
      shape.data_as<int64_t>()[1] = I;
      q_ts[stem + ".weight_shape"] = shape;
      if (!symmetric) {
        const int64_t ZR = (O + p - 1) / p;
        Tensor qz = Tensor::empty_host({ZR, G}, DType::I32);
        for (int64_t r = 0; r < ZR; ++r)
          for (int64_t k = 0; k < G; ++k) {
            uint32_t word = 0;
            for (int64_t j = 0; j < p && r * p + j < O; ++j)
              word |= ((static_cast<uint32_t>(zv[static_cast<size_t>((r * p + j) * G + k)]) + offset) & mask)
                      << (bits * j);
            qz.data_as<uint32_t>()[r * G + k] = word;
          }
        q_ts[stem + ".weight_zero_point"] = qz;
      }
    } else {
      Tensor qw = Tensor::empty_host({O, I}, DType::I8);
      for (int64_t k = 0; k < O * I; ++k) qw.data_as<int8_t>()[k] = static_cast<int8_t>(qv[static_cast<size_t>(k)]);
      q_ts[n] = qw;
      if (!symmetric) {
        Tensor qz = Tensor::empty_host({O, G}, DType::I8);
        for (int64_t k = 0; k < O * G; ++k) qz.data_as<int8_t>()[k] = static_cast<int8_t>(zv[static_cast<size_t>(k)]);
        q_ts[stem + ".weight_zero_point"] = qz;
      }
    }
    q_ts[stem + ".weight_scale"] = sc;
    if (act_order) q_ts[stem + ".weight_g_idx"] = i32_tensor(gidx);
    t = d;
  });
  auto cfg = nlohmann::json::parse(test::read_text(ref / "config.json"));
  nlohmann::json weights = {{"num_bits", bits}, {"type", "int"}, {"symmetric", symmetric},
                            {"strategy", g > 0 ? "group" : "channel"}, {"dynamic", false},
                            {"actorder", act_order ? nlohmann::json("group") : nlohmann::json(nullptr)}};
  if (g > 0) weights["group_size"] = g;
  cfg["quantization_config"] = {
      {"quant_method", "compressed-tensors"},
      {"format", packed ? "pack-quantized" : "int-quantized"},
      {"config_groups", {{"group_0", {{"targets", {"Linear"}}, {"weights", weights}, {"input_activations", nullptr}}}}},
      {"ignore", {"lm_head"}}};
  test::write_text(ct / "config.json", cfg.dump(2));
  write_safetensors((ct / "model.safetensors").string(), q_ts);
}

}  // namespace

// A compressed-tensors integer checkpoint (llm-compressor's W4A16 / W8A16 pack-quantized, W8A8 int-quantized; groups
// or channels, act order, symmetric or with zero points) loads as the model of its dequantized weights, on one rank
// and as tp 2; a zero point tensor of the wrong shape is named.
TEST(Loader, CompressedTensorsIntegerCheckpointIsItsDequantizedModel) {
  struct Case {
    std::string family;
    int bits;
    int64_t g;
    bool act_order, symmetric, packed;
  };
  for (const Case& c : {Case{"v2", 4, 16, false, true, true}, Case{"v3", 4, 32, true, false, true},
                        Case{"v2", 8, 0, false, true, true}, Case{"v3", 2, 16, false, false, true},
                        Case{"v2", 8, 0, false, true, false}, Case{"v3", 8, 16, true, false, false}}) {
    SCOPED_TRACE(fmt::format("{} {} bits, groups of {}, act order {}, symmetric {}, packed {}", c.family, c.bits, c.g,
                             c.act_order, c.symmetric, c.packed));
    auto ct = test::temp_dir("ct"), ref = test::temp_dir("ctref");
    write_ct_int_pair(c.family, ct, ref, c.bits, c.g, c.act_order, c.symmetric, c.packed);
    for (int32_t tp : {1, 2}) {
      const auto a = ranks_logits(ct, tp), b = ranks_logits(ref, tp);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "logit " << i << " tp " << tp;
    }
  }
  auto ct = test::temp_dir("ct"), ref = test::temp_dir("ctref");
  write_ct_int_pair("v2", ct, ref, 4, 16, false, false, true);
  std::map<std::string, Tensor> ts = test::read_checkpoint(ct.string());
  ts["model.layers.1.self_attn.o_proj.weight_zero_point"] = Tensor::empty_host({3, 16}, DType::I32);
  write_safetensors((ct / "model.safetensors").string(), ts);
  const auto e = load_error(ct);
  EXPECT_NE(e.find("'model.layers.1.self_attn.o_proj.weight_zero_point' is I32 [3, 16], expected I32"),
            std::string::npos)
      << e;
}

// A GPTQ checkpoint (AutoGPTQ's packing, f16 scales, zeros stored less one or as they are, act order through g_idx,
// 2, 4 or 8 bits, groups or one group) loads as the model of its dequantized weights, on one rank and as tp 2.
TEST(Loader, GptqCheckpointIsItsDequantizedModel) {
  struct Case {
    std::string family;
    int bits;
    int64_t g;
    bool act_order, v2;
  };
  for (const Case& c : {Case{"v2", 4, 16, false, false}, Case{"v3", 4, 32, true, false}, Case{"v3", 8, 0, false, true},
                        Case{"v2", 2, 16, true, true}}) {
    SCOPED_TRACE(fmt::format("{} {} bits, groups of {}, act order {}, v2 {}", c.family, c.bits, c.g, c.act_order,
                             c.v2));
    auto gptq = test::temp_dir("gptq"), ref = test::temp_dir("gptqref");
    write_gptq_pair(c.family, gptq, ref, c.bits, c.g, c.act_order, c.v2);
    for (int32_t tp : {1, 2}) {
      const auto a = ranks_logits(gptq, tp), b = ranks_logits(ref, tp);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "logit " << i << " tp " << tp;
    }
  }
  auto gptq = test::temp_dir("gptq"), ref = test::temp_dir("gptqref");
  write_gptq_pair("v2", gptq, ref, 4, 16, true, false);
  std::map<std::string, Tensor> ts = test::read_checkpoint(gptq.string());
  Tensor& gi = ts.at("model.layers.1.self_attn.o_proj.g_idx");
  gi.data_as<int32_t>()[3] = 1000;
  write_safetensors((gptq / "model.safetensors").string(), ts);
  const auto e = load_error(gptq);
  EXPECT_NE(e.find("'model.layers.1.self_attn.o_proj.g_idx' gives input channel 3 the group 1000"), std::string::npos)
      << e;
}

// An AWQ checkpoint (AutoAWQ's packing order, f16 scales, zero points) loads as the model of its dequantized weights,
// on one rank and as tp 2; the unquantized kv_a projection loads as usual beside it.
TEST(Loader, AwqCheckpointIsItsDequantizedModel) {
  for (const std::string fam : {"v2", "v3"}) {
    SCOPED_TRACE(fam);
    auto awq = test::temp_dir("awq"), ref = test::temp_dir("awqref");
    write_awq_pair(fam, awq, ref, 16);
    for (int32_t tp : {1, 2}) {
      const auto a = ranks_logits(awq, tp), b = ranks_logits(ref, tp);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "logit " << i << " tp " << tp;
    }
  }
  auto awq = test::temp_dir("awq"), ref = test::temp_dir("awqref");
  write_awq_pair("v2", awq, ref, 16);
  std::map<std::string, Tensor> ts = test::read_checkpoint(awq.string());
  ts["model.layers.1.self_attn.o_proj.qzeros"] = Tensor::empty_host({3, 16}, DType::I32);
  write_safetensors((awq / "model.safetensors").string(), ts);
  const auto e = load_error(awq);
  EXPECT_NE(e.find("'model.layers.1.self_attn.o_proj.qzeros' has shape [3, 16], expected"), std::string::npos) << e;
}

// A 4-bit checkpoint's routed experts kept INT4 (a backend that takes them: code pairs, each group's scale and zero
// point, dequantized by moe_experts) give the model of the dequantized weights bit for bit, in less memory: AWQ,
// GPTQ, compressed-tensors pack-quantized (zero points or symmetric; groups or one per channel), on one rank, two by
// width and two by whole experts. Where a rank's slice does not start on a group (the second rank's 24 columns of down
// at tp 2 in groups of 16) or act order mixes the groups, the loader dequantizes them as before (the same bytes).
TEST(Loader, Int4ExpertsKeptAreTheSameModel) {
  enum class Format { Awq, Gptq, Ct };
  struct Case {
    Format format;
    std::string family;
    int64_t g;
    bool act_order, symmetric, tp2_kept;
  };
  const Format awq = Format::Awq, gptq = Format::Gptq, ct = Format::Ct;
  for (const Case& c : {Case{awq, "v2", 16, false, false, false}, Case{awq, "v3", 8, false, false, true},
                        Case{gptq, "v3", 8, false, false, true}, Case{gptq, "v2", 16, true, false, false},
                        Case{ct, "v2", 8, false, true, true}, Case{ct, "v3", 0, false, false, true}}) {
    SCOPED_TRACE(fmt::format("format {} {} groups of {} act order {} symmetric {}", static_cast<int>(c.format),
                             c.family, c.g, c.act_order, c.symmetric));
    auto q = test::temp_dir("int4"), ref = test::temp_dir("int4ref");
    if (c.format == Format::Awq) write_awq_pair(c.family, q, ref, c.g);
    if (c.format == Format::Gptq) write_gptq_pair(c.family, q, ref, 4, c.g, c.act_order, false);
    if (c.format == Format::Ct) write_ct_int_pair(c.family, q, ref, 4, c.g, c.act_order, c.symmetric, true);
    struct Layout {
      int32_t tp;
      bool ep;
      int kept;  // 1: on every rank, 0: on none, -1: on some (a rank decides from its own slices)
    };
    const int kept = c.act_order ? 0 : 1;
    const int tp2 = c.tp2_kept ? kept : -kept;
    for (const Layout& L : {Layout{1, false, kept}, Layout{2, false, tp2}, Layout{2, true, kept}}) {
      SCOPED_TRACE(fmt::format("tp {}{}", L.tp, L.ep ? " expert parallel" : ""));
      int64_t kept_bytes = 0, plain_bytes = 0;
      // (the shared experts apart in both: fused, SharedExpertsFuseIntoQuantizedExperts)
      const auto off = LoadOptions::KeepQuantized::Off;
      const auto a = ranks_logits(q, L.tp, /*fp8_experts=*/true, &kept_bytes, false, L.ep, off);
      const auto b = ranks_logits(q, L.tp, false, &plain_bytes, false, L.ep, off);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "logit " << i;
      if (L.kept == 1) {
        EXPECT_LT(kept_bytes, plain_bytes);
      }
      if (L.kept == 0) {
        EXPECT_EQ(kept_bytes, plain_bytes);
      }
    }
  }
}

// A 4-bit (FP8 block) checkpoint's shared experts fused into its routed experts kept INT4 (FP8) (--shared-experts-
// fusion auto (on): read as more routed experts, in the same format) give bit for bit the model of its dequantized
// weights with the shared experts fused (on), in less memory than with them dequantized apart (off), on one rank and
// at tp 2 (each rank's slices of the shared experts as routed-width experts); auto leaves FP8 experts' apart. Under
// expert parallelism they stay apart: the same bytes and logits as off.
TEST(Loader, SharedExpertsFuseIntoQuantizedExperts) {
  using K = LoadOptions::KeepQuantized;
  for (const std::string fam : {"v2 awq", "v3 awq", "v3 fp8", "v2lite fp8"}) {
    const std::string family = fam.substr(0, fam.find(' '));
    auto q = test::temp_dir("qs"), ref = test::temp_dir("qsref");
    if (fam.ends_with("awq")) write_awq_pair(family, q, ref, 8);
    else write_fp8_pair(family, q, ref, family == "v3" ? 8 : 16, family == "v3" ? 8 : 16);
    for (int32_t tp : {1, 2}) {
      SCOPED_TRACE(fmt::format("{} tp {}", fam, tp));
      int64_t fused_bytes = 0, apart_bytes = 0;
      const bool awq = fam.ends_with("awq");  // (auto fuses only INT4 experts)
      const auto a = ranks_logits(q, tp, true, &fused_bytes, false, false, awq ? K::Auto : K::On);
      const auto b = ranks_logits(ref, tp, true, nullptr, false, false, K::On);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "logit " << i;
      const auto c = ranks_logits(q, tp, true, &apart_bytes, false, false, K::Off);
      EXPECT_LT(fused_bytes, apart_bytes);
      if (!awq) {
        int64_t auto_bytes = 0;
        EXPECT_EQ(ranks_logits(q, tp, true, &auto_bytes, false, false, K::Auto), c);
        EXPECT_EQ(auto_bytes, apart_bytes);
      }
      float diff = 0.0f, scale = 0.0f;  // apart: the same model up to the order of the fp32 sums
      for (size_t i = 0; i < a.size(); ++i) {
        diff = std::max(diff, std::fabs(a[i] - c[i]));
        scale = std::max(scale, std::fabs(c[i]));
      }
      EXPECT_LT(diff, 1e-4f * scale);
    }
    int64_t ep_on = 0, ep_off = 0;
    const auto a = ranks_logits(q, 2, true, &ep_on, false, true, K::On);
    const auto c = ranks_logits(q, 2, true, &ep_off, false, true, K::Off);
    EXPECT_EQ(ep_on, ep_off);
    EXPECT_EQ(a, c);
  }
}

// --int4-experts auto keeps a 4-bit checkpoint's routed experts INT4 on a backend that takes them, however small the
// model (the same bytes and logits as on), and off dequantizes them at load.
TEST(Loader, Int4ExpertsAutoKeepsThem) {
  auto q = test::temp_dir("int4a"), ref = test::temp_dir("int4aref");
  write_awq_pair("v3", q, ref, 8);
  auto bytes_and_logits = [&](LoadOptions::KeepQuantized k) {
    ParallelConfig pc;
    pc.device = "cpu";
    pc.wrap_backend = [](std::unique_ptr<Backend> b, int32_t) -> std::unique_ptr<Backend> {
      return std::make_unique<TakesFp8Experts>(std::move(b));
    };
    LoadOptions lo;
    lo.int4_experts = k;
    RankSet ranks(ModelConfig::from_file(q.string()), pc, q.string(), lo);
    OfflineOptions o;
    o.prompt_logits = true;
    const Tensor t = run_offline(ranks, {kPrompt}, o).prompt_logits[0];
    return std::make_pair(ranks.weight_bytes_per_rank(),
                          std::vector<float>(t.data_as<float>(), t.data_as<float>() + t.numel()));
  };
  using K = LoadOptions::KeepQuantized;
  const auto autos = bytes_and_logits(K::Auto), on = bytes_and_logits(K::On), off = bytes_and_logits(K::Off);
  EXPECT_EQ(autos.first, on.first);
  EXPECT_LT(autos.first, off.first);
  EXPECT_EQ(autos.second, on.second);
}

// A model holding INT4 experts takes a checkpoint of the same format again in place (/update_weights_from_disk: the
// codes, scales and zeros rewritten, the same logits), while a bf16 checkpoint of it is refused naming the tensor
// it would give in another dtype, and the previous weights are loaded again.
TEST(Loader, Int4ExpertsKeptReloadInPlace) {
  auto q = test::temp_dir("int4u"), ref = test::temp_dir("int4uref");
  write_awq_pair("v3", q, ref, 8);
  for (const auto fusion : {LoadOptions::KeepQuantized::Off, LoadOptions::KeepQuantized::Auto}) {
    SCOPED_TRACE(fusion == LoadOptions::KeepQuantized::Off ? "shared experts apart" : "shared experts fused");
    auto ranks = fp8_ranks(q, 2, true, false, false, fusion);
    OfflineOptions o;
    o.prompt_logits = true;
    auto logits = [&] {
      const Tensor t = run_offline(*ranks, {kPrompt}, o).prompt_logits[0];
      return std::vector<float>(t.data_as<float>(), t.data_as<float>() + t.numel());
    };
    const std::vector<float> before = logits();
    const int64_t bytes = ranks->weight_bytes_per_rank();
    ranks->reload_weights(q.string());
    EXPECT_EQ(logits(), before);
    EXPECT_EQ(ranks->weight_bytes_per_rank(), bytes);
    const std::string err = test::error_text([&] { ranks->reload_weights(ref.string()); });
    EXPECT_NE(err.find("experts"), std::string::npos) << err;
    // (the first tensor whose form differs; fused, the shared experts' form is checked first)
    EXPECT_NE(err.find(fusion == LoadOptions::KeepQuantized::Off ? "U8" : "fused its shared experts into the routed"),
              std::string::npos) << err;
    EXPECT_NE(err.find("loaded again"), std::string::npos) << err;
    EXPECT_EQ(ranks->model_dir(), q.string());
    EXPECT_EQ(logits(), before);
  }
}

// /get_weights_by_name of routed experts kept INT4: the values the model computes with, bf16((code - zero) * scale),
// the same as the model dequantized at load reads.
TEST(Loader, Int4ExpertsKeptReadBackAsTheDequantizedModel) {
  auto q = test::temp_dir("int4r"), ref = test::temp_dir("int4rref");
  write_awq_pair("v3", q, ref, 8);
  for (int32_t tp : {1, 2}) {
    SCOPED_TRACE(fmt::format("tp {}", tp));
    auto kept = fp8_ranks(q, tp, true), plain = fp8_ranks(q, tp, false);
    EXPECT_LT(kept->weight_bytes_per_rank(), plain->weight_bytes_per_rank());
    for (const char* n : {"model.layers.2.mlp.experts.3.gate_proj.weight",
                          "model.layers.2.mlp.experts.3.up_proj.weight",
                          "model.layers.3.mlp.experts.6.down_proj.weight",
                          "model.layers.2.mlp.shared_experts.up_proj.weight",  // (fused: INT4 too)
                          "model.layers.3.mlp.shared_experts.down_proj.weight"}) {
      const auto a = kept->read_weight(n, 1 << 20), b = plain->read_weight(n, 1 << 20);
      ASSERT_TRUE(a && b) << n;
      std::vector<float> want = test::checkpoint_values(ref.string(), n);
      for (float& x : want) x = bf16_to_f32(f32_to_bf16(x));
      EXPECT_EQ(a->values, want) << n;
      EXPECT_EQ(b->values, want) << n;
    }
  }
}

TEST(Loader, Fp8ScaleErrorsNameTheTensor) {
  auto fp8 = test::temp_dir("fp8"), ref = test::temp_dir("fp8ref");
  write_fp8_pair("v3", fp8, ref, 32, 48);
  const std::string w = "model.layers.1.self_attn.o_proj.weight";
  auto edit_fp8 = [&](const std::function<void(std::map<std::string, Tensor>&)>& f) {
    std::map<std::string, Tensor> ts = test::read_checkpoint(fp8.string());
    f(ts);
    auto dir = test::temp_dir("fp8bad");
    fs::copy_file(fp8 / "config.json", dir / "config.json");
    write_safetensors((dir / "model.safetensors").string(), ts);
    return load_error(dir);
  };
  auto e = edit_fp8([&](auto& ts) { ts.erase("model.layers.1.self_attn.o_proj.weight_scale_inv"); });
  EXPECT_NE(e.find("'" + w + "' has no 'model.layers.1.self_attn.o_proj.weight_scale_inv'"), std::string::npos) << e;
  e = edit_fp8([&](auto& ts) {
    ts["model.layers.1.self_attn.o_proj.weight_scale_inv"] = Tensor::empty_host({1, 1}, DType::F32);
  });
  EXPECT_NE(e.find("'model.layers.1.self_attn.o_proj.weight_scale_inv' has shape [1, 1], expected"), std::string::npos)
      << e;
  auto j = nlohmann::json::parse(test::read_text(fp8 / "config.json"));
  j["quantization_config"]["weight_block_size"] = {128};
  test::write_text(fp8 / "config.json", j.dump());
  e = load_error(fp8);
  EXPECT_NE(e.find("weight_block_size must be two positive integers"), std::string::npos) << e;
}

TEST(Loader, ExtraTensorsAreIgnoredAndF32LoadsTheSameModel) {
  auto dir = test::temp_dir("ld");
  test::rewrite_checkpoint("v3", dir, [](std::map<std::string, Tensor>& ts) {
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

// Golden checkpoints with a random tensor given another shape or dtype, or removed (with now and then a config.json
// field edited too): the model either loads, and then runs a prompt, or is refused with an Error naming that tensor
// (or the config or tensor the edited config makes wrong); never another exception, never a crash. FP8 checkpoints'
// weights and scales are among the tensors.
TEST(Loader, MutatedCheckpointsLoadOrNameTheTensor) {
  const std::vector<std::string> families = {"v2lite", "v3", "v3-fp8", "v2-fp8-tensor"};
  const std::vector<DType> dtypes = {DType::F32, DType::F16, DType::BF16, DType::F8_E4M3, DType::I64, DType::I32,
                                     DType::U8, DType::BOOL};
  const std::vector<nlohmann::json> values = test::edge_values();
  std::map<std::string, std::map<std::string, Tensor>> originals;
  for (const std::string& f : families) originals[f] = test::read_checkpoint(test::golden_dir(f));
  std::mt19937_64 rng(20261207);
  auto dir = test::temp_dir("ld_fuzz");
  int64_t loaded = 0, refused = 0;
  for (int it = 0; it < 160; ++it) {
    const std::string& family = families[rng() % families.size()];
    std::map<std::string, Tensor> ts = originals[family];
    std::vector<std::string> names;
    for (const auto& [n, t] : ts) names.push_back(n);
    const std::string name = names[rng() % names.size()];
    const Tensor t = ts[name];
    Shape shape = t.shape();
    DType dtype = t.dtype();
    switch (rng() % 4) {
      case 0:  // removed
        ts.erase(name);
        break;
      case 1:  // another dtype
        dtype = dtypes[rng() % dtypes.size()];
        break;
      case 2:  // a dimension one more or less, or none
        if (!shape.empty()) {
          const size_t d = rng() % shape.size();
          shape[d] = std::max<int64_t>(0, shape[d] + (rng() % 2 ? 1 : -1));
        }
        break;
      default:  // the dimensions reversed, or one added
        if (rng() % 2)
          std::reverse(shape.begin(), shape.end());
        else
          shape.push_back(1);
        break;
    }
    if (ts.count(name) && (shape != t.shape() || dtype != t.dtype())) {
      Tensor m = Tensor::empty_host(shape, dtype);
      for (size_t i = 0; i < m.nbytes(); ++i) static_cast<uint8_t*>(m.data())[i] = static_cast<uint8_t>(rng() & 0x3f);
      ts[name] = m;
    }
    auto config = nlohmann::json::parse(test::read_text(fs::path(test::golden_dir(family)) / "config.json"));
    const bool edit_config = rng() % 8 == 0;
    if (edit_config) test::mutate_json(config, rng, values);
    test::write_text(dir / "config.json", config.dump());
    write_safetensors((dir / "model.safetensors").string(), ts);
    const std::string what = family + ": " + name + " " + shape_str(shape) + " " + dtype_name(dtype) +
                             (edit_config ? " and config " + config.dump() : "");
    try {
      auto be = make_cpu_backend();
      DeepseekModel m(ModelConfig::from_file(dir.string()), *be);
      m.load(dir.string(), {});
      OfflineOptions o;
      o.max_new_tokens = 2;
      (void)run_offline(m, {kPrompt}, o);
      ++loaded;
    } catch (const Error& e) {
      ++refused;
      const std::string msg = e.what();
      // (An edited config changes which tensors the model expects: the error then names whichever is wrong.)
      EXPECT_TRUE(msg.find(name) != std::string::npos || (edit_config && msg.find("tensor") != std::string::npos) ||
                  (edit_config && msg.find("config.json") != std::string::npos))
          << msg << "\n" << what;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a clear error: " << e.what() << "\n" << what;
    }
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GT(loaded, 10);
  EXPECT_GT(refused, 50);
}
