// Grouped expert GEMMs for the MoE layers (bf16 tensor cores, mma.sync m16n8k16, fp32 accumulate), reading the
// expert grouping that moe_group produced on the device (no host synchronisation):
//   gate_up: act[p, n] = silu(x[pos_row[p]] . W_gate[e, n]) * (x[pos_row[p]] . W_up[e, n])   (fused epilogue)
//   down:    y[p, n]   = pos_weight[p] * (act[p] . W_down[e, n])                                (fp32 out)
// One block per (n tile, row tile of one expert); row tiles come from moe_group's tile list, blocks past its end
// exit at once. Tiles of 64 along K stream through a STAGES-deep cp.async ring in XOR-swizzled shared memory
// (16-byte chunk c of row r stored at chunk c ^ (r % 8): conflict-free ldmatrix). Rows past an expert's end, columns
// past N and K past its end are zero-filled, so any N and K % 8 == 0 work. FP8 or INT4 experts: B's codes stream
// through the ring as they are and each k tile is converted into one bf16 tile (K % 16 == 0; INT4: K % 32 == 0).
#pragma once

#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/kernels.h"

namespace mlaserve::cuda {

// How the experts' weights are held: bf16, F8 codes with block scales, INT4 code pairs with group scales and zeros.
enum class Codes { kBf16, kFp8, kInt4 };

template <int BM, int BN, int WM, int WN, int STAGES, bool GATE_UP, Codes Q = Codes::kBf16>
struct MoeGemmCfg {
  static constexpr int BK = 64;
  static constexpr int NPARTS = GATE_UP ? 2 : 1;
  static constexpr int NTH = WM * WN * 32;
  static constexpr int BROWS = NPARTS * BN;
  static constexpr int WTM = BM / WM, WTN = BN / WN;
  static constexpr int MT = WTM / 16, NT = WTN / 8;
  static constexpr bool QUANT = Q != Codes::kBf16;
  // 16-byte chunks of one B row's k tile (8 bf16, 4 of F8 codes, 2 of INT4 code pairs) and the columns of each.
  static constexpr int B_ROW_CH = Q == Codes::kBf16 ? 8 : Q == Codes::kFp8 ? 4 : 2, B_CH_COLS = BK / B_ROW_CH;
  static constexpr int A_CH = BM * 8 / NTH, B_CH = BROWS * B_ROW_CH / NTH;  // 16-byte chunks per thread
  // A and B rings (quantized: B's codes, then one bf16 tile they are converted into).
  static constexpr size_t smem_bytes = sizeof(bf16) * STAGES * BM * BK + size_t{16} * STAGES * BROWS * B_ROW_CH +
                                       (QUANT ? sizeof(bf16) * BROWS * BK : 0);
  static_assert(MT >= 1 && NT % 2 == 0, "warp tile");
  static_assert(BM * 8 % NTH == 0 && BROWS * B_ROW_CH % NTH == 0, "load mapping");
};

__device__ __forceinline__ int swz(int row, int chunk) { return row * 64 + ((chunk ^ (row & 7)) << 3); }

// FP8: W holds F8 codes with block scales (p.w_scale); each k tile's codes land in the ring as they are and are made
// into bf16(code * scale), as dequant_experts makes them, in one bf16 tile before the products (so the results equal
// the dequantized experts' bit for bit). INT4: W holds code pairs with group scales and zeros (p.w_zero), made into
// bf16((code - zero) * scale) as dequant_experts makes them, the same way.
template <int BM, int BN, int WM, int WN, int STAGES, bool GATE_UP, Codes Q = Codes::kBf16>
__global__ void __launch_bounds__(WM * WN * 32, 2) moe_gemm_kernel(const MoeGemmParams p) {
  using C = MoeGemmCfg<BM, BN, WM, WN, STAGES, GATE_UP, Q>;
  constexpr bool QUANT = C::QUANT;
  constexpr int BK = C::BK;
  const int tile = blockIdx.y;
  if (tile >= *p.num_tiles) return;
  const int32_t packed = p.tiles[tile];
  const int e = packed >> 20, m0 = packed & 0xFFFFF;
  const int m_end = p.expert_end[e];
  const int n0 = blockIdx.x * BN;
  const int N = p.N, K = p.K;
  const int64_t w_off = static_cast<int64_t>(e) * C::NPARTS * N * K;  // this expert's weights (elements)
  const bf16* W = p.w + w_off;
  const uint8_t* W8 = reinterpret_cast<const uint8_t*>(p.w) + w_off * C::B_ROW_CH / 4;  // FP8 / INT4 codes' bytes

  extern __shared__ __align__(128) uint8_t smem_raw[];
  bf16* sA = reinterpret_cast<bf16*>(smem_raw);   // [STAGES][BM][BK]
  bf16* sB = sA + STAGES * BM * BK;  // [STAGES][BROWS][BK] (quantized: the converted tile, [BROWS][BK])
  uint8_t* sB8 = reinterpret_cast<uint8_t*>(sB + (QUANT ? C::BROWS * BK : 0));  // [STAGES][BROWS][16 B_ROW_CH] codes

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
  const int ch = tid & 7;  // every chunk this thread loads has this column chunk (NTH % 8 == 0)

  // 32-bit element offsets keep the per-thread load state small (rows * K < 2^32 is checked by the launcher).
  uint32_t a_src[C::A_CH];
  int a_dst[C::A_CH];
  bool a_ok[C::A_CH];
#pragma unroll
  for (int i = 0; i < C::A_CH; ++i) {
    const int r = (tid + i * C::NTH) >> 3;
    const int pos = m0 + r;
    a_ok[i] = pos < m_end;
    int64_t row = a_ok[i] ? pos : m0;
    if (GATE_UP) row = p.pos_row[a_ok[i] ? pos : m0];
    a_src[i] = static_cast<uint32_t>(row * K + ch * 8);
    a_dst[i] = swz(r, ch);
  }
  // B's chunks: bf16, 8 per row (chunk ch, swizzled); quantized, B_ROW_CH per row of 64 codes (chunk cq, stored as
  // they are, B_CH_COLS columns each).
  const int cq = tid % C::B_ROW_CH;
  constexpr int RB = 16 * C::B_ROW_CH;  // bytes of a row's k tile
  uint32_t b_src[C::B_CH];
  int b_dst[C::B_CH];
  bool b_ok[C::B_CH];
  [[maybe_unused]] const float* b_scale[C::B_CH];  // quantized: the row's block (group) scales
  [[maybe_unused]] const float* b_zero[C::B_CH];   // INT4: its groups' zero points
#pragma unroll
  for (int i = 0; i < C::B_CH; ++i) {
    const int r = (tid + i * C::NTH) / C::B_ROW_CH;
    const int part = r / BN, n = n0 + r % BN;
    b_ok[i] = n < N;
    const int64_t row = part * N + (b_ok[i] ? n : 0);
    if constexpr (QUANT) {
      b_src[i] = static_cast<uint32_t>(row * K * RB / 64 + cq * 16);  // a row: K (FP8) or K / 2 (INT4) bytes
      b_dst[i] = r * RB + cq * 16;
      const int64_t sr = (C::NPARTS * N + p.block_rows - 1) / p.block_rows, sc = (K + p.block_cols - 1) / p.block_cols;
      b_scale[i] = p.w_scale + (e * sr + row / p.block_rows) * sc;
      if constexpr (Q == Codes::kInt4) b_zero[i] = p.w_zero + (e * sr + row) * sc;
    } else {
      b_src[i] = static_cast<uint32_t>(row * K + ch * 8);
      b_dst[i] = swz(r, ch);
    }
  }
  const int k_tiles = (K + BK - 1) / BK;
  auto load_stage = [&](int kt, int stage) {
    const bool k_ok = kt * BK + ch * 8 < K;
    bf16* a = sA + stage * BM * BK;
#pragma unroll
    for (int i = 0; i < C::A_CH; ++i) cp_async16(a + a_dst[i], p.x + a_src[i] + kt * BK, a_ok[i] && k_ok);
    if constexpr (QUANT) {
      uint8_t* b = sB8 + stage * C::BROWS * RB;
      const bool kq_ok = kt * BK + cq * C::B_CH_COLS < K;
#pragma unroll
      for (int i = 0; i < C::B_CH; ++i) cp_async16(b + b_dst[i], W8 + b_src[i] + kt * RB, b_ok[i] && kq_ok);
    } else {
      bf16* b = sB + stage * C::BROWS * BK;
#pragma unroll
      for (int i = 0; i < C::B_CH; ++i) cp_async16(b + b_dst[i], W + b_src[i] + kt * BK, b_ok[i] && k_ok);
    }
  };
  // Quantized: this thread's chunks of k tile kt (its own copies, complete after its cp_async_wait) into the bf16
  // tile (an FP8 chunk: 16 columns in one scale block; INT4: 32, each code word's 8 in one group).
  [[maybe_unused]] auto convert_stage = [&](int kt, int stage) {
    const uint8_t* b = sB8 + stage * C::BROWS * RB;
    const int k0 = kt * BK + cq * C::B_CH_COLS;
#pragma unroll
    for (int i = 0; i < C::B_CH; ++i) {
      const bool ok = b_ok[i] && k0 < K;
      const uint4 q = *reinterpret_cast<const uint4*>(b + b_dst[i]);
      const int r = (tid + i * C::NTH) / C::B_ROW_CH;
      if constexpr (Q == Codes::kFp8) {
        const float s = ok ? b_scale[i][k0 / p.block_cols] : 0.0f;
        *reinterpret_cast<uint4*>(sB + swz(r, 2 * cq)) = fp8x8_to_bf16(make_uint2(q.x, q.y), s);
        *reinterpret_cast<uint4*>(sB + swz(r, 2 * cq + 1)) = fp8x8_to_bf16(make_uint2(q.z, q.w), s);
      } else {
        const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int grp = (k0 + 8 * v) / p.block_cols;
          *reinterpret_cast<uint4*>(sB + swz(r, 4 * cq + v)) =
              int4x8_to_bf16(words[v], ok ? b_scale[i][grp] : 0.0f, ok ? b_zero[i][grp] : 0.0f);
        }
      }
    }
  };

  float acc[C::NPARTS][C::MT][C::NT][4];
#pragma unroll
  for (int q = 0; q < C::NPARTS; ++q)
#pragma unroll
    for (int i = 0; i < C::MT; ++i)
#pragma unroll
      for (int j = 0; j < C::NT; ++j) acc[q][i][j][0] = acc[q][i][j][1] = acc[q][i][j][2] = acc[q][i][j][3] = 0.0f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (kt + STAGES - 1 < k_tiles) load_stage(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
    cp_async_commit();
    if constexpr (QUANT) {
      convert_stage(kt, kt % STAGES);
      __syncthreads();
    }
    const bf16* a = sA + (kt % STAGES) * BM * BK;
    const bf16* b = QUANT ? sB : sB + (kt % STAGES) * C::BROWS * BK;
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      uint32_t af[C::MT][4];
#pragma unroll
      for (int i = 0; i < C::MT; ++i) {
        const int row = wm * C::WTM + i * 16 + (lane & 15);
        ldmatrix_x4(af[i], a + swz(row, ks * 2 + (lane >> 4)));
      }
#pragma unroll
      for (int q = 0; q < C::NPARTS; ++q) {
#pragma unroll
        for (int np = 0; np < C::NT / 2; ++np) {
          const int row = q * BN + wn * C::WTN + np * 16 + (lane & 7) + ((lane >> 4) << 3);
          uint32_t bf[4];
          ldmatrix_x4(bf, b + swz(row, ks * 2 + ((lane >> 3) & 1)));
#pragma unroll
          for (int i = 0; i < C::MT; ++i) {
            mma_bf16(acc[q][i][2 * np], af[i], bf[0], bf[1]);
            mma_bf16(acc[q][i][2 * np + 1], af[i], bf[2], bf[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int i = 0; i < C::MT; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int pos = m0 + wm * C::WTM + i * 16 + g + half * 8;
      if (pos >= m_end) continue;
      const float wrow = GATE_UP ? 1.0f : p.pos_weight[pos];
#pragma unroll
      for (int j = 0; j < C::NT; ++j) {
        const int n = n0 + wn * C::WTN + j * 8 + 2 * t4;
        if (n >= N) continue;
        const float c0 = acc[0][i][j][2 * half], c1 = acc[0][i][j][2 * half + 1];
        if (GATE_UP) {
          const float u0 = acc[C::NPARTS - 1][i][j][2 * half], u1 = acc[C::NPARTS - 1][i][j][2 * half + 1];
          const float v0 = c0 / (1.0f + expf(-c0)) * u0, v1 = c1 / (1.0f + expf(-c1)) * u1;
          *reinterpret_cast<uint32_t*>(p.act + static_cast<int64_t>(pos) * N + n) = pack_bf16x2(v0, v1);
        } else {
          *reinterpret_cast<float2*>(p.y + static_cast<int64_t>(pos) * N + n) = make_float2(wrow * c0, wrow * c1);
        }
      }
    }
  }
}

// INT4 experts in the grouped GEMMs: whole 32-column chunks (K % 32 == 0), scales and zeros per row (block_rows 1)
// and group (a multiple of 8 columns, or one group per row).
inline bool int4_gemm_fits(const MoeGemmParams& p) {
  return p.w_scale && p.K % 32 == 0 && p.block_rows == 1 && p.block_cols > 0 &&
         (p.block_cols % 8 == 0 || p.block_cols >= p.K);
}

template <int BM, int BN, int WM, int WN, int STAGES, bool GATE_UP, Codes Q = Codes::kBf16>
cudaError_t launch_moe_gemm(const MoeGemmParams& p, cudaStream_t stream) {
  using C = MoeGemmCfg<BM, BN, WM, WN, STAGES, GATE_UP, Q>;
  auto kernel = moe_gemm_kernel<BM, BN, WM, WN, STAGES, GATE_UP, Q>;
  static std::atomic<uint64_t> configured{0};  // one bit per device
  if (cudaError_t e = set_max_dynamic_smem_once(kernel, static_cast<int>(C::smem_bytes), configured); e != cudaSuccess)
    return e;
  if (p.max_tiles == 0 || p.N == 0) return cudaSuccess;
  dim3 grid(static_cast<unsigned>((p.N + BN - 1) / BN), static_cast<unsigned>(p.max_tiles));
  kernel<<<grid, C::NTH, C::smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlaserve::cuda
