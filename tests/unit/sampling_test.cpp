// The CPU sampler (Backend::sample on the CPU backend): the reference the engine's sampler and the GPU sampler
// are held to. Greedy, filters, penalties, determinism of the counter-based noise, and the sampled frequencies.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <vector>

#include "backend/backend.h"
#include "model/forward_batch.h"

namespace mlaserve {
namespace {

std::vector<int32_t> run(Backend& be, const std::vector<float>& logits, int64_t V,
                         const std::vector<RowSampling>& ps, std::vector<float>* logprobs = nullptr) {
  const int64_t R = static_cast<int64_t>(ps.size());
  Tensor lg = Tensor::empty_host({R, V}, DType::F32);
  for (int64_t r = 0; r < R; ++r) std::copy(logits.begin(), logits.end(), lg.data_as<float>() + r * V);
  Tensor ids = be.alloc({R}, DType::I32), lp = be.alloc({R}, DType::F32);
  be.sample(lg, ps, ids, &lp);
  std::vector<int32_t> out(static_cast<size_t>(R));
  be.download(ids, out.data());
  if (logprobs) {
    logprobs->resize(static_cast<size_t>(R));
    be.download(lp, logprobs->data());
  }
  return out;
}

TEST(Sampling, GreedyIsArgmaxWithLowestIdOnTies) {
  auto be = make_cpu_backend();
  std::vector<float> l = {0.1f, 2.0f, -1.0f, 2.0f, 0.5f};
  std::vector<float> lp;
  EXPECT_EQ(run(*be, l, 5, {RowSampling{}}, &lp)[0], 1);
  double z = 0;
  for (float x : l) z += std::exp(x - 2.0);
  EXPECT_NEAR(lp[0], -std::log(z), 1e-5);
}

TEST(Sampling, TopKOneAndTinyTopPAreGreedy) {
  auto be = make_cpu_backend();
  std::vector<float> l = {0.1f, 1.0f, 3.0f, 2.9f, 0.5f};
  std::vector<RowSampling> ps(40);
  for (size_t i = 0; i < ps.size(); ++i) {
    ps[i].temperature = 1.5f;
    ps[i].seed = i;
    if (i % 2) ps[i].top_k = 1;
    else ps[i].top_p = 1e-4f;
  }
  for (int32_t id : run(*be, l, 5, ps)) EXPECT_EQ(id, 2);
}

TEST(Sampling, FiltersRestrictTheSupport) {
  auto be = make_cpu_backend();
  // probabilities ~ 0.5, 0.25, 0.125, 0.0625, ...
  std::vector<float> l;
  for (int i = 0; i < 10; ++i) l.push_back(-0.6931472f * i);
  std::vector<RowSampling> ps(600);
  for (size_t i = 0; i < ps.size(); ++i) {
    ps[i].temperature = 1.0f;
    ps[i].seed = 7;
    ps[i].step = i;
  }
  auto check = [&](auto setup, int32_t max_id) {
    auto p = ps;
    for (auto& s : p) setup(s);
    std::map<int32_t, int> seen;
    for (int32_t id : run(*be, l, 10, p)) ++seen[id];
    EXPECT_LE(seen.rbegin()->first, max_id);
    EXPECT_EQ(seen.begin()->first, 0);
    EXPECT_GE(static_cast<int32_t>(seen.size()), max_id + 1) << "every kept token is drawn sometimes";
  };
  check([](RowSampling& s) { s.top_k = 3; }, 2);
  check([](RowSampling& s) { s.top_p = 0.8f; }, 2);   // 0.5 + 0.25 < 0.8 <= 0.875
  check([](RowSampling& s) { s.min_p = 0.2f; }, 2);   // p / p_max >= 0.2 keeps 1, 0.5, 0.25
  check([](RowSampling& s) { s.top_k = 5; s.top_p = 0.6f; }, 1);
}

TEST(Sampling, FrequenciesFollowTheDistribution) {
  auto be = make_cpu_backend();
  std::vector<float> l = {1.0f, 0.0f, -1.0f, 0.5f};
  const int n = 20000;
  std::vector<RowSampling> ps(n);
  for (int i = 0; i < n; ++i) {
    ps[i].temperature = 0.8f;
    ps[i].seed = 99;
    ps[i].step = static_cast<uint64_t>(i);
  }
  std::vector<int> cnt(4, 0);
  for (int32_t id : run(*be, l, 4, ps)) ++cnt[id];
  double z = 0;
  for (float x : l) z += std::exp(x / 0.8);
  for (int v = 0; v < 4; ++v) {
    const double p = std::exp(l[v] / 0.8) / z;
    EXPECT_NEAR(cnt[v] / static_cast<double>(n), p, 4.0 * std::sqrt(p * (1 - p) / n) + 1e-3) << "token " << v;
  }
}

TEST(Sampling, DeterministicPerSeedAndStep) {
  auto be = make_cpu_backend();
  std::vector<float> l(1000);
  for (int i = 0; i < 1000; ++i) l[i] = std::sin(i * 0.37f) * 2.0f;
  std::vector<RowSampling> ps(64);
  for (size_t i = 0; i < ps.size(); ++i) {
    ps[i].temperature = 1.0f;
    ps[i].seed = 5;
    ps[i].step = i % 8;
  }
  auto a = run(*be, l, 1000, ps), b = run(*be, l, 1000, ps);
  EXPECT_EQ(a, b);
  for (size_t i = 8; i < a.size(); ++i) EXPECT_EQ(a[i], a[i % 8]);
  std::set<int32_t> distinct(a.begin(), a.begin() + 8);
  EXPECT_GT(distinct.size(), 1u) << "different steps draw different tokens";
}

TEST(Sampling, Penalties) {
  auto be = make_cpu_backend();
  std::vector<float> l = {2.0f, 1.9f, -1.0f};
  RowSampling rep;
  rep.repetition_penalty = 1.2f;  // 2.0 / 1.2 = 1.67 < 1.9
  rep.penalty_counts = {{0, 1}};
  RowSampling freq;
  freq.frequency_penalty = 0.1f;  // 2.0 - 0.3 = 1.7
  freq.penalty_counts = {{0, 3}};
  RowSampling pres;
  pres.presence_penalty = 0.05f;  // 2.0 - 0.05 = 1.95 > 1.9: still 0
  pres.penalty_counts = {{0, 3}};
  RowSampling neg;
  neg.repetition_penalty = 2.0f;  // negative logits are multiplied: -1 -> -2; 0 unchanged here
  neg.penalty_counts = {{2, 1}};
  auto ids = run(*be, l, 3, {rep, freq, pres, neg});
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 1, 0, 0}));
}

// logit_bias is added to the logits first: it moves the argmax, -inf bans a token even at temperature > 0, and the
// penalties apply to the biased logit (repetition divides it).
TEST(Sampling, LogitBiasComesFirst) {
  auto be = make_cpu_backend();
  std::vector<float> l = {2.0f, 1.9f, -1.0f};
  RowSampling up;
  up.logit_bias = {{2, 3.5f}};  // -1 + 3.5 = 2.5 > 2.0
  RowSampling down;
  down.logit_bias = {{0, -0.2f}};  // 1.8 < 1.9
  RowSampling ban;  // sampled at temperature 1 with only tokens 0 and 2 left possible... token 0 banned too
  ban.temperature = 1.0f;
  ban.seed = 5;
  ban.logit_bias = {{0, -std::numeric_limits<float>::infinity()}, {1, -std::numeric_limits<float>::infinity()}};
  RowSampling rep;  // (2.0 + 2.0) / 2 = 2.0 < 1.9 + 0.5: bias before the repetition penalty
  rep.repetition_penalty = 2.0f;
  rep.penalty_counts = {{0, 1}};
  rep.logit_bias = {{0, 2.0f}, {1, 0.5f}};
  std::vector<float> lps;
  auto ids = run(*be, l, 3, {up, down, ban, rep}, &lps);
  EXPECT_EQ(ids, (std::vector<int32_t>{2, 1, 2, 1}));
  EXPECT_NEAR(lps[2], 0.0f, 1e-6f);  // the only token left
  for (uint64_t step = 0; step < 20; ++step) {  // never a banned token, whatever the noise
    ban.step = step;
    EXPECT_EQ(run(*be, l, 3, {ban})[0], 2);
  }
}

// A token still in flight (overlap scheduling) is this step's input id, resolved from the previous step's samples;
// pending_input makes the sampler count it once more: added to its id's entry, or as an entry of its own, with the
// presence and repetition penalties still applied once per id.
TEST(Sampling, PendingTokenCountsOnceMore) {
  auto be = make_cpu_backend();
  ForwardBatch b;
  b.input_ids = {-1, 2};  // token 0: the id sampled for row 0 of the previous step
  be->begin_step(b);
  Tensor prev = Tensor::empty_host({1}, DType::I32);
  prev.data_as<int32_t>()[0] = 0;
  be->resolve_prev_ids(be->upload(prev, DType::I32));
  std::vector<float> l = {2.0f, 1.9f, 1.8f, -1.0f};
  RowSampling freq;  // id 0 counted twice: 2.0 - 0.12 < 1.9 (once: 1.94, still the maximum)
  freq.frequency_penalty = 0.06f;
  freq.penalty_counts = {{0, 1}};
  RowSampling pres = freq;  // presence once per id: 2.0 - 0.07 > 1.9 (twice would be 1.86)
  pres.frequency_penalty = 0.0f;
  pres.presence_penalty = 0.07f;
  RowSampling rep;  // id 0 not listed yet: a new entry, 2.0 / 1.2 < 1.9
  rep.repetition_penalty = 1.2f;
  RowSampling other = rep;  // the pending token is input 1 (id 2): id 0 keeps its logit
  std::vector<RowSampling> ps = {freq, pres, rep, other};
  for (size_t i = 0; i < 3; ++i) ps[i].pending_input = 0;
  ps[3].pending_input = 1;
  EXPECT_EQ(run(*be, l, 4, ps), (std::vector<int32_t>{1, 0, 1, 0}));
  ps[0].pending_input = 2;  // past the step's 2 tokens
  EXPECT_THROW(run(*be, l, 4, ps), std::exception);
}

}  // namespace
}  // namespace mlaserve
