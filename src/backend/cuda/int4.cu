// INT4 weights kept quantized: the experts a step names dequantized to bf16.
#include "backend/cuda/common.cuh"
#include "backend/cuda/kernels.h"

namespace mlaserve::cuda {
namespace {

constexpr int kDequantThreads = 256;
constexpr int64_t kMaxScannedIds = 4096;  // more routing ids than this: every expert counts as used

// Block (x, y): 8-column vectors x, x + gridDim.x, ... of matrix b, where b = y (every matrix), or (with ids) the
// local expert that ids[y] names unless an earlier id names it too or it is not local. out = bf16((code - zero) *
// scale), each rounded once as the host's dequantization rounds it.
__global__ void __launch_bounds__(kDequantThreads) dequant_int4_kernel(Int4DequantArgs a) {
  int64_t b = blockIdx.y;
  if (a.ids) {
    b = a.ids[blockIdx.y] - a.expert_begin;
    if (b < 0 || b >= a.B) return;
    for (unsigned j = 0; j < blockIdx.y; ++j)
      if (a.ids[j] == a.ids[blockIdx.y]) return;  // the first slot of this expert does it
  }
  const int64_t vecs_per_row = a.C / 8, vecs = a.R * vecs_per_row, G = (a.C + a.group - 1) / a.group;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(a.w + b * a.R * (a.C / 2));
  uint4* out = reinterpret_cast<uint4*>(a.out + b * a.R * a.C);
  const float* scale = a.scale + b * a.R * G;
  const float* zero = a.zero + b * a.R * G;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vecs;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / vecs_per_row, c = (v % vecs_per_row) * 8;
    const int64_t g = r * G + c / a.group;  // the 8 columns share a group (group % 8 == 0)
    const float s = scale[g], z = zero[g];
    const uint32_t codes = w[v];
    uint32_t packed[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float lo = __fmul_rn(static_cast<float>((codes >> (8 * i)) & 15u) - z, s);
      const float hi = __fmul_rn(static_cast<float>((codes >> (8 * i + 4)) & 15u) - z, s);
      const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
      packed[i] = *reinterpret_cast<const uint32_t*>(&p);
    }
    out[v] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

}  // namespace

cudaError_t dequant_int4(const Int4DequantArgs& a, cudaStream_t stream) {
  if (a.B == 0 || a.R == 0 || a.C == 0) return cudaSuccess;
  if (a.C % 8 || a.group <= 0 || (a.group % 8 && a.group < a.C)) return cudaErrorInvalidValue;
  Int4DequantArgs k = a;
  if (k.group > k.C) k.group = k.C;
  if (k.ids && (k.num_ids > kMaxScannedIds || k.num_ids >= k.B * 4)) k.ids = nullptr;  // (nearly) every expert used
  const int64_t rows = k.ids ? k.num_ids : k.B, vecs = a.R * a.C / 8;
  const int64_t want = std::max<int64_t>(1, 4096 * 4 / std::max<int64_t>(rows, 1));
  const unsigned x =
      static_cast<unsigned>(std::min<int64_t>({(vecs + kDequantThreads - 1) / kDequantThreads, want, 1024}));
  if (rows == 0) return cudaSuccess;
  dequant_int4_kernel<<<dim3(x, static_cast<unsigned>(rows)), kDequantThreads, 0, stream>>>(k);
  return cudaGetLastError();
}

}  // namespace mlaserve::cuda
