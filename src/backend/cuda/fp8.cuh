// FP8 (E4M3) weights on the device: 8 codes made into 8 bf16 the way the host's dequantization makes them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace mlaserve::cuda {

// bf16(code * s) for the 8 codes of q (low byte first), packed as a 16-byte vector of 8 bf16: each product rounded
// once, as the host rounds code * scale when it uploads dequantized weights.
__device__ __forceinline__ uint4 fp8x8_to_bf16(const uint2& q, float s) {
  const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&q);
  uint4 o;
  __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
    ob[i] = __halves2bfloat162(__float2bfloat16_rn(f.x * s), __float2bfloat16_rn(f.y * s));
  }
  return o;
}

}  // namespace mlaserve::cuda
