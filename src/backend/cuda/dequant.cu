// Weights kept quantized (FP8 blocks, INT4 groups): the matrices a step needs dequantized to bf16.
#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/kernels.h"

namespace mlaserve::cuda {
namespace {

constexpr int kDequantThreads = 256;
constexpr int64_t kMaxScannedIds = 4096;  // more routing ids than this: every expert counts as used

// The matrix block row y dequantizes: y itself (every matrix), or (with ids) the local expert that ids[y] names; -1
// where it is not local or an earlier id names it too (the first slot of an expert does it).
__device__ __forceinline__ int64_t dequant_matrix(const int32_t* ids, int32_t expert_begin, int64_t B) {
  const unsigned y = blockIdx.y;
  if (!ids) return y;
  const int64_t b = ids[y] - expert_begin;
  if (b < 0 || b >= B) return -1;
  for (unsigned j = 0; j < y; ++j)
    if (ids[j] == ids[y]) return -1;
  return b;
}

// Launches `kernel` over B matrices of `vecs` 8-element vectors each (or over the ids' slots; `ids` is cleared where
// (nearly) every expert is used): a block row per matrix or slot, about 4096 blocks of work per matrix-sized pass.
template <class Args>
cudaError_t launch_dequant(void (*kernel)(Args), Args k, int64_t vecs, cudaStream_t stream) {
  if (k.ids && (k.num_ids > kMaxScannedIds || k.num_ids >= k.B * 4)) k.ids = nullptr;
  const int64_t rows = k.ids ? k.num_ids : k.B;
  if (rows == 0) return cudaSuccess;
  const int64_t want = std::max<int64_t>(1, 4096 * 4 / rows);
  const unsigned x =
      static_cast<unsigned>(std::min<int64_t>({(vecs + kDequantThreads - 1) / kDequantThreads, want, 1024}));
  kernel<<<dim3(x, static_cast<unsigned>(rows)), kDequantThreads, 0, stream>>>(k);
  return cudaGetLastError();
}

// Block (x, y): 8-element vectors x, x + gridDim.x, ... of its matrix (dequant_matrix). out = bf16(f8 * scale of the
// element's block), each product rounded once as the host's dequantization rounds it.
__global__ void __launch_bounds__(kDequantThreads) dequant_fp8_kernel(DequantArgs a) {
  const int64_t b = dequant_matrix(a.ids, a.expert_begin, a.B);
  if (b < 0) return;
  const int64_t vecs_per_row = a.C / 8, vecs = a.R * vecs_per_row;
  const int64_t sb_rows = (a.R + a.block_rows - 1) / a.block_rows, sb_cols = (a.C + a.block_cols - 1) / a.block_cols;
  const uint2* w = reinterpret_cast<const uint2*>(a.w + b * a.R * a.C);
  uint4* out = reinterpret_cast<uint4*>(a.out + b * a.R * a.C);
  const float* scale = a.scale + b * sb_rows * sb_cols;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / vecs_per_row, c = (v % vecs_per_row) * 8;
    const float s = scale[(r / a.block_rows) * sb_cols + c / a.block_cols];
    out[v] = fp8x8_to_bf16(w[v], s);
  }
}

// The same for INT4 code pairs: 8 columns (one 32-bit word of codes) a vector, out = bf16((code - zero) * scale) of
// the vector's group, each rounded once as the host's dequantization rounds it.
__global__ void __launch_bounds__(kDequantThreads) dequant_int4_kernel(DequantArgs a) {
  const int64_t b = dequant_matrix(a.ids, a.expert_begin, a.B);
  if (b < 0) return;
  const int64_t vecs_per_row = a.C / 8, vecs = a.R * vecs_per_row, G = (a.C + a.block_cols - 1) / a.block_cols;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(a.w + b * a.R * (a.C / 2));
  uint4* out = reinterpret_cast<uint4*>(a.out + b * a.R * a.C);
  const float* scale = a.scale + b * a.R * G;
  const float* zero = a.zero + b * a.R * G;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / vecs_per_row, c = (v % vecs_per_row) * 8;
    const int64_t g = r * G + c / a.block_cols;  // the 8 columns share a group (block_cols % 8 == 0 or >= C)
    out[v] = int4x8_to_bf16(w[v], scale[g], zero[g]);
  }
}

}  // namespace

cudaError_t dequant_experts(const DequantArgs& a, cudaStream_t stream) {
  if (a.B == 0 || a.R == 0 || a.C == 0) return cudaSuccess;
  if (a.C % 8 || a.block_rows <= 0 || a.block_cols <= 0) return cudaErrorInvalidValue;
  if (!a.zero) {
    if (a.block_cols % 8) return cudaErrorInvalidValue;
    return launch_dequant(dequant_fp8_kernel, a, a.R * a.C / 8, stream);
  }
  if (a.block_rows != 1 || (a.block_cols % 8 && a.block_cols < a.C)) return cudaErrorInvalidValue;
  DequantArgs k = a;
  if (k.block_cols > k.C) k.block_cols = k.C;
  return launch_dequant(dequant_int4_kernel, k, a.R * a.C / 8, stream);
}

}  // namespace mlaserve::cuda
