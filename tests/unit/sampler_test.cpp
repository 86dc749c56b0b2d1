// The engine's side of sampling: the RowSampling it hands the device sampler, and host top-N logprobs.
// (The draw itself is Backend::sample, tested in sampling_test.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
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

// vLLM's bad words: a sequence's last token is banned exactly where the output ends with the rest of it (a one-token
// word always); the ban reuses a logit_bias entry of the same token. Only multi-token words (or a constraint) make the
// next draw wait for the previous token.
TEST(BadWords, BanTheLastTokenWhereTheRestEndsTheOutput) {
  SamplingParams p;
  p.bad_words_ids = {{9}, {4, 5, 6}, {5, 7}};
  EXPECT_TRUE(needs_previous_token(p));
  auto banned = [&](std::vector<int32_t> output, std::vector<std::pair<int32_t, float>> bias = {}) {
    RowSampling row;
    row.logit_bias = std::move(bias);
    ban_bad_words(p, output, row);
    std::vector<int32_t> ids;
    for (const auto& [tok, b] : row.logit_bias)
      if (std::isinf(b) && b < 0) ids.push_back(tok);
    return ids;
  };
  EXPECT_EQ(banned({}), (std::vector<int32_t>{9}));
  EXPECT_EQ(banned({4}), (std::vector<int32_t>{9}));
  EXPECT_EQ(banned({1, 4, 5}), (std::vector<int32_t>{9, 6, 7}));
  EXPECT_EQ(banned({4, 5, 1}), (std::vector<int32_t>{9}));
  EXPECT_EQ(banned({5}), (std::vector<int32_t>{9, 7}));
  // An existing bias entry becomes the ban (ids stay unique).
  RowSampling row;
  row.logit_bias = {{7, 2.0f}};
  ban_bad_words(p, std::vector<int32_t>{5}, row);
  ASSERT_EQ(row.logit_bias.size(), 2u);
  EXPECT_EQ(row.logit_bias[0].first, 7);
  EXPECT_TRUE(std::isinf(row.logit_bias[0].second) && row.logit_bias[0].second < 0);
  p.bad_words_ids = {{9}, {3}};
  EXPECT_FALSE(needs_previous_token(p));
}

// allowed_token_ids as a mask, and its intersection with a constraint's mask already on the row.
TEST(AllowedTokens, MaskAndIntersection) {
  const std::vector<int32_t> ids{0, 31, 32, 70};
  auto m = token_mask(ids);
  ASSERT_EQ(m->size(), 3u);
  for (int32_t id = 0; id < 100; ++id)
    EXPECT_EQ(mask_has(*m, id), std::find(ids.begin(), ids.end(), id) != ids.end()) << id;
  EXPECT_FALSE(mask_has(*m, -1));
  RowSampling row;
  restrict_to(row, m);
  EXPECT_EQ(row.allowed, m);  // nothing before: the mask itself
  restrict_to(row, token_mask(std::vector<int32_t>{31, 33}));
  for (int32_t id = 0; id < 100; ++id) EXPECT_EQ(mask_has(*row.allowed, id), id == 31) << id;
  RowSampling none;
  restrict_to(none, nullptr);
  EXPECT_EQ(none.allowed, nullptr);
}
