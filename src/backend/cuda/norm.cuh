// RMSNorm pieces shared by the norm kernels (elementwise.cu) and the products that normalise their own input row
// (gemv.cu: gemv_t_pair_norm), so both compute bit-identical rows. CPU reference: cpu::rmsnorm_row.
#pragma once

#include "backend/cuda/common.cuh"

namespace mlaserve::cuda {

// The 8 sums bf16(residual + x), stored to *dst and returned.
__device__ __forceinline__ uint4 add_residual8(const uint4& x, uint4 residual, uint4* dst) {
  const bf16* xe = reinterpret_cast<const bf16*>(&x);
  bf16* re = reinterpret_cast<bf16*>(&residual);
#pragma unroll
  for (int j = 0; j < 8; ++j) re[j] = __float2bfloat16_rn(__bfloat162float(re[j]) + __bfloat162float(xe[j]));
  *dst = residual;
  return residual;
}

// ss += v_j^2 for the 8 values, in order.
__device__ __forceinline__ void add_squares8(float& ss, const uint4& v) {
  const bf16* e = reinterpret_cast<const bf16*>(&v);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float f = __bfloat162float(e[j]);
    ss += f * f;
  }
}

__device__ __forceinline__ float rms_inverse(float sum_squares, int64_t D, float eps) {
  return 1.0f / sqrtf(sum_squares / static_cast<float>(D) + eps);
}

// bf16(w[j] * (v_j * inv)) for the 8 values.
__device__ __forceinline__ uint4 scale8(const uint4& v, const float* w, float inv) {
  const bf16* e = reinterpret_cast<const bf16*>(&v);
  uint4 o;
  bf16* oe = reinterpret_cast<bf16*>(&o);
#pragma unroll
  for (int j = 0; j < 8; ++j) oe[j] = __float2bfloat16_rn(w[j] * (__bfloat162float(e[j]) * inv));
  return o;
}

}  // namespace mlaserve::cuda
