#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "engine/sampler.h"

using namespace mlaserve;

namespace {
std::vector<float> logits{2.0f, 1.0f, 0.5f, -1.0f, 3.0f, 0.0f};

std::map<int32_t, int> histogram(const SamplingParams& p, int n, uint64_t seed = 1) {
  SamplerState st;
  st.seed = seed;
  std::vector<float> scratch;
  std::map<int32_t, int> h;
  for (int i = 0; i < n; ++i) ++h[sample_row(logits.data(), 6, p, st, scratch).token];
  return h;
}
}  // namespace

TEST(Sampler, GreedyIsArgmax) {
  SamplingParams p;
  p.temperature = 0.0f;
  auto h = histogram(p, 10);
  EXPECT_EQ(h.size(), 1u);
  EXPECT_EQ(h.begin()->first, 4);
}

TEST(Sampler, TemperatureDistributionMatchesSoftmax) {
  SamplingParams p;
  p.temperature = 1.0f;
  const int n = 40000;
  auto h = histogram(p, n);
  double z = 0;
  for (float v : logits) z += std::exp(v);
  for (int32_t t = 0; t < 6; ++t) EXPECT_NEAR(double(h[t]) / n, std::exp(logits[t]) / z, 0.01) << t;
}

TEST(Sampler, TopKTopPMinPRestrictTheCandidates) {
  SamplingParams p;
  p.top_k = 2;
  auto h = histogram(p, 2000);
  for (auto& [t, c] : h) EXPECT_TRUE(t == 4 || t == 0) << t;
  p = {};
  p.top_p = 0.6f;  // probs: 4: .61, 0: .22 ... -> only token 4
  h = histogram(p, 500);
  EXPECT_EQ(h.size(), 1u);
  p = {};
  p.min_p = 0.3f;  // keep tokens with prob >= 0.3 * p(4): 4 and 0 (0.37 ratio)
  h = histogram(p, 2000);
  for (auto& [t, c] : h) EXPECT_TRUE(t == 4 || t == 0) << t;
  EXPECT_EQ(h.size(), 2u);
}

TEST(Sampler, SeedMakesItReproducible) {
  SamplingParams p;
  p.temperature = 1.5f;
  EXPECT_EQ(histogram(p, 50, 7), histogram(p, 50, 7));
  SamplerState a, b;
  a.seed = b.seed = 99;
  std::vector<float> s;
  for (int i = 0; i < 20; ++i)
    EXPECT_EQ(sample_row(logits.data(), 6, p, a, s).token, sample_row(logits.data(), 6, p, b, s).token);
}

TEST(Sampler, PenaltiesChangeTheArgmax) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.frequency_penalty = 2.0f;
  SamplerState st;
  std::vector<float> s;
  st.observe_output(4);  // 3.0 - 2.0 = 1.0 < 2.0
  EXPECT_EQ(sample_row(logits.data(), 6, p, st, s).token, 0);
  p = {};
  p.temperature = 0.0f;
  p.repetition_penalty = 2.0f;  // 3.0 / 2 = 1.5 < 2.0
  SamplerState st2;
  st2.observe_prompt(std::vector<int32_t>{4});
  EXPECT_EQ(sample_row(logits.data(), 6, p, st2, s).token, 0);
  p = {};
  p.temperature = 0.0f;
  p.presence_penalty = 1.5f;
  SamplerState st3;
  st3.observe_output(4);  // 1.5 < 2.0
  EXPECT_EQ(sample_row(logits.data(), 6, p, st3, s).token, 0);
}

TEST(Sampler, LogprobsAreOfTheModelDistribution) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.return_logprob = true;
  p.top_logprobs_num = 3;
  SamplerState st;
  std::vector<float> s;
  auto r = sample_row(logits.data(), 6, p, st, s);
  double z = 0;
  for (float v : logits) z += std::exp(v);
  EXPECT_NEAR(r.logprob.logprob, 3.0 - std::log(z), 1e-5);
  ASSERT_EQ(r.logprob.top.size(), 3u);
  EXPECT_EQ(r.logprob.top[0].first, 4);
  EXPECT_EQ(r.logprob.top[1].first, 0);
  EXPECT_EQ(r.logprob.top[2].first, 1);
}
