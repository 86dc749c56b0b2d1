// How the FP8 experts' weight layout streams (a micro-benchmark of cuda_kernel_bench, not a test): the small-batch
// MoE's tensor-core path (gemv.cu fp8_tile) has each lane load 16 codes of weight row lane / 4, so one warp load
// touches 8 rows, 64 bytes of each; a bf16 matrix-vector warp loads 512 contiguous bytes. Here the same fp8_tile
// arithmetic over the same bytes, from the row-major layout (rows of H codes) or from a tiled one (each 8-row x
// 64-column chunk stored as the 512 bytes the warp loads, in lane order), with or without the arithmetic, at a few
// loads-in-flight (U chunks per lane) and blocks-per-SM settings. Reported: microseconds and TB/s over ~58 MB (one
// V2-Lite MoE layer's gate/up at one token with FP8 experts), two buffers alternating so that L2 does not hold them.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8.cuh"
#include "bench_util.h"

namespace {

using mlaserve::cuda::fp8x4_bf16;
using mlaserve::cuda::ld_weights;
using mlaserve::cuda::mma_bf16;

constexpr int kH = 2048;           // codes per weight row
constexpr int kTileBytes = 8 * kH;  // 8 rows

// Each warp takes tiles warp, warp + all warps, ...; TILED: chunk c of a tile is its 512 bytes at c * 512 (lane l's
// 16 at 16 l), else lane (g, q) reads row g at column 64 c + 16 q. COMPUTE: fp8_tile's conversion and mma per chunk
// (x: token 0's activations, lanes of g 0), else the loaded words only folded into a sink.
template <bool TILED, int U, int MINB, bool COMPUTE>
__global__ void __launch_bounds__(256, MINB) fp8_stream_kernel(const uint8_t* w, int tiles, const __nv_bfloat16* x,
                                                               float* out) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int first = blockIdx.x * 8 + (threadIdx.x >> 5), stride = gridDim.x * 8;
  constexpr int nch = kH / 64;
  float acc0 = 0.0f, acc1 = 0.0f;
  uint32_t sink = 0;
  for (int t = first; t < tiles; t += stride) {
    const uint8_t* base = w + static_cast<int64_t>(t) * kTileBytes + (TILED ? 16 * lane : g * kH + 16 * q);
    for (int c0 = 0; c0 < nch; c0 += U) {
      uint4 b[U];
#pragma unroll
      for (int u = 0; u < U; ++u) b[u] = ld_weights(base + (c0 + u) * (TILED ? 512 : 64));
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if constexpr (COMPUTE) {
          uint4 xa = make_uint4(0, 0, 0, 0), xb = xa;
          if (g == 0) {
            xa = *reinterpret_cast<const uint4*>(x + (c0 + u) * 64 + 16 * q);
            xb = *reinterpret_cast<const uint4*>(x + (c0 + u) * 64 + 16 * q + 8);
          }
          const uint32_t wq[4] = {b[u].x, b[u].y, b[u].z, b[u].w};
          const uint32_t xq[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
          float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            uint32_t lo, hi;
            fp8x4_bf16(wq[j], lo, hi);
            const uint32_t af[4] = {xq[2 * j], 0u, xq[2 * j + 1], 0u};
            mma_bf16(d, af, lo, hi);
          }
          acc0 = fmaf(1.5f, d[0], acc0);
          acc1 = fmaf(0.5f, d[1], acc1);
        } else {
          sink ^= b[u].x ^ b[u].y ^ b[u].z ^ b[u].w;
        }
      }
    }
  }
  if (acc0 + acc1 == 12345.0f || sink == 0x12345678u) out[blockIdx.x * 256 + threadIdx.x] = acc0 + acc1 + sink;
}

template <bool TILED, int U, int MINB, bool COMPUTE>
void run(const uint8_t* const (&bufs)[2], int tiles, const __nv_bfloat16* x, float* out, int sms) {
  const unsigned grid = static_cast<unsigned>(MINB * sms);
  int i = 0;
  const double ms = time_ms([&] {
    fp8_stream_kernel<TILED, U, MINB, COMPUTE><<<grid, 256>>>(bufs[i++ & 1], tiles, x, out);
    CK(cudaGetLastError());
  });
  const double bytes = static_cast<double>(tiles) * kTileBytes;
  std::printf("fp8 stream %-9s U %2d blocks/SM %d %-9s: %7.2f us %5.2f TB/s\n", TILED ? "tiled" : "row-major", U,
              MINB, COMPUTE ? "mma" : "loads", ms * 1e3, bytes / (ms * 1e-3) / 1e12);
}

template <bool TILED, bool COMPUTE>
void run_set(const uint8_t* const (&bufs)[2], int tiles, const __nv_bfloat16* x, float* out, int sms) {
  run<TILED, 8, 2, COMPUTE>(bufs, tiles, x, out, sms);
  run<TILED, 8, 3, COMPUTE>(bufs, tiles, x, out, sms);
  run<TILED, 4, 4, COMPUTE>(bufs, tiles, x, out, sms);
  run<TILED, 8, 4, COMPUTE>(bufs, tiles, x, out, sms);
  run<TILED, 16, 2, COMPUTE>(bufs, tiles, x, out, sms);
}

}  // namespace

void bench_fp8_stream() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int tiles = 3712;  // ~58 MB
  const size_t bytes = static_cast<size_t>(tiles) * kTileBytes;
  uint8_t* b0 = nullptr;
  uint8_t* b1 = nullptr;
  __nv_bfloat16* x = nullptr;
  float* out = nullptr;
  CK(cudaMalloc(&b0, bytes));
  CK(cudaMalloc(&b1, bytes));
  CK(cudaMalloc(&x, kH * sizeof(__nv_bfloat16)));
  CK(cudaMalloc(&out, 8 * 256 * static_cast<size_t>(sms) * sizeof(float)));
  CK(cudaMemset(b0, 0x31, bytes));
  CK(cudaMemset(b1, 0x32, bytes));
  CK(cudaMemset(x, 0x3f, kH * sizeof(__nv_bfloat16)));
  const uint8_t* const bufs[2] = {b0, b1};
  run_set<false, false>(bufs, tiles, x, out, sms);
  run_set<true, false>(bufs, tiles, x, out, sms);
  run_set<false, true>(bufs, tiles, x, out, sms);
  run_set<true, true>(bufs, tiles, x, out, sms);
  CK(cudaFree(b0));
  CK(cudaFree(b1));
  CK(cudaFree(x));
  CK(cudaFree(out));
}
