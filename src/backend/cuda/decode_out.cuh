// The decode attention kernels' endings: an empty split's weight, a warp's normalised output fragments.
#pragma once

#include <cmath>
#include <cstdint>

#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"

namespace mlaserve::cuda {

// An empty split (fixed split counts for CUDA graphs) gets weight zero in the combine; true when the item is empty.
__device__ __forceinline__ bool empty_split(const MlaDecodeParams& p, const MlaDecodeItem& it, int h0, int rows_valid) {
  if (it.key_end > it.key_begin) return false;
  if (it.partial >= 0 && static_cast<int>(threadIdx.x) < rows_valid)
    p.partial_lse[static_cast<int64_t>(it.partial) * p.num_heads + h0 + threadIdx.x] = -INFINITY;
  return true;
}

// Writes a warp's normalised output fragments (rows r0 and r0 + 8 of the head group, NTO n8 tiles from colbase):
// straight to the latent output (bf16) for an unsplit item, else to the item's partial (fp32).
template <int NTO>
__device__ __forceinline__ void store_output(const MlaDecodeParams& p, const MlaDecodeItem& it, int h0, int r0,
                                             int colbase, int rows_valid, const float (&o)[NTO][4], float inv0,
                                             float inv1) {
  constexpr int KVR = 512;  // the fast paths only (kvr 512)
  const int nh = p.num_heads, r1 = r0 + 8;
  if (it.partial < 0) {
    bf16* out0 = p.out_lat + (static_cast<int64_t>(it.token) * nh + h0 + r0) * KVR + colbase;
    bf16* out1 = out0 + 8 * KVR;
#pragma unroll
    for (int i = 0; i < NTO; ++i) {
      if (r0 < rows_valid) *reinterpret_cast<uint32_t*>(out0 + i * 8) = pack_bf16x2(o[i][0] * inv0, o[i][1] * inv0);
      if (r1 < rows_valid) *reinterpret_cast<uint32_t*>(out1 + i * 8) = pack_bf16x2(o[i][2] * inv1, o[i][3] * inv1);
    }
  } else {
    float* out0 = p.partial_o + (static_cast<int64_t>(it.partial) * nh + h0 + r0) * KVR + colbase;
    float* out1 = out0 + 8 * KVR;
#pragma unroll
    for (int i = 0; i < NTO; ++i) {
      if (r0 < rows_valid) *reinterpret_cast<float2*>(out0 + i * 8) = make_float2(o[i][0] * inv0, o[i][1] * inv0);
      if (r1 < rows_valid) *reinterpret_cast<float2*>(out1 + i * 8) = make_float2(o[i][2] * inv1, o[i][3] * inv1);
    }
  }
}

}  // namespace mlaserve::cuda
