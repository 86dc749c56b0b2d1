// Backend::moe_experts with shared experts (the CPU reference the GPU's fused small-batch MoE is held to): the
// routed experts' sum plus the shared experts' MLP, computed here by hand; and the errors for mismatched weights.
// Also Backend::moe_gate, the router product + routing op.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "test_util.h"

namespace mlaserve {
namespace {

Tensor random_tensor(Backend& be, const Shape& shape, uint64_t seed, float scale) {
  Tensor h = Tensor::empty_host(shape, DType::F32);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  for (int64_t i = 0; i < h.numel(); ++i) h.data_as<float>()[i] = nd(rng);
  return be.upload(h, DType::F32);
}

// y[n] = sum_k w[n, k] x[k]
std::vector<float> matvec(const Tensor& w, const float* x) {
  const int64_t N = w.size(0), K = w.size(1);
  std::vector<float> y(static_cast<size_t>(N), 0.0f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) y[static_cast<size_t>(n)] += w.data_as<float>()[n * K + k] * x[k];
  return y;
}

TEST(MoeShared, SharedExpertsAreAddedToTheRoutedSum) {
  auto be = make_cpu_backend();
  const int64_t T = 3, H = 16, E = 4, k = 2, I = 8, Is = 12;
  Tensor x = random_tensor(*be, {T, H}, 1, 1.0f);
  Tensor gu = random_tensor(*be, {E, 2 * I, H}, 2, 0.3f), dn = random_tensor(*be, {E, H, I}, 3, 0.3f);
  Tensor sgu = random_tensor(*be, {2 * Is, H}, 4, 0.3f), sdn = random_tensor(*be, {H, Is}, 5, 0.3f);
  Tensor ids = be->alloc({T, k}, DType::I32), w = random_tensor(*be, {T, k}, 6, 0.5f);
  const int32_t choice[] = {0, 3, 2, 1, 3, 0};
  std::copy(std::begin(choice), std::end(choice), ids.data_as<int32_t>());

  Tensor routed = be->alloc({T, H}, DType::F32), both = be->alloc({T, H}, DType::F32);
  be->moe_experts(x, ids, w, gu, dn, 0, nullptr, nullptr, 0, routed);
  be->moe_experts(x, ids, w, gu, dn, 0, &sgu, &sdn, 0, both);
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<float> g = matvec(sgu, x.data_as<float>() + t * H);
    std::vector<float> act(static_cast<size_t>(Is));
    for (int64_t i = 0; i < Is; ++i) {
      const float gv = g[static_cast<size_t>(i)];
      act[static_cast<size_t>(i)] = gv / (1.0f + std::exp(-gv)) * g[static_cast<size_t>(Is + i)];
    }
    const std::vector<float> shared = matvec(sdn, act.data());
    for (int64_t h = 0; h < H; ++h) {
      const float want = routed.data_as<float>()[t * H + h] + shared[static_cast<size_t>(h)];
      EXPECT_NEAR(both.data_as<float>()[t * H + h], want, 1e-5f * (1.0f + std::fabs(want))) << "t " << t << " h " << h;
    }
    float diff = 0.0f;  // the shared term is not negligible: the test would notice it missing
    for (int64_t h = 0; h < H; ++h) diff += std::fabs(shared[static_cast<size_t>(h)]);
    EXPECT_GT(diff, 0.1f);
  }
}

TEST(MoeShared, MismatchedSharedWeightsAreClearErrors) {
  auto be = make_cpu_backend();
  const int64_t T = 2, H = 8, E = 2, I = 4;
  Tensor x = random_tensor(*be, {T, H}, 1, 1.0f), w = random_tensor(*be, {T, 1}, 2, 1.0f);
  Tensor gu = random_tensor(*be, {E, 2 * I, H}, 3, 0.3f), dn = random_tensor(*be, {E, H, I}, 4, 0.3f);
  Tensor ids = be->alloc({T, 1}, DType::I32), out = be->alloc({T, H}, DType::F32);
  Tensor sgu = random_tensor(*be, {2 * 6, H}, 5, 0.3f), bad_dn = random_tensor(*be, {H, 5}, 6, 0.3f);
  auto message = [&](const Tensor* g, const Tensor* d) {
    const std::string e = test::error_text([&] { be->moe_experts(x, ids, w, gu, dn, 0, g, d, 0, out); });
    return e.empty() ? std::string("no error") : e;
  };
  EXPECT_NE(message(&sgu, nullptr).find("need both their gate_up and down"), std::string::npos);
  EXPECT_NE(message(&sgu, &bad_dn).find("shared experts gate_up [12, 8] / down [8, 5]"), std::string::npos)
      << message(&sgu, &bad_dn);
}

// Backend::moe_gate (what the model calls; the CUDA backend fuses it at one token): the routing of the router's
// logits, checked here against logits computed by hand, and a clear error for a router of the wrong width.
// Fused shared experts: the router appends n_fixed experts fixed_base + j with weight 1 after its picks, and the
// shared MLP split by width into that many experts of the routed width, taken so, is the shared MLP added.
TEST(MoeShared, FusedSharedExpertsAreTheSharedMlp) {
  auto be = make_cpu_backend();
  const int64_t T = 3, H = 16, E = 4, k = 2, I = 8, ns = 2, Is = ns * I;
  Tensor x = random_tensor(*be, {T, H}, 11, 1.0f), router = random_tensor(*be, {E, H}, 12, 1.0f);
  RouterParams rp;
  rp.top_k = k;
  rp.routed_scaling_factor = 2.5f;
  Tensor ids = be->alloc({T, k}, DType::I32), w = be->alloc({T, k}, DType::F32);
  be->moe_gate(x, router, nullptr, rp, ids, w);
  RouterParams fixed = rp;
  fixed.n_fixed = static_cast<int32_t>(ns);
  fixed.fixed_base = static_cast<int32_t>(E);
  ASSERT_EQ(fixed.ids_per_token(), k + ns);
  Tensor fids = be->alloc({T, k + ns}, DType::I32), fw = be->alloc({T, k + ns}, DType::F32);
  be->moe_gate(x, router, nullptr, fixed, fids, fw);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(fids.data_as<int32_t>()[t * (k + ns) + j], ids.data_as<int32_t>()[t * k + j]) << t << " " << j;
      EXPECT_EQ(fw.data_as<float>()[t * (k + ns) + j], w.data_as<float>()[t * k + j]) << t << " " << j;
    }
    for (int64_t j = 0; j < ns; ++j) {
      EXPECT_EQ(fids.data_as<int32_t>()[t * (k + ns) + k + j], E + j) << t << " " << j;
      EXPECT_EQ(fw.data_as<float>()[t * (k + ns) + k + j], 1.0f) << t << " " << j;
    }
  }
  // The experts: E routed, then the shared MLP's columns [j I, (j + 1) I) as expert E + j.
  Tensor gu = random_tensor(*be, {E + ns, 2 * I, H}, 13, 0.3f), dn = random_tensor(*be, {E + ns, H, I}, 14, 0.3f);
  Tensor sgu = be->alloc({2 * Is, H}, DType::F32), sdn = be->alloc({H, Is}, DType::F32);
  for (int64_t j = 0; j < ns; ++j)
    for (int64_t i = 0; i < I; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const float* g = gu.data_as<float>() + (E + j) * 2 * I * H;
        sgu.data_as<float>()[(j * I + i) * H + h] = g[i * H + h];
        sgu.data_as<float>()[(Is + j * I + i) * H + h] = g[(I + i) * H + h];
        sdn.data_as<float>()[h * Is + j * I + i] = dn.data_as<float>()[((E + j) * H + h) * I + i];
      }
  Tensor apart = be->alloc({T, H}, DType::F32), fused = be->alloc({T, H}, DType::F32);
  be->moe_experts(x, ids, w, gu.rows(0, E), dn.rows(0, E), 0, &sgu, &sdn, 0, apart);
  be->moe_experts(x, fids, fw, gu, dn, 0, nullptr, nullptr, static_cast<int32_t>(ns), fused);
  for (int64_t i = 0; i < T * H; ++i) {
    const float want = apart.data_as<float>()[i];
    EXPECT_NEAR(fused.data_as<float>()[i], want, 1e-5f * (1.0f + std::fabs(want))) << i;
  }
  // n_fixed names the last experts with weight 1 (a backend may take them before reading the ids): checked.
  Tensor out = be->alloc({T, H}, DType::F32);
  auto error_of = [&](const Tensor& i, const Tensor& wt, int32_t n_fixed) {
    return test::error_text([&] { be->moe_experts(x, i, wt, gu, dn, 0, nullptr, nullptr, n_fixed, out); });
  };
  EXPECT_NE(error_of(fids, fw, static_cast<int32_t>(k + ns)).find("fixed experts"), std::string::npos);
  Tensor moved = be->alloc({T, k + ns}, DType::I32), halved = be->alloc({T, k + ns}, DType::F32);
  be->copy(fids, moved);
  be->copy(fw, halved);
  moved.data_as<int32_t>()[(T - 1) * (k + ns) + k] = 0;  // the last token's first fixed id
  halved.data_as<float>()[k + ns - 1] = 0.5f;             // the first token's last fixed weight
  EXPECT_NE(error_of(moved, fw, static_cast<int32_t>(ns)).find("token 2's fixed id 0 is 0"), std::string::npos);
  EXPECT_NE(error_of(fids, halved, static_cast<int32_t>(ns)).find("token 0's fixed id 1"), std::string::npos);
  EXPECT_EQ(error_of(fids, fw, static_cast<int32_t>(ns)), "");
}

TEST(MoeShared, GateRoutesTheRouterLogits) {
  auto be = make_cpu_backend();
  const int64_t T = 2, H = 6, E = 5;
  Tensor x = random_tensor(*be, {T, H}, 7, 1.0f), router = random_tensor(*be, {E, H}, 8, 1.0f);
  RouterParams rp;
  rp.top_k = 2;
  rp.norm_topk_prob = true;
  Tensor ids = be->alloc({T, 2}, DType::I32), w = be->alloc({T, 2}, DType::F32);
  be->moe_gate(x, router, nullptr, rp, ids, w);
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<float> lg = matvec(router, x.data_as<float>() + t * H);
    std::vector<int32_t> order(static_cast<size_t>(E));
    for (int32_t e = 0; e < E; ++e) order[static_cast<size_t>(e)] = e;
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return lg[a] > lg[b]; });
    EXPECT_EQ(ids.data_as<int32_t>()[t * 2], order[0]) << "token " << t;
    EXPECT_EQ(ids.data_as<int32_t>()[t * 2 + 1], order[1]) << "token " << t;
    // Normalised over the two picks: softmax ratio exp(l0) / (exp(l0) + exp(l1)).
    const float l0 = lg[static_cast<size_t>(order[0])], l1 = lg[static_cast<size_t>(order[1])];
    EXPECT_NEAR(w.data_as<float>()[t * 2], 1.0f / (1.0f + std::exp(l1 - l0)), 1e-5f);
    EXPECT_NEAR(w.data_as<float>()[t * 2] + w.data_as<float>()[t * 2 + 1], 1.0f, 1e-5f);
  }
  Tensor narrow = random_tensor(*be, {E, H - 1}, 9, 1.0f);
  const std::string e = test::error_text([&] { be->moe_gate(x, narrow, nullptr, rp, ids, w); });
  EXPECT_NE(e.find("moe_gate: router [5, 5] does not match input [2, 6]"), std::string::npos)
      << "a router of the wrong width: " << e;
}

}  // namespace
}  // namespace mlaserve
