// FP8 (E4M3) weights on the device: codes made into bf16 the way the host's dequantization makes them, or into bf16
// of exactly their values (the tensor-core path scales the products instead).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/common.cuh"

namespace mlaserve::cuda {

// The 4 E4M3 codes of q (low byte first) as two f16x2 of exactly their values (every E4M3 value, subnormal ones
// included, is a normal f16): lo codes 0-1, hi codes 2-3, the lower code in the lower half. One hardware conversion
// per pair (sm_89 and later).
__device__ __forceinline__ void fp8x4_f16x2(uint32_t q, uint32_t& lo, uint32_t& hi) {
  asm("{\n"
      "  .reg .b16 a, b;\n"
      "  mov.b32 {a, b}, %2;\n"
      "  cvt.rn.f16x2.e4m3x2 %0, a;\n"
      "  cvt.rn.f16x2.e4m3x2 %1, b;\n"
      "}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(q));
}

__device__ __forceinline__ float2 f16x2_to_float2(uint32_t h) {
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// bf16(code * s) for the 8 codes of q (low byte first), packed as a 16-byte vector of 8 bf16: each product rounded
// once to f32 and once to bf16, as the host rounds code * scale when it uploads dequantized weights (the code's f16,
// and so its f32, is exact).
__device__ __forceinline__ uint4 fp8x8_to_bf16(const uint2& q, float s) {
  uint32_t h[4];
  fp8x4_f16x2(q.x, h[0], h[1]);
  fp8x4_f16x2(q.y, h[2], h[3]);
  uint32_t r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = f16x2_to_float2(h[i]);
    r[i] = pack_bf16x2(f.x * s, f.y * s);
  }
  return make_uint4(r[0], r[1], r[2], r[3]);
}

// 4 F8 codes (low byte first) as 4 bf16 of exactly their values (lo: codes 0-1, hi: codes 2-3): through f16 and f32,
// both exact, so the bf16 rounding is too.
__device__ __forceinline__ void fp8x4_bf16(uint32_t q, uint32_t& lo, uint32_t& hi) {
  uint32_t a, b;
  fp8x4_f16x2(q, a, b);
  const float2 fa = f16x2_to_float2(a), fb = f16x2_to_float2(b);
  lo = pack_bf16x2(fa.x, fa.y);
  hi = pack_bf16x2(fb.x, fb.y);
}

}  // namespace mlaserve::cuda
