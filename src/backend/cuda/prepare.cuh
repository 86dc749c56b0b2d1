// MLA's per-step preparation, shared by the kernels that run it (elementwise.cu's own launches, and gemv.cu's q_lat
// product, which takes it as an extra row of blocks): q's RoPE (rope_q_pairs) and the latent-cache write
// (write_latent_row). CPU references: cpu::rope_pairs, CpuBackend::mla_write_latent.
#pragma once

#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/kernels.h"

namespace mlaserve::cuda {

// x as the cache holds it, in bf16 (an FP8 cache: the value of its code, cache_code).
__device__ __forceinline__ bf16 cache_value(float x, CacheCodes codes) {
  if (codes != CacheCodes::None) x = cache_code_value(cache_code(x, codes), codes);
  return __float2bfloat16_rn(x);
}

// Pair i of a rope part (x0, x1) rotated by position pos, each rounded to bf16 (an FP8 cache: to its code's value
// first).
__device__ __forceinline__ void rotated_pair(float x0, float x1, int i, int32_t pos, const float* inv_freq,
                                             float factor, bf16& y0, bf16& y1,
                                             CacheCodes codes = CacheCodes::None) {
  const float ang = inv_freq[i] * static_cast<float>(pos);
  const float c = cosf(ang) * factor, s = sinf(ang) * factor;
  y0 = cache_value(x0 * c - x1 * s, codes);
  y1 = cache_value(x0 * s + x1 * c, codes);
}

__device__ __forceinline__ void rotate_pair(bf16* x, int i, int32_t pos, const float* inv_freq, float factor) {
  rotated_pair(__bfloat162float(x[2 * i]), __bfloat162float(x[2 * i + 1]), i, pos, inv_freq, factor, x[2 * i],
               x[2 * i + 1]);
}

// Rotates pairs [begin, end) of step over the rope parts of q (pair i: head row i / half, pair i % half).
__device__ __forceinline__ void rope_q_pairs(bf16* q, int64_t n, int32_t nh, int32_t nope, int32_t rope,
                                             const int32_t* positions, const float* inv_freq, float factor,
                                             int64_t first, int64_t step) {
  const int32_t half = rope / 2, hd = nope + rope;
  for (int64_t i = first; i < n; i += step) {
    const int64_t th = i / half;
    const int32_t p = static_cast<int32_t>(i - th * half);
    const int64_t t = th / nh;
    rotate_pair(q + th * hd + nope, p, positions[t], inv_freq, factor);
  }
}

// A latent row as the cache holds it (one block, any size >= 128): dst = src with c_kv normalised (weights w) and
// k_pe rotated to position pos; an FP8 cache: each value that of its code. dst may be src.
__device__ __forceinline__ void latent_row(const bf16* src, bf16* dst, int32_t kvr, int32_t rope, const float* w,
                                           float eps, int32_t pos, const float* inv_freq, float factor,
                                           CacheCodes codes = CacheCodes::None) {
  __shared__ float red[32];
  // The sum of squares over the first kLatentSumThreads threads whatever the block size, so every kernel that runs
  // this (128 or 256 threads) rounds it the same way.
  constexpr int kLatentSumThreads = 128;
  float ss = 0.0f;
  if (threadIdx.x < kLatentSumThreads)
    for (int i = threadIdx.x; i < kvr; i += kLatentSumThreads) {
      const float v = __bfloat162float(src[i]);
      ss += v * v;
    }
  ss = block_sum(ss, red);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(kvr) + eps);
  __syncthreads();  // every thread has read the row before it is overwritten
  for (int i = threadIdx.x; i < kvr; i += blockDim.x)
    dst[i] = cache_value(w[i] * (__bfloat162float(src[i]) * inv), codes);
  for (int i = threadIdx.x; i < rope / 2; i += blockDim.x)
    rotated_pair(__bfloat162float(src[kvr + 2 * i]), __bfloat162float(src[kvr + 2 * i + 1]), i, pos, inv_freq, factor,
                 dst[kvr + 2 * i], dst[kvr + 2 * i + 1], codes);
}

// Token t's latent row: made as the cache holds it (latent_row), written back and into its cache slot (one block):
// into cache (bf16) or, when cache_f8 is given instead, as E4M3 (E5M2 when e5m2) codes (exact: the row holds their
// values).
__device__ __forceinline__ void write_latent_row(int64_t t, bf16* latent, int32_t kvr, int32_t rope, const float* w,
                                                 float eps, const int32_t* positions, const int32_t* slots,
                                                 const float* inv_freq, float factor, bf16* cache,
                                                 uint8_t* cache_f8, bool e5m2) {
  const int32_t W = kvr + rope;
  bf16* row = latent + t * W;
  const CacheCodes codes = cache_codes(cache_f8, e5m2);
  latent_row(row, row, kvr, rope, w, eps, positions[t], inv_freq, factor, codes);
  __syncthreads();
  const int64_t slot = slots[t];
  if (cache_f8) {
    uint8_t* dst = cache_f8 + slot * W;
    for (int i = threadIdx.x; i < W; i += blockDim.x) dst[i] = cache_code(__bfloat162float(row[i]), codes);
    return;
  }
  bf16* dst = cache + slot * W;
  for (int i = threadIdx.x; i < W; i += blockDim.x) dst[i] = row[i];
}

// Block b of nb (nb > T): blocks [0, T) write the latent rows, the rest rotate q. Any block size >= 128.
__device__ __forceinline__ void mla_prepare_block(const MlaPrepArgs& a, int64_t b, int64_t nb) {
  if (b < a.T) {
    write_latent_row(b, a.latent, a.kvr, a.rope, a.norm_w, a.eps, a.positions, a.slots, a.inv_freq, a.factor,
                     a.cache, a.cache_f8, a.cache_e5m2);
    return;
  }
  rope_q_pairs(a.q, a.T * a.nh * (a.rope / 2), a.nh, a.nope, a.rope, a.positions, a.inv_freq, a.factor,
               (b - a.T) * static_cast<int64_t>(blockDim.x) + threadIdx.x, (nb - a.T) * static_cast<int64_t>(blockDim.x));
}

}  // namespace mlaserve::cuda
