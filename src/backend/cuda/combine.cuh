// The MLA decode combine of one (token, head): used by mla_decode_combine_kernel (mla_decode.cu) and by the W_UV
// product that folds it in at one token (gemv.cu, mla_combine_uv). CPU reference: cpu::mla_attention (one split).
#pragma once

#include "backend/cuda/common.cuh"

namespace mlaserve::cuda {

constexpr int kCombineBatch = 8;  // splits read at once

// acc[j] = sum over the np splits i of exp2(lse_i - max) * partial_o_i[c], c = threadIdx.x + j * THREADS (c < kvr),
// and inv_total = 1 / sum_i exp2(lse_i - max); a split's rows are those of partial first + i, head h of nh. The
// splits' weights are computed once, THREADS at a time, into wts (THREADS floats of shared memory); each thread sums
// its columns over them in split order (independent loads, no per-split recomputation). Empty splits (lse -inf, weight
// 0) leave their rows unwritten: not read, and they add nothing. red: 32 floats of shared memory. Every thread of the
// block (THREADS of them) must call it.
template <int THREADS, int COLS>
__device__ __forceinline__ void combine_splits(const float* partial_o, const float* partial_lse, int first, int np,
                                               int nh, int h, int kvr, float* red, float* wts, float (&acc)[COLS],
                                               float& inv_total) {
  const int tid = threadIdx.x;
  auto lse = [&](int i) { return partial_lse[static_cast<int64_t>(first + i) * nh + h]; };
  float mx = -INFINITY;
  for (int i = tid; i < np; i += THREADS) mx = fmaxf(mx, lse(i));
  mx = block_max(mx, red);
  float total = 0.0f;
  for (int i = tid; i < np; i += THREADS) total += exp2f(lse(i) - mx);
  total = block_sum(total, red);
  inv_total = 1.0f / total;
#pragma unroll
  for (int j = 0; j < COLS; ++j) acc[j] = 0.0f;
  for (int i0 = 0; i0 < np; i0 += THREADS) {
    const int n = min(THREADS, np - i0);
    __syncthreads();
    if (tid < n) wts[tid] = exp2f(lse(i0 + tid) - mx);
    __syncthreads();
    for (int i = 0; i < n; i += kCombineBatch) {
      float w[kCombineBatch], v[kCombineBatch][COLS];
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u) {
        w[u] = i + u < n ? wts[i + u] : 0.0f;
        const float* po = partial_o + (static_cast<int64_t>(first + i0 + i + u) * nh + h) * kvr;
#pragma unroll
        for (int j = 0; j < COLS; ++j) {
          const int c = tid + j * THREADS;
          v[u][j] = w[u] > 0.0f && c < kvr ? po[c] : 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < kCombineBatch; ++u)
        if (w[u] > 0.0f)
#pragma unroll
          for (int j = 0; j < COLS; ++j) acc[j] += w[u] * v[u][j];
    }
  }
}

}  // namespace mlaserve::cuda
