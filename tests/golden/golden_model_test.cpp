// The model against Hugging Face: fp32 reference logits and greedy tokens from tools/golden/make_golden.py
// (transformers 5.17, eager attention, fp32 math on the bf16 checkpoint weights).
//
// Tolerance: our CPU backend also computes in fp32 on the same bf16 weights, so the only differences are
// summation order and libm rounding: measured ~1e-5 of the logits' standard deviation. We require 1e-3 of the
// standard deviation (the "near 1e-3 relative to the logits' scale"), and greedy tokens equal up to
// the first step where the reference's top-2 margin is below 0.02 (a near tie that 1e-3 errors could flip), and,
// fed the reference's own tokens, the picks of every step whose margin is not such a near tie.
#include <gtest/gtest.h>

#include <algorithm>

#include <cmath>

#include "backend/forwarding_backend.h"
#include "core/dtype.h"
#include "engine/offline.h"
#include "engine/sampler.h"
#include "io/safetensors.h"
#include "model/deepseek_model.h"
#include "test_util.h"

using namespace mlaserve;

namespace {

constexpr double kRelTol = 1e-3;
constexpr float kNearTie = 0.02f;

struct Golden {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<Tensor> logits, greedy, margin;
};

Golden read_golden(const std::string& family) {
  SafetensorsFile f(test::golden_dir(family) + "/reference.safetensors");
  Golden g;
  for (int j = 0; f.has("prompt_" + std::to_string(j)); ++j) {
    Tensor p = f.tensor("prompt_" + std::to_string(j));
    g.prompts.emplace_back(p.data_as<int32_t>(), p.data_as<int32_t>() + p.numel());
    g.logits.push_back(f.tensor("logits_" + std::to_string(j)));
    g.greedy.push_back(f.tensor("greedy_" + std::to_string(j)));
    g.margin.push_back(f.tensor("margin_" + std::to_string(j)));
  }
  return g;
}

struct Loaded {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<DeepseekModel> model;
};

Loaded load(const std::string& family, const LoadOptions& lo = {}) {
  Loaded l;
  l.backend = make_cpu_backend();
  l.model = std::make_unique<DeepseekModel>(ModelConfig::from_file(test::golden_dir(family)), *l.backend);
  l.model->load(test::golden_dir(family), lo);
  return l;
}



class GoldenModel : public ::testing::TestWithParam<std::string> {};

// Also with the shared experts fused into the routed ones (read as more routed experts every token takes).
TEST_P(GoldenModel, LogitsAndGreedyMatchHuggingFace) {
  Golden g = read_golden(GetParam());
  for (const auto fusion : {LoadOptions::KeepQuantized::Auto, LoadOptions::KeepQuantized::On}) {
    SCOPED_TRACE(fusion == LoadOptions::KeepQuantized::On ? "shared experts fused" : "shared experts apart");
    LoadOptions lo;
    lo.shared_experts_fusion = fusion;
    Loaded l = load(GetParam(), lo);
    OfflineOptions o;
    o.max_new_tokens = static_cast<int32_t>(g.greedy[0].numel());
    OfflineResult r = run_offline(*l.model, g.prompts, o);  // all prompts as one ragged batch
    for (size_t j = 0; j < g.prompts.size(); ++j) {
      SCOPED_TRACE("prompt " + std::to_string(j));
      EXPECT_LT(test::rel_err(r.prompt_logits[j], g.logits[j]), kRelTol);
      const int64_t n = g.greedy[j].numel();
      ASSERT_EQ(static_cast<int64_t>(r.greedy[j].size()), n);
      for (int64_t i = 0; i < n; ++i) {
        if (g.margin[j].data_as<float>()[i] < kNearTie) break;  // a near tie: later tokens may legitimately differ
        EXPECT_EQ(r.greedy[j][i], g.greedy[j].data_as<int32_t>()[i]) << "step " << i;
      }
    }
    // Past a near tie too: fed the reference's own tokens (teacher forcing), every step's pick is the reference's
    // wherever its margin is not a near tie.
    for (const Tensor& t : g.greedy) o.forced.emplace_back(t.data_as<int32_t>(), t.data_as<int32_t>() + t.numel());
    OfflineResult fed = run_offline(*l.model, g.prompts, o);
    for (size_t j = 0; j < g.prompts.size(); ++j) {
      for (int64_t i = 0; i < g.greedy[j].numel(); ++i) {
        if (g.margin[j].data_as<float>()[i] < kNearTie) continue;
        EXPECT_EQ(fed.greedy[j][static_cast<size_t>(i)], g.greedy[j].data_as<int32_t>()[i])
            << "prompt " << j << " step " << i << " (teacher forced)";
      }
    }
  }
}

TEST_P(GoldenModel, SameLogitsAloneAndInRaggedBatch) {
  Golden g = read_golden(GetParam());
  Loaded l = load(GetParam());
  OfflineOptions o;
  o.max_new_tokens = 4;
  OfflineResult batch = run_offline(*l.model, g.prompts, o);
  for (size_t j : {size_t(1), g.prompts.size() - 1}) {  // (the longest)
    OfflineResult alone = run_offline(*l.model, {g.prompts[j]}, o);
    EXPECT_LT(test::rel_err(alone.prompt_logits[0], batch.prompt_logits[j]), 1e-6) << "prompt " << j;
    EXPECT_EQ(alone.greedy[0], batch.greedy[j]);
  }
}

// Teacher forcing (OfflineOptions::forced): fed the run's own greedy picks, the decode steps are the greedy run's
// (same logits, same picks); fed other tokens, step s's logits are the last row of a prefill of the prompt and the
// first s + 1 fed tokens, and `greedy` reports the picks.
TEST_P(GoldenModel, TeacherForcedDecodeFollowsTheFedTokens) {
  Golden g = read_golden(GetParam());
  Loaded l = load(GetParam());
  std::vector<std::vector<int32_t>> prompts{g.prompts[1], g.prompts[std::min<size_t>(3, g.prompts.size() - 1)]};
  OfflineOptions o;
  o.max_new_tokens = 5;
  o.decode_logits = true;
  OfflineResult plain = run_offline(*l.model, prompts, o);
  ASSERT_EQ(plain.decode_logits.size(), prompts.size());
  o.forced = plain.greedy;
  OfflineResult same = run_offline(*l.model, prompts, o);
  for (size_t j = 0; j < prompts.size(); ++j) {
    ASSERT_EQ(plain.decode_logits[j].size(0), 4);
    EXPECT_EQ(same.greedy[j], plain.greedy[j]);
    EXPECT_EQ(test::rel_err(same.decode_logits[j], plain.decode_logits[j]), 0.0);
  }
  o.forced = {{7, 11, 13, 17}, {19, 23, 29, 31}};
  OfflineResult fed = run_offline(*l.model, prompts, o);
  for (size_t j = 0; j < prompts.size(); ++j) {
    std::vector<int32_t> picks{plain.greedy[j][0]};
    for (int64_t s = 0; s < 4; ++s) {
      std::vector<int32_t> longer = prompts[j];
      longer.insert(longer.end(), o.forced[j].begin(), o.forced[j].begin() + s + 1);
      OfflineOptions p;
      p.prompt_logits = false;
      const Tensor want = run_offline(*l.model, {longer}, p).prompt_logits[0];
      const Tensor got = fed.decode_logits[j].rows(s, s + 1);
      EXPECT_LT(test::rel_err(got, want), 1e-4) << "prompt " << j << " step " << s;
      picks.push_back(argmax_row(got.data_as<float>(), got.size(1)));
    }
    EXPECT_EQ(fed.greedy[j], picks);
  }
  o.forced = {{1, 2}, {1, 2, 3, 4}};
  auto error = [&] { return test::error_text([&] { run_offline(*l.model, prompts, o); }); };
  EXPECT_NE(error().find("prompt 0: 2 forced tokens for 4 decode steps"), std::string::npos) << error();
  o.forced = {{1, 2, 3, 4}};
  EXPECT_NE(error().find("forced tokens name 1 prompts of 2"), std::string::npos) << error();
}

TEST_P(GoldenModel, AbsorbedAndExpandedMlaAgree) {
  Golden g = read_golden(GetParam());
  Loaded l = load(GetParam());
  const size_t n = g.prompts.size();  // (5 prompts in the named families, 3 in the random ones)
  std::vector<std::vector<int32_t>> prompts{g.prompts[std::min<size_t>(2, n - 2)],
                                            g.prompts[std::min<size_t>(3, n - 1)]};
  OfflineOptions o;
  o.max_new_tokens = 6;
  o.form = MlaForm::Expanded;
  OfflineResult e = run_offline(*l.model, prompts, o);
  o.form = MlaForm::Absorbed;
  OfflineResult a = run_offline(*l.model, prompts, o);
  for (size_t j = 0; j < prompts.size(); ++j) {
    EXPECT_LT(test::rel_err(a.prompt_logits[j], e.prompt_logits[j]), 1e-4);
    EXPECT_EQ(a.greedy[j], e.greedy[j]);
  }
}

TEST_P(GoldenModel, ChunkedPrefillEqualsPrefillAtOnce) {
  Golden g = read_golden(GetParam());
  Loaded l = load(GetParam());
  const size_t n = g.prompts.size();  // the longest first, then two shorter ones
  std::vector<std::vector<int32_t>> prompts{g.prompts[n - 1], g.prompts[1], g.prompts[n >= 4 ? 3 : 0]};
  OfflineOptions o;
  o.max_new_tokens = 3;
  OfflineResult whole = run_offline(*l.model, prompts, o);
  for (int32_t chunk : {1, 16, 50}) {
    for (int32_t page : {1, 7, 64}) {
      if (chunk == 1 && page != 7) continue;  // chunk 1 is slow; one page size is enough
      SCOPED_TRACE("chunk " + std::to_string(chunk) + " page " + std::to_string(page));
      OfflineOptions oc = o;
      oc.prefill_chunk = chunk;
      oc.page_size = page;
      OfflineResult c = run_offline(*l.model, prompts, oc);
      for (size_t j = 0; j < prompts.size(); ++j) {
        EXPECT_LT(test::rel_err(c.prompt_logits[j], whole.prompt_logits[j]), 1e-4) << "prompt " << j;
        EXPECT_EQ(c.greedy[j], whole.greedy[j]);
      }
    }
  }
}

// An FP8 latent cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) is the model whose cached latent values are rounded to
// E4M3 / E5M2: the same logits and tokens, bit for bit, as the exact cache under a backend that rounds every row it
// writes to the nearest E4M3 / E5M2 value (in the test, not through the FP8 code). Against Hugging Face no bound is
// asserted: these tiny random models amplify the cache's rounding (bf16 rounding alone moves their logits 6e-3 to
// 1e-2 of their scale, E4M3's 16 times coarser steps 0.1 to 4), so the printout only reports the distance.
class RoundingCacheBackend final : public ForwardingBackend {
 public:
  explicit RoundingCacheBackend(Backend& inner) : ForwardingBackend(inner) {}
  void set_codes(DType codes) { e5m2_ = codes == DType::F8_E5M2; }
  void begin_step(const ForwardBatch& b) override {
    slots_ = b.out_slots;
    ForwardingBackend::begin_step(b);
  }
  void mla_write_latent(Tensor& latent, const Tensor& w, float eps, Tensor& cache) override {
    ForwardingBackend::mla_write_latent(latent, w, eps, cache);
    const int64_t W = cache.size(-1);
    auto round = [this](float* x, int64_t n) {
      for (int64_t i = 0; i < n; ++i)
        x[i] = e5m2_ ? f8e5m2_to_f32(f32_to_e5m2(x[i])) : f8e4m3_to_f32(f32_to_e4m3(x[i]));
    };
    for (size_t t = 0; t < slots_.size(); ++t) {
      round(latent.data_as<float>() + static_cast<int64_t>(t) * W, W);
      round(cache.data_as<float>() + static_cast<int64_t>(slots_[t]) * W, W);
    }
  }

 private:
  std::vector<int32_t> slots_;
  bool e5m2_ = false;
};

TEST_P(GoldenModel, Fp8KvCacheIsTheRoundedCacheModel) {
  Golden g = read_golden(GetParam());
  Loaded l = load(GetParam());
  RoundingCacheBackend rounding(*l.backend);
  DeepseekModel rounded(ModelConfig::from_file(test::golden_dir(GetParam())), rounding);
  rounded.load(test::golden_dir(GetParam()), {});
  for (auto [codes, chunk] : {std::pair{DType::F8_E4M3, 0}, std::pair{DType::F8_E4M3, 7},
                              std::pair{DType::F8_E5M2, 0}, std::pair{DType::F8_E5M2, 7}}) {
    // whole prompts, and chunks reading the earlier chunks' FP8 rows
    SCOPED_TRACE(std::string(dtype_name(codes)) + " cache, prefill chunk " + std::to_string(chunk));
    rounding.set_codes(codes);
    OfflineOptions o;
    o.max_new_tokens = 6;
    o.prefill_chunk = chunk;
    OfflineResult want = run_offline(rounded, g.prompts, o);
    OfflineResult exact = run_offline(*l.model, g.prompts, o);
    o.kv_cache_fp8 = codes;
    OfflineResult got = run_offline(*l.model, g.prompts, o);
    double worst = 0.0;
    for (size_t j = 0; j < g.prompts.size(); ++j) {
      EXPECT_EQ(test::rel_err(got.prompt_logits[j], want.prompt_logits[j]), 0.0) << "prompt " << j;
      EXPECT_EQ(got.greedy[j], want.greedy[j]) << "prompt " << j;
      if (g.prompts[j].size() > 1) {
        EXPECT_GT(test::rel_err(got.prompt_logits[j], exact.prompt_logits[j]), 1e-4) << "prompt " << j << ": exact";
      }
      worst = std::max(worst, test::rel_err(got.prompt_logits[j], g.logits[j]));
    }
    if (chunk == 0)
      std::printf("  %s: %s cache, prompt logits within %.3g of Hugging Face's scale (exact cache: 1e-3)\n",
                  GetParam().c_str(), dtype_name(codes), worst);
  }
}

// v3-fp8 / v2-fp8-tensor: v3 and v2 with their linear weights in FP8 (block scales of 16 x 16 / one scale per
// tensor, powers of two so the dequantized weights are exact in bf16), against Hugging Face's FineGrainedFP8 with
// dequantize=True / Hugging Face on the dequantized weights (tools/golden/make_fp8_golden.py).
// odd-v3 / odd-v2: widths no kernel is tuned to (hidden 96 / 80, three / five heads, latent 40 / 48, RoPE 8 / 16 wide),
// every layer MoE in two expert groups / a plain q_proj with YaRN (tools/golden/make_golden.py).
// kimi: Kimi-K2's routing (384 experts top-8 in one group, routed_scaling_factor 2.827) and YaRN (factor 32, beta 1 / 1).
// random/*: random configs of tools/device/config_fuzz.py (tools/device/random_goldens_run.sh): V2 and V3 forms of
// one to sixteen heads in hidden 32-80, q LoRA or not, RoPE 4-32 wide with and without YaRN, every routing kind with
// groups, routed scaling 1.5-16, all-MoE or dense layers first.
INSTANTIATE_TEST_SUITE_P(Families, GoldenModel,
                         ::testing::ValuesIn([] {
                           std::vector<std::string> f = {"v2lite", "v2", "v3", "v3-fp8", "v2-fp8-tensor",
                                                         "odd-v3", "odd-v2", "kimi"};
                           f.insert(f.end(), test::kRandomFamilies.begin(), test::kRandomFamilies.end());
                           return f;
                         }()),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           std::string n = p.param;
                           for (char& ch : n)
                             if (ch == '-' || ch == '/') ch = '_';
                           return n;
                         });

// The command-line contract, through the real binary.
TEST(GoldenCli, EvalLogitsAndGenerate) {
  auto dir = test::temp_dir("cli");
  const std::string model = test::golden_dir("v3");
  const std::string out = (dir / "out.safetensors").string();
  auto r = test::run_command(std::string(MLASERVE_BINARY) + " eval-logits --model-path " + model + " --prompts " + model +
                             "/reference.safetensors --out " + out + " --max-new-tokens 24");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  Golden g = read_golden("v3");
  SafetensorsFile f(out);
  for (size_t j = 0; j < g.prompts.size(); ++j) {
    Tensor lg = f.tensor("logits_" + std::to_string(j));
    EXPECT_EQ(lg.shape(), g.logits[j].shape());
    EXPECT_LT(test::rel_err(lg, g.logits[j]), kRelTol);
    Tensor gr = f.tensor("greedy_" + std::to_string(j));
    ASSERT_EQ(gr.numel(), 24);
    ASSERT_EQ(gr.dtype(), DType::I32);
  }
  // generate: greedy ids of prompt 1, comma-separated on stdout.
  std::string ids;
  for (size_t i = 0; i < g.prompts[1].size(); ++i) ids += (i ? "," : "") + std::to_string(g.prompts[1][i]);
  r = test::run_command(std::string(MLASERVE_BINARY) + " generate --log-level error --model-path " + model +
                        " --input-ids " + ids + " --max-new-tokens 8 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string expect;
  for (int i = 0; i < 8; ++i) expect += (i ? "," : "") + std::to_string(g.greedy[1].data_as<int32_t>()[i]);
  EXPECT_EQ(r.output, expect + "\n");
  // The same with the shared experts fused into the routed ones, and with SGLang's flag that keeps them apart.
  for (const char* flag : {"--shared-experts-fusion on", "--disable-shared-experts-fusion"}) {
    r = test::run_command(std::string(MLASERVE_BINARY) + " generate --log-level info --model-path " + model +
                          " --input-ids " + ids + " --max-new-tokens 8 " + flag + " 2>&1");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(expect + "\n"), std::string::npos) << flag << ": " << r.output;
    EXPECT_EQ(r.output.find("shared experts fused into the routed ones") != std::string::npos,
              std::string(flag).find("disable") == std::string::npos) << flag << ": " << r.output;
  }
}

TEST(GoldenCli, BadInputsGiveClearErrors) {
  const std::string bin = MLASERVE_BINARY;
  auto r = test::run_command(bin + " generate --model-path /nonexistent --input-ids 1,2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("config.json not found"), std::string::npos) << r.output;
  r = test::run_command(bin + " generate --model-path " + test::golden_dir("v2") + " --input-ids 1,x");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("'x' is not a token id"), std::string::npos) << r.output;
  r = test::run_command(bin + " generate --model-path " + test::golden_dir("v2") + " --input-ids 99999");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("outside the vocabulary"), std::string::npos) << r.output;
  r = test::run_command(bin + " generate --model-path " + test::golden_dir("v2") + " --input-ids 5 --load-format bogus");
  EXPECT_NE(r.output.find("--load-format"), std::string::npos) << r.output;
  for (const char* flag : {"--fp8-experts", "--int4-experts"}) {
    r = test::run_command(bin + " generate --model-path " + test::golden_dir("v2") + " --input-ids 5 " + flag +
                          " sometimes");
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find(std::string(flag) + ": expected auto, on or off, got 'sometimes'"), std::string::npos)
        << r.output;
  }
  r = test::run_command(bin + " generate --model-path " + test::golden_dir("v2") +
                        " --input-ids 5 --shared-experts-fusion sometimes");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--shared-experts-fusion: sometimes not in {auto,on,off}"), std::string::npos) << r.output;
}

}  // namespace
