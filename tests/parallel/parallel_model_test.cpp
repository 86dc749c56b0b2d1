// Every parallel layout on CPU ranks gives the tp = 1 logits and greedy tokens (and so Hugging Face's), including
// steps where DP groups are idle, all but one are idle, or run very uneven token counts.
#include <gtest/gtest.h>

#include <cmath>

#include <nlohmann/json.hpp>

#include "engine/offline.h"
#include "io/safetensors.h"
#include "test_util.h"

using namespace mlaserve;

namespace {


OfflineResult run(const std::string& fam, int tp, int dp, const std::vector<std::vector<int32_t>>& prompts,
                  int32_t chunk = 0, bool expert_parallel = false) {
  auto rs = test::cpu_ranks(fam, tp, dp, 0, false, expert_parallel);
  RankSet& ranks = *rs;
  OfflineOptions o;
  o.max_new_tokens = 8;
  o.prefill_chunk = chunk;
  o.page_size = 8;
  return run_offline(ranks, prompts, o);
}


void expect_same(const OfflineResult& a, const OfflineResult& b) {
  ASSERT_EQ(a.greedy.size(), b.greedy.size());
  for (size_t j = 0; j < a.greedy.size(); ++j) {
    EXPECT_LT(test::rel_err(a.prompt_logits[j], b.prompt_logits[j]), 1e-4) << "prompt " << j;
    EXPECT_EQ(a.greedy[j], b.greedy[j]) << "prompt " << j;
  }
}

struct Layout {
  int tp, dp;
  bool ep = false;  // routed experts split by expert (ParallelPlan::expert_parallel)
};

class ParallelLayouts : public ::testing::TestWithParam<std::string> {};

TEST_P(ParallelLayouts, EqualToSingleRank) {
  auto prompts = test::golden_prompts(GetParam());
  OfflineResult ref = run(GetParam(), 1, 1, prompts);
  for (Layout l : {Layout{2, 1}, Layout{4, 1}, Layout{2, 2}, Layout{4, 4}, Layout{4, 2}, Layout{2, 1, true},
                   Layout{4, 4, true}, Layout{4, 2, true}}) {
    SCOPED_TRACE("tp " + std::to_string(l.tp) + " dp-attention " + std::to_string(l.dp) +
                 (l.ep ? " expert-parallel" : ""));
    expect_same(run(GetParam(), l.tp, l.dp, prompts, 0, l.ep), ref);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ParallelLayouts, ::testing::Values("v2lite", "v2", "v3"));

// Whether config c splits over layout l: heads and vocabulary over the attention-TP group, the dense and expert widths
// over all ranks, the routed experts over all ranks when split by expert (the model's own checks, restated).
bool fits(const ModelConfig& c, const Layout& l) {
  const int attn_tp = l.tp / l.dp;
  return c.num_attention_heads % attn_tp == 0 && c.vocab_size % attn_tp == 0 && c.intermediate_size % l.tp == 0 &&
         c.moe_intermediate_size % l.tp == 0 && (!l.ep || c.n_routed_experts % l.tp == 0);
}

// The random configs (one to sixteen heads, one to four layers, every routing kind) in every layout their shapes
// split into: DP attention with whole heads on each rank covers the one- and five-head ones.
class RandomFamilyLayouts : public ::testing::TestWithParam<std::string> {};

TEST_P(RandomFamilyLayouts, EqualToSingleRank) {
  const ModelConfig c = ModelConfig::from_file(test::golden_dir(GetParam()));
  auto prompts = test::golden_prompts(GetParam());
  ASSERT_FALSE(prompts.empty());
  OfflineResult ref = run(GetParam(), 1, 1, prompts);
  int ran = 0;
  for (Layout l : {Layout{2, 1}, Layout{4, 1}, Layout{2, 2}, Layout{4, 4}, Layout{4, 2}, Layout{2, 1, true},
                   Layout{2, 2, true}, Layout{4, 4, true}, Layout{4, 2, true}}) {
    const std::string name = "tp " + std::to_string(l.tp) + " dp-attention " + std::to_string(l.dp) +
                             (l.ep ? " expert-parallel" : "");
    if (!fits(c, l)) {  // the model refuses it, naming what does not divide
      std::string err = test::error_text([&] { run(GetParam(), l.tp, l.dp, prompts, 0, l.ep); });
      EXPECT_NE(err.find("is not divisible by"), std::string::npos) << name << ": " << err;
      continue;
    }
    SCOPED_TRACE(name);
    expect_same(run(GetParam(), l.tp, l.dp, prompts, 0, l.ep), ref);
    ++ran;
  }
  EXPECT_GE(ran, 3);  // every random config splits at least as DP attention 2/2 and 4/4 and one expert layout
}

INSTANTIATE_TEST_SUITE_P(Random, RandomFamilyLayouts, ::testing::ValuesIn(test::kRandomFamilies),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           std::string n = p.param.substr(p.param.find('/') + 1);
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

TEST(DpAttention, IdleAndUnevenGroups) {
  auto prompts = test::golden_prompts("v3");
  // One prompt over four groups: three groups are idle at every step.
  std::vector<std::vector<int32_t>> one{prompts[3]};
  expect_same(run("v3", 4, 4, one), run("v3", 1, 1, one));
  // Two prompts of 1 and 257 tokens with small chunks: very uneven token counts, groups going idle early.
  std::vector<std::vector<int32_t>> uneven{prompts[0], prompts[4]};
  expect_same(run("v3", 2, 2, uneven, /*chunk=*/64), run("v3", 1, 1, uneven));
  // Five prompts over four groups (one group runs two).
  expect_same(run("v3", 4, 4, prompts, 48), run("v3", 1, 1, prompts));
}

TEST(ParallelLayoutErrors, IndivisibleShapesAreClear) {
  ParallelConfig pc;
  pc.tp_size = 3;
  pc.device = "cpu";
  const ModelConfig v3 = ModelConfig::from_file(test::golden_dir("v3"));
  std::string err = test::error_text([&] { RankSet r(v3, pc, test::golden_dir("v3"), {}); });
  EXPECT_NE(err.find("num_attention_heads (4) is not divisible by the attention tensor-parallel size 3"),
            std::string::npos)
      << err;
  pc.tp_size = 4;
  pc.dp_size = 3;
  EXPECT_THROW(RankSet(ModelConfig::from_file(test::golden_dir("v3")), pc, test::golden_dir("v3"), {}), Error);
  // Expert parallelism over 3 ranks (DP attention 3: attention whole on each) of a model of 16 routed experts (its
  // dense width made divisible by 3).
  ModelConfig c = ModelConfig::from_file(test::golden_dir("v3"), nlohmann::json{{"intermediate_size", 255}});
  pc.tp_size = 3;
  pc.dp_size = 3;
  pc.expert_parallel = true;
  err = test::error_text([&] { RankSet r(c, pc, test::golden_dir("v3"), LoadOptions{.dummy = true}); });
  EXPECT_NE(err.find("n_routed_experts (16) is not divisible by the expert-parallel size 3"), std::string::npos) << err;
}

TEST(ParallelCli, EvalLogitsAcrossLayoutsThroughTheBinary) {
  auto dir = test::temp_dir("pcli");
  const std::string model = test::golden_dir("v2");
  std::vector<std::string> files;
  for (std::string layout : {"", "--tp 2", "--dp 2", "--tp 4 --dp 2 --enable-dp-attention"}) {
    const std::string out = (dir / ("out" + std::to_string(files.size()) + ".safetensors")).string();
    auto r = test::run_command(std::string(MLASERVE_BINARY) + " eval-logits --model-path " + model + " --prompts " +
                               model + "/reference.safetensors --out " + out + " --max-new-tokens 6 " + layout);
    ASSERT_EQ(r.exit_code, 0) << layout << ": " << r.output;
    files.push_back(out);
  }
  SafetensorsFile ref(files[0]);
  for (size_t k = 1; k < files.size(); ++k) {
    SafetensorsFile f(files[k]);
    for (int j = 0; j < 5; ++j) {
      EXPECT_LT(test::rel_err(f.tensor("logits_" + std::to_string(j)), ref.tensor("logits_" + std::to_string(j))), 1e-4);
      Tensor a = f.tensor("greedy_" + std::to_string(j)), b = ref.tensor("greedy_" + std::to_string(j));
      EXPECT_EQ(std::vector<int32_t>(a.data_as<int32_t>(), a.data_as<int32_t>() + a.numel()),
                std::vector<int32_t>(b.data_as<int32_t>(), b.data_as<int32_t>() + b.numel()));
    }
  }
}

}  // namespace
