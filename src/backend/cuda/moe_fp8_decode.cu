// FP8 experts at decode sizes (more tokens than the small-batch MoE takes, few per expert): the grouped gate/up and
// down products with the weights streamed from memory straight into registers, each code made into bf16(code *
// scale) there (as dequant_experts makes it: the dequantized model, as the shared-memory FP8 tiles of moe_gemm.cuh),
// and multiplied on tensor cores with up to 8 NT of the expert's tokens at a time. No shared memory, no barriers.
//
// A warp item is 32 weight rows of one expert as two m16 tiles of mma m16n8k16 (gate/up: 16 gate rows and the 16 up
// rows of the same intermediate indices, so a lane holds both halves of its act; down: 32 output columns, H % 64 == 0
// by moe_fp8_decode_fits), the
// tokens in its n8 tiles. Lane (g = lane / 4, q = lane % 4) loads 16 codes of rows g and g + 8 at column 16 q of each
// 64-column chunk; the mma's k order within a chunk is permuted (k-step j takes codes 4j..4j+3 of every lane's 16 as
// its k 2q, 2q+1, 2q+8, 2q+9), and each token's activations are read in the same order (lane g, q: the token's 16
// values at column 16 q), so the products are the plain dot products. An m16 tile lies in one scale block (block
// rows % 16 == 0) and a chunk in one scale column block (block cols % 64 == 0), so each chunk takes one scale per
// tile. Warps take items in expert order (the warps of a block mostly share an expert: its tokens' activations are
// L1 hits), looping over the expert's tokens 8 NT at a time (later passes read the weights again, from L2).
// CPU reference: cpu::moe_experts over the dequantized experts (CudaOps.MoeExpertsFp8IsItsDequantizedModel).
#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/kernels.h"

namespace mlaserve::cuda {

namespace {

constexpr int kDecodeWarps = 4;

// Rows of m16 tile m (0, 1) of a warp item starting at r0 (gate/up: intermediate index r0, the tile m = 1 the up
// rows; down: output column r0).
template <bool GATE_UP>
__device__ __forceinline__ int tile_row(int r0, int m, int N) {
  return GATE_UP ? m * N + r0 : r0 + 16 * m;
}

// NT: n8 tiles of tokens per pass; U: chunks of weights in flight per lane; PX: each chunk's activations loaded a
// chunk ahead; MINB: blocks per SM.
template <bool GATE_UP, int NT, int U, bool PX, int MINB>
__global__ void __launch_bounds__(kDecodeWarps * 32, MINB) moe_fp8_decode_kernel(const MoeGemmParams p, int32_t E) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int N = p.N, K = p.K, nch = K >> 6;
  const int rows_per_item = GATE_UP ? 16 : 32;
  const int items_per_expert = (N + rows_per_item - 1) / rows_per_item;
  const int64_t items = static_cast<int64_t>(E) * items_per_expert;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kDecodeWarps;
  const int64_t e_rows = GATE_UP ? 2LL * N : N;
  const int64_t sr = (e_rows + p.block_rows - 1) / p.block_rows, sc = (K + p.block_cols - 1) / p.block_cols;
  const int cps_shift = __ffs(p.block_cols >> 6) - 1;  // chunks per scale column block: a power of two
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * kDecodeWarps + (threadIdx.x >> 5); it < items; it += stride) {
    const int e = static_cast<int>(it / items_per_expert);
    const int start = e > 0 ? p.expert_end[e - 1] : 0, end = p.expert_end[e];
    if (start == end) continue;
    const int r0 = static_cast<int>(it % items_per_expert) * rows_per_item;
    const uint8_t* W = reinterpret_cast<const uint8_t*>(p.w) + static_cast<int64_t>(e) * e_rows * K + 16 * q;
    const uint8_t* wr[2][2];
    const float* srow[2];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const int row = tile_row<GATE_UP>(r0, m, N);
      wr[m][0] = W + static_cast<int64_t>(row + g) * K;
      wr[m][1] = W + static_cast<int64_t>(row + g + 8) * K;
      srow[m] = p.w_scale + (e * sr + row / p.block_rows) * sc;
    }
    auto load = [&](uint4 (&w)[2][2], int c) {
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          w[m][h] = c < nch ? ld_weights(wr[m][h] + static_cast<int64_t>(c) * 64) : make_uint4(0, 0, 0, 0);
    };
    for (int p0 = start; p0 < end; p0 += 8 * NT) {
      const bf16* xr[NT];
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int pos = p0 + 8 * t + g;
        xr[t] = nullptr;
        if (pos < end) xr[t] = p.x + static_cast<int64_t>(GATE_UP ? p.pos_row[pos] : pos) * K + 16 * q;
      }
      float acc[2][NT][4];
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[m][t][0] = acc[m][t][1] = acc[m][t][2] = acc[m][t][3] = 0.0f;
      uint4 wv[U][2][2];
#pragma unroll
      for (int u = 0; u < U; ++u) load(wv[u], u);
      // Chunk c's activations of the pass's tokens (zeros past its end).
      auto load_x = [&](uint32_t (&xq)[NT][8], int c) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          uint4 xa = make_uint4(0, 0, 0, 0), xb = xa;
          if (xr[t] && c < nch) {
            xa = *reinterpret_cast<const uint4*>(xr[t] + static_cast<int64_t>(c) * 64);
            xb = *reinterpret_cast<const uint4*>(xr[t] + static_cast<int64_t>(c) * 64 + 8);
          }
          xq[t][0] = xa.x, xq[t][1] = xa.y, xq[t][2] = xa.z, xq[t][3] = xa.w;
          xq[t][4] = xb.x, xq[t][5] = xb.y, xq[t][6] = xb.z, xq[t][7] = xb.w;
        }
      };
      [[maybe_unused]] uint32_t xnext[PX ? NT : 1][8];
      if constexpr (PX) load_x(xnext, 0);
      for (int c0 = 0; c0 < nch; c0 += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int c = c0 + u;
          if (c < nch) {
            uint32_t xq[NT][8];
            if constexpr (PX) {
#pragma unroll
              for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int i = 0; i < 8; ++i) xq[t][i] = xnext[t][i];
              load_x(xnext, c + 1);
            } else {
              load_x(xq, c);
            }
#pragma unroll
            for (int m = 0; m < 2; ++m) {
              const float s = srow[m][c >> cps_shift];
              // rows g and g + 8: their 16 codes as 8 bf16 pairs each (pair i: codes 2i, 2i + 1)
              const uint4 a0 = fp8x8_to_bf16(make_uint2(wv[u][m][0].x, wv[u][m][0].y), s);
              const uint4 a1 = fp8x8_to_bf16(make_uint2(wv[u][m][0].z, wv[u][m][0].w), s);
              const uint4 b0 = fp8x8_to_bf16(make_uint2(wv[u][m][1].x, wv[u][m][1].y), s);
              const uint4 b1 = fp8x8_to_bf16(make_uint2(wv[u][m][1].z, wv[u][m][1].w), s);
              const uint32_t rg[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
              const uint32_t rg8[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
              for (int j = 0; j < 4; ++j) {  // k-step j: pairs 2j (k 2q, 2q + 1) and 2j + 1 (k 2q + 8, 2q + 9)
                const uint32_t af[4] = {rg[2 * j], rg8[2 * j], rg[2 * j + 1], rg8[2 * j + 1]};
#pragma unroll
                for (int t = 0; t < NT; ++t) mma_bf16(acc[m][t], af, xq[t][2 * j], xq[t][2 * j + 1]);
              }
            }
          }
          load(wv[u], c + U);
        }
      }
      // C fragment: rows g, g + 8 of each tile, tokens 2q, 2q + 1 of each n8 tile.
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const int pos = p0 + 8 * t + 2 * q + cc;
          if (pos >= end) continue;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if constexpr (GATE_UP) {
              const float gv = acc[0][t][2 * h + cc], uv = acc[1][t][2 * h + cc];
              p.act[static_cast<int64_t>(pos) * N + r0 + g + 8 * h] = __float2bfloat16_rn(gv / (1.0f + expf(-gv)) * uv);
            } else {
              const float wgt = p.pos_weight[pos];
#pragma unroll
              for (int m = 0; m < 2; ++m)
                p.y[static_cast<int64_t>(pos) * N + r0 + 16 * m + g + 8 * h] = wgt * acc[m][t][2 * h + cc];
            }
          }
        }
    }
  }
}

template <bool GATE_UP, int NT, int U, bool PX, int MINB = 3>
cudaError_t launch_fp8_decode(const MoeGemmParams& p, int32_t E, int32_t num_sms, cudaStream_t stream) {
  const int rows_per_item = GATE_UP ? 16 : 32;
  const int64_t items = static_cast<int64_t>(E) * ((p.N + rows_per_item - 1) / rows_per_item);
  const int64_t blocks = std::min<int64_t>((items + kDecodeWarps - 1) / kDecodeWarps, int64_t{MINB} * num_sms);
  moe_fp8_decode_kernel<GATE_UP, NT, U, PX, MINB>
      <<<static_cast<unsigned>(blocks), kDecodeWarps * 32, 0, stream>>>(p, E);
  return cudaGetLastError();
}

template <bool GATE_UP>
cudaError_t launch_fp8_decode_nt(const MoeGemmParams& p, int32_t E, int64_t assignments, int32_t num_sms,
                                 cudaStream_t stream) {
  const int64_t per_expert = (assignments + E - 1) / E;
  // Measured on H200 (docs/perf.md): up to 8 rows per expert 4 blocks per SM (128 registers) with 3 chunks in
  // flight; up to 16, 3 blocks with 3; past it 3 with 2 and the activations loaded as used (a chunk ahead spills).
  if (per_expert <= 8) return launch_fp8_decode<GATE_UP, 1, 3, true, 4>(p, E, num_sms, stream);
  if (per_expert <= 16) return launch_fp8_decode<GATE_UP, 2, 3, true>(p, E, num_sms, stream);
  return launch_fp8_decode<GATE_UP, 4, 2, false>(p, E, num_sms, stream);
}

}  // namespace

bool moe_fp8_decode_fits(int64_t H, int64_t I, int64_t block_rows, int64_t block_cols) {
  const int64_t cps = block_cols / 64;
  return H % 64 == 0 && I % 64 == 0 && block_rows > 0 && block_rows % 16 == 0 && block_cols % 64 == 0 &&
         (cps & (cps - 1)) == 0;
}

cudaError_t moe_fp8_decode(const MoeGemmParams& p, bool gate_up, int32_t E, int64_t assignments, int32_t num_sms,
                           cudaStream_t stream) {
  if (!p.w_scale || p.N % (gate_up ? 16 : 32) != 0 || p.K % 64 != 0 || p.block_rows % 16 != 0 ||
      p.block_cols % 64 != 0 || E <= 0)
    return cudaErrorInvalidValue;
  if (assignments == 0 || p.N == 0) return cudaSuccess;
  return gate_up ? launch_fp8_decode_nt<true>(p, E, assignments, num_sms, stream)
                 : launch_fp8_decode_nt<false>(p, E, assignments, num_sms, stream);
}

}  // namespace mlaserve::cuda
