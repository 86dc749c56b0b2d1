// FP8 (E4M3) weights on the device: codes made into bf16 the way the host's dequantization makes them.
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

}  // namespace mlaserve::cuda
