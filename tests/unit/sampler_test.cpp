// The engine's side of sampling: the RowSampling it hands the device sampler, and host top-N logprobs.
// (The draw itself is Backend::sample, tested in sampling_test.cpp.)
#include <gtest/gtest.h>

#include <cmath>

#include "engine/sampler.h"

using namespace mlaserve;

TEST(SamplerState, RowCarriesParamsSeedStepAndCounts) {
  SamplerState st;
  st.seed = 42;
  st.step = 3;
  st.observe_output(7);
  st.observe_output(7);
  st.observe_output(2);
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = -1;
  p.top_p = 0.9f;
  p.frequency_penalty = 0.5f;
  RowSampling r = st.row(p);
  EXPECT_FLOAT_EQ(r.temperature, 0.7f);
  EXPECT_EQ(r.top_k, 0);  // "all" on the device side
  EXPECT_EQ(r.seed, 42u);
  EXPECT_EQ(r.step, 3u);
  ASSERT_EQ(r.penalty_counts.size(), 2u);
  EXPECT_EQ(r.penalty_counts[0], (std::pair<int32_t, int32_t>{2, 1}));
  EXPECT_EQ(r.penalty_counts[1], (std::pair<int32_t, int32_t>{7, 2}));
  p.frequency_penalty = 0.0f;
  EXPECT_TRUE(st.row(p).penalty_counts.empty());  // no penalties: nothing to send
}

TEST(TopLogprobs, AreOfTheModelDistribution) {
  std::vector<float> x{2.0f, 1.0f, 0.5f, -1.0f, 3.0f, 0.0f};
  TokenLogprob t = top_logprobs(x.data(), 6, 0, 3);
  double z = 0;
  for (float v : x) z += std::exp(v);
  EXPECT_NEAR(t.logprob, 2.0 - std::log(z), 1e-5);
  ASSERT_EQ(t.top.size(), 3u);
  EXPECT_EQ(t.top[0].first, 4);
  EXPECT_EQ(t.top[1].first, 0);
  EXPECT_EQ(t.top[2].first, 1);
  EXPECT_NEAR(t.top[0].second, 3.0 - std::log(z), 1e-5);
  EXPECT_EQ(t.rank, 2);  // only token 4 is more likely
  EXPECT_EQ(top_logprobs(x.data(), 6, 3, 0).rank, 6);
  EXPECT_EQ(argmax_row(x.data(), 6), 4);
}
