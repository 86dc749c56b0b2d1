// Helpers shared by the GPU tests: one CUDA backend per test binary, bf16-exact random inputs (so the CPU
// reference and the GPU see identical values), and a bf16-aware comparison.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/dtype.h"

namespace mlaserve::test {

inline bool have_gpu() { return cuda_device_count() > 0; }

#define REQUIRE_GPU() \
  if (!::mlaserve::test::have_gpu()) GTEST_SKIP() << "no CUDA device"

// kind 0: default; 1: simple attention kernels; 2: MoE through cuBLAS; 3: no small-batch kernels (cuBLAS and the
// grouped MoE kernels at any batch); 4: default without the one-launch attention of one decode token.
inline Backend& gpu(int kind = 0) {
  static std::unique_ptr<Backend> b[5];
  if (!b[kind]) {
    CudaBackendOptions o;
    o.persistent_bytes = 6LL << 30;
    o.scratch_bytes = 6LL << 30;
    o.simple_kernels = kind == 1;
    o.moe_cublas = kind == 2;
    o.small_batch = kind != 3;
    o.one_token_attention = kind != 4;
    b[kind] = make_cuda_backend(0, o);
  }
  return *b[kind];
}

inline Backend& cpu() {
  static std::unique_ptr<Backend> b = make_cpu_backend();
  return *b;
}

// Host F32 tensor of values N(0, scale^2), rounded to bf16.
inline Tensor rand_host(const Shape& shape, uint64_t seed, float scale = 1.0f) {
  Tensor t = Tensor::empty_host(shape, DType::F32);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  float* p = t.data_as<float>();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = bf16_to_f32(f32_to_bf16(d(rng)));
  return t;
}

// R sampling rows in turn greedy, a seeded top-k draw and a penalised draw (row r: seed seed0 + r; `step` also
// moves the penalised token and its count).
inline std::vector<RowSampling> mixed_sampling(int64_t R, uint64_t seed0, int32_t step) {
  std::vector<RowSampling> ps(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    RowSampling& sp = ps[static_cast<size_t>(r)];
    sp.seed = seed0 + static_cast<uint64_t>(r);
    sp.step = static_cast<uint64_t>(step);
    if (r % 3 == 1) {
      sp.temperature = 0.8f;
      sp.top_k = 20;
    } else if (r % 3 == 2) {
      sp.temperature = 1.1f;
      sp.frequency_penalty = 0.4f;
      sp.penalty_counts = {{static_cast<int32_t>(r) + step + 2, 1 + step}};
    }
  }
  return ps;
}

struct Diff {
  double max_abs = 0, ref_max = 0, rel_l2 = 0;
  int64_t nan = 0;
};

inline Diff diff(const Tensor& ref, const Tensor& got) {
  Diff d;
  EXPECT_EQ(ref.numel(), got.numel());
  const float* r = ref.data_as<const float>();
  const float* g = got.data_as<const float>();
  double num = 0, den = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    if (std::isnan(g[i]) || std::isinf(g[i])) {
      ++d.nan;
      continue;
    }
    const double e = std::fabs(static_cast<double>(r[i]) - g[i]);
    d.max_abs = std::max(d.max_abs, e);
    d.ref_max = std::max(d.ref_max, std::fabs(static_cast<double>(r[i])));
    num += e * e;
    den += static_cast<double>(r[i]) * r[i];
  }
  d.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return d;
}

// bf16 outputs: relative L2 error under rel_tol and max error under max_tol of the reference's largest magnitude.
inline void expect_close(const Tensor& ref, const Tensor& got, double rel_tol, double max_tol, const std::string& what) {
  const Diff d = diff(ref, got);
  EXPECT_EQ(d.nan, 0) << what << ": non-finite outputs";
  EXPECT_LE(d.rel_l2, rel_tol) << what << ": relative L2 error";
  EXPECT_LE(d.max_abs, max_tol * std::max(d.ref_max, 1e-30)) << what << ": max abs error " << d.max_abs << " vs |ref| "
                                                             << d.ref_max;
  std::printf("  %-48s rel_l2 %.2e  max_abs/|ref| %.2e\n", what.c_str(), d.rel_l2, d.max_abs / std::max(d.ref_max, 1e-30));
}

// The golden checkpoints (MLASERVE_GOLDEN_DIR in the environment overrides the path baked in at build time).
inline std::string golden_dir() {
  const char* e = std::getenv("MLASERVE_GOLDEN_DIR");
  return e ? e : MLASERVE_GOLDEN_DIR;
}

// Standard deviation of a host F32 tensor's elements (logit tolerances are relative to it).
inline double stddev(const Tensor& t) {
  const float* x = t.data_as<const float>();
  double s = 0, s2 = 0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    s += x[i];
    s2 += static_cast<double>(x[i]) * x[i];
  }
  const double n = static_cast<double>(t.numel());
  return std::sqrt(std::max(0.0, s2 / n - (s / n) * (s / n)));
}

}  // namespace mlaserve::test
