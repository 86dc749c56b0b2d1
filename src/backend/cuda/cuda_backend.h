// The CUDA backend (one GPU, sm_90a): bf16 activations and latent cache, bf16 weights, fp32 accumulation.
// Device memory is taken once at construction: a persistent arena (weights, then the latent KV pool) of
// mem_fraction_static of the device, a scratch arena for one step's activations, and small metadata buffers.
#pragma once

#include <cstdint>
#include <memory>

#include "backend/backend.h"

namespace mlaserve {

struct CudaBackendOptions {
  double mem_fraction_static = 0.85;  // weights + KV pool, as a fraction of the device's total memory
  int64_t persistent_bytes = 0;       // > 0: exactly this many bytes instead (tests)
  int64_t scratch_bytes = 0;          // activations of one step; 0: min(8 GiB, what the fraction leaves)
  bool simple_kernels = false;        // reference-style attention kernels instead of the tensor-core ones
                                      // (also env MLASERVE_CUDA_SIMPLE=1)
  bool moe_cublas = false;            // MoE experts as per-expert cuBLASLt GEMMs (one host sync per layer)
                                      // instead of the grouped kernels (also env MLASERVE_MOE_CUBLAS=1)
  bool small_batch = true;            // steps of at most 8 rows: matrix-vector kernels and the two-kernel MoE
                                      // (gemv.cu) instead of cuBLAS and the grouped MoE (env MLASERVE_SMALL_BATCH=0
                                      // turns them off)
  bool one_token_attention = true;    // one decode token's attention as one launch (cuda::mla_one_token; env
                                      // MLASERVE_MLA_ONE_TOKEN=0 turns it off)
};

// Number of CUDA devices usable by this process (0 without a driver or GPU; never throws).
int cuda_device_count();

std::unique_ptr<Backend> make_cuda_backend(int device_index, const CudaBackendOptions& options = {});

}  // namespace mlaserve
