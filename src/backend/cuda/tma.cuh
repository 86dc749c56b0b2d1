// Tensor memory access (TMA, sm_90): copies of 2-d / 3-d boxes from global to shared memory described by tensor maps
// (CUtensorMap, made on the host by the driver's cuTensorMapEncodeTiled through the runtime: no link to libcuda),
// completing as transaction bytes on an mbarrier. The maps here use the 128-byte swizzle: the layout wgmma.cuh's
// descriptors read (the swizzle follows the destination's address bits, so boxes land in 1,024-byte-aligned parts).
#pragma once

#include <cstdint>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "backend/cuda/common.cuh"

namespace mlaserve::cuda {

__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

// The driver's cuTensorMapEncodeTiled, or null where the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A RANK-d bf16 map of dims[0] contiguous columns (strides: bytes between rows of dims 1..), boxes of box[] elements,
// 128-byte swizzle.
template <int RANK>
cudaError_t encode_map(CUtensorMap& m, const void* base, const uint64_t (&dims)[RANK],
                       const uint64_t (&strides)[RANK - 1], const uint32_t (&box)[RANK]) {
  const PFN_cuTensorMapEncodeTiled_v12000 fn = tensor_map_encoder();
  if (!fn) return cudaErrorNotSupported;
  uint32_t elem[RANK];
  for (int i = 0; i < RANK; ++i) elem[i] = 1;
  const CUresult r = fn(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, RANK, const_cast<void*>(base), dims, strides, box, elem,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace mlaserve::cuda
