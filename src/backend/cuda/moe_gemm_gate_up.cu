// Instantiations of the grouped gate+up GEMM with the fused SiLU-and-mul epilogue (see moe_gemm.cuh).
#include "backend/cuda/moe_gemm.cuh"

namespace mlaserve::cuda {

cudaError_t moe_gemm_gate_up(const MoeGemmParams& p, int32_t block_m, cudaStream_t stream) {
  if (p.K % 8 != 0 || p.N % 2 != 0) return cudaErrorInvalidValue;
  if (static_cast<int64_t>(p.max_tiles + 1) * block_m * p.K >= (1LL << 32) || 2LL * p.N * p.K >= (1LL << 31))
    return cudaErrorInvalidValue;
  if (p.w_zero) {
    if (!int4_gemm_fits(p)) return cudaErrorInvalidValue;
    if (block_m == 128) return launch_moe_gemm<128, 64, 4, 2, 3, true, Codes::kInt4>(p, stream);
    return launch_moe_gemm<64, 64, 2, 2, 4, true, Codes::kInt4>(p, stream);
  }
  if (p.w_scale) {
    if (p.K % 16 != 0 || p.block_cols % 16 != 0 || p.block_rows <= 0) return cudaErrorInvalidValue;
    if (block_m == 128) return launch_moe_gemm<128, 64, 4, 2, 3, true, Codes::kFp8>(p, stream);
    return launch_moe_gemm<64, 64, 2, 2, 4, true, Codes::kFp8>(p, stream);
  }
  if (block_m == 128) return launch_moe_gemm<128, 64, 4, 2, 3, true>(p, stream);
  return launch_moe_gemm<64, 64, 2, 2, 4, true>(p, stream);
}

// Sets the kernels' shared-memory attribute on the current device (no launch: zero tiles).
cudaError_t moe_gemm_gate_up_prepare() {
  const MoeGemmParams none{};
  for (cudaError_t e : {launch_moe_gemm<128, 64, 4, 2, 3, true>(none, nullptr),
                        launch_moe_gemm<64, 64, 2, 2, 4, true>(none, nullptr),
                        launch_moe_gemm<128, 64, 4, 2, 3, true, Codes::kFp8>(none, nullptr),
                        launch_moe_gemm<64, 64, 2, 2, 4, true, Codes::kFp8>(none, nullptr),
                        launch_moe_gemm<128, 64, 4, 2, 3, true, Codes::kInt4>(none, nullptr),
                        launch_moe_gemm<64, 64, 2, 2, 4, true, Codes::kInt4>(none, nullptr)})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace mlaserve::cuda
