// FP8 (E4M3) weights on the device: codes made into bf16 the way the host's dequantization makes them, or into bf16
// of exactly their values (the tensor-core path scales the products instead); INT4 code words made into bf16 as the
// host dequantizes them; an FP8 latent cache's E4M3 or E5M2 codes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

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

// bf16((code - z) * s) for the 8 INT4 codes of one 32-bit word (code pairs, column 2 j in the low nibble), packed as
// a 16-byte vector of 8 bf16: each product rounded once to f32 and once to bf16, as the host's dequantization rounds it
// (cpu::dequant_int4).
__device__ __forceinline__ uint4 int4x8_to_bf16(uint32_t codes, float s, float z) {
  uint32_t r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = __fmul_rn(static_cast<float>((codes >> (8 * i)) & 15u) - z, s);
    const float hi = __fmul_rn(static_cast<float>((codes >> (8 * i + 4)) & 15u) - z, s);
    r[i] = pack_bf16x2(lo, hi);
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

// What a latent cache row holds (model/kv_cache.h): bf16 values (None), or E4M3 / E5M2 codes.
enum class CacheCodes : uint8_t { None, E4M3, E5M2 };
__host__ __device__ inline CacheCodes cache_codes(const void* cache_f8, bool e5m2) {
  return !cache_f8 ? CacheCodes::None : e5m2 ? CacheCodes::E5M2 : CacheCodes::E4M3;
}

// x's code in an FP8 cache: nearest, ties to even, saturated to the largest finite value (cpu f32_to_e4m3 /
// f32_to_e5m2).
__device__ __forceinline__ uint8_t cache_code(float x, CacheCodes c) {
  return c == CacheCodes::E5M2 ? __nv_fp8_e5m2(x).__x : __nv_fp8_e4m3(x).__x;
}

// The value of an FP8 cache code (exact in f32 and in bf16).
__device__ __forceinline__ float cache_code_value(uint8_t v, CacheCodes c) {
  if (c == CacheCodes::E5M2) return __half2float(__ushort_as_half(static_cast<unsigned short>(v << 8)));
  __nv_fp8_e4m3 f;
  f.__x = v;
  return static_cast<float>(f);
}

// 4 FP8 cache codes (low byte first) as 4 bf16 of exactly their values (lo: codes 0-1, hi: codes 2-3). An E5M2 code
// is the top byte of its f16, so a byte permutation makes the pairs.
__device__ __forceinline__ void cache_codes4_bf16(uint32_t q, uint32_t& lo, uint32_t& hi, CacheCodes c) {
  if (c != CacheCodes::E5M2) return fp8x4_bf16(q, lo, hi);
  const float2 fa = f16x2_to_float2(__byte_perm(q, 0u, 0x1404)), fb = f16x2_to_float2(__byte_perm(q, 0u, 0x3424));
  lo = pack_bf16x2(fa.x, fa.y);
  hi = pack_bf16x2(fb.x, fb.y);
}

}  // namespace mlaserve::cuda
