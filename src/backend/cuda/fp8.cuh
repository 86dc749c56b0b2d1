// FP8 (E4M3) weights on the device: codes made into bf16 the way the host's dequantization makes them, or into bf16
// of exactly their values (the tensor-core path scales the products instead).
#pragma once

#include <cuda_bf16.h>

#include "backend/cuda/common.cuh"

namespace mlaserve::cuda {

// f32 of code * 2^-120 for the code in the top byte of t, exactly (integer operations only): the sign and the 7 other
// bits placed where f32 keeps them (E4M3's exponent bias is 7, f32's 127; subnormal codes become subnormal f32).
__device__ __forceinline__ float fp8_top_byte_scaled(uint32_t t) {
  return __int_as_float((static_cast<int32_t>(t) >> 4) & static_cast<int32_t>(0x87F00000u));
}

// bf16(code * s) for the 8 codes of q (low byte first), packed as a 16-byte vector of 8 bf16: each product rounded
// once to f32 and once to bf16, as the host rounds code * scale when it uploads dequantized weights (code * 2^-120
// times 2^120 is exact, so the product is the f32 of code * s).
__device__ __forceinline__ uint4 fp8x8_to_bf16(const uint2& q, float s) {
  auto f = [&](uint32_t t) { return fp8_top_byte_scaled(t) * 0x1p120f * s; };
  return make_uint4(pack_bf16x2(f(q.x << 24), f(q.x << 16)), pack_bf16x2(f(q.x << 8), f(q.x)),
                    pack_bf16x2(f(q.y << 24), f(q.y << 16)), pack_bf16x2(f(q.y << 8), f(q.y)));
}

// 4 F8 codes (low byte first) as 4 bf16 of exactly their values (lo: codes 0-1, hi: codes 2-3). The sign and the 7
// other bits placed where bf16 keeps them make code * 2^-120 (E4M3's exponent bias is 7, bf16's 127; subnormal codes
// become subnormal bf16), and a multiply by 2^120 (exact) makes the value.
__device__ __forceinline__ void fp8x4_bf16(uint32_t q, uint32_t& lo, uint32_t& hi) {
  const uint32_t m = q & 0x7f7f7f7fu, s = q & 0x80808080u;
  const uint32_t l = (__byte_perm(m, 0u, 0x4140) << 4) | __byte_perm(s, 0u, 0x1404);
  const uint32_t h = (__byte_perm(m, 0u, 0x4342) << 4) | __byte_perm(s, 0u, 0x3424);
  constexpr uint32_t k2p120 = 0x7B807B80u, kNegZero = 0x80008000u;  // bf16x2 2^120, -0
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(lo) : "r"(l), "r"(k2p120), "r"(kNegZero));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(hi) : "r"(h), "r"(k2p120), "r"(kNegZero));
}

}  // namespace mlaserve::cuda
