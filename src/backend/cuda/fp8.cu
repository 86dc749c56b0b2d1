// FP8 weights kept quantized: their blocks dequantized to bf16 where the step needs them.
#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/kernels.h"

namespace mlaserve::cuda {
namespace {

constexpr int kDequantThreads = 256;
constexpr int64_t kMaxScannedIds = 4096;  // more routing ids than this: every expert counts as used

// Block (x, y): 8-element vectors x, x + gridDim.x, ... of matrix b, where b = y (every matrix), or (with ids) the
// local expert that ids[y] names unless an earlier id names it too or it is not local. out = bf16(f8 * scale of the
// element's block), each product rounded once as the host's dequantization rounds it.
__global__ void __launch_bounds__(kDequantThreads) dequant_fp8_kernel(Fp8DequantArgs a) {
  int64_t b = blockIdx.y;
  if (a.ids) {
    b = a.ids[blockIdx.y] - a.expert_begin;
    if (b < 0 || b >= a.B) return;
    for (unsigned j = 0; j < blockIdx.y; ++j)
      if (a.ids[j] == a.ids[blockIdx.y]) return;  // the first slot of this expert does it
  }
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

}  // namespace

cudaError_t dequant_fp8(const Fp8DequantArgs& a, cudaStream_t stream) {
  if (a.B == 0 || a.R == 0 || a.C == 0) return cudaSuccess;
  if (a.C % 8 || a.block_cols % 8 || a.block_rows <= 0) return cudaErrorInvalidValue;
  Fp8DequantArgs k = a;
  if (k.ids && (k.num_ids > kMaxScannedIds || k.num_ids >= k.B * 4)) k.ids = nullptr;  // (nearly) every expert used
  // A block row per matrix (or routing slot), about 4096 blocks of work per matrix-sized pass in all.
  const int64_t rows = k.ids ? k.num_ids : k.B, vecs = a.R * a.C / 8;
  const int64_t want = std::max<int64_t>(1, 4096 * 4 / std::max<int64_t>(rows, 1));
  const unsigned x =
      static_cast<unsigned>(std::min<int64_t>({(vecs + kDequantThreads - 1) / kDequantThreads, want, 1024}));
  if (rows == 0) return cudaSuccess;
  dequant_fp8_kernel<<<dim3(x, static_cast<unsigned>(rows)), kDequantThreads, 0, stream>>>(k);
  return cudaGetLastError();
}

}  // namespace mlaserve::cuda
