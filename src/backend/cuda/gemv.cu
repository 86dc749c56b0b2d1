// Small-batch kernels: matrix-vector products of at most kGemvMaxRows token rows that stream each weight row once
// for all rows of the batch (gemv_t: y = x W^T, a warp per row or 16 rows per warp on tensor cores; gemv_n: y = x W),
// the router product fused with the routing (moe_gate), and the MoE of at most kMoeSmallRows tokens in two kernels
// (gate/up + SiLU; down + the weighted sum + the shared experts), each block finding the batch's distinct experts
// itself; FP8 experts there on tensor cores (fp8_tile) when their scale blocks are whole 64-column chunks (the down
// kernel then takes the shared experts' bf16 on tensor cores too, bf16_tile, split so every warp streams about the
// same bytes). At one
// token the one-row pair and the router also compute their input row's residual add + RMSNorm (gemv_t_pair_norm,
// moe_gate_norm), and MLA's W_UV sums the decode splits itself (mla_combine_uv).
// They are launched with programmatic dependent launch: each warp loads its first weights before pdl_wait(), so a
// kernel's weight reads overlap the kernel before it. CPU references: cpu::linear, cpu::route_token (through
// CpuBackend::moe_gate = linear + moe_route), cpu::moe_experts + add_shared_experts, cpu::rmsnorm_row,
// cpu::mla_attention.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backend/cuda/combine.cuh"
#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/prepare.cuh"
#include "backend/cuda/route.cuh"

namespace mlaserve::cuda {

namespace {

constexpr int kWarps = 8;   // warps per block
constexpr int kUnroll = 8;  // 16-byte weight loads per lane in flight
constexpr int kSmallMoeUnroll = 4;  // the small-batch MoE's (fewer registers, more warps per SM: measured faster)
constexpr int kPairBlocksPerSm = 4;  // the one-row pair's kernel at 64 registers

__device__ __forceinline__ uint4 ld_act(const bf16* p) { return *reinterpret_cast<const uint4*>(p); }

// Dot product of 8 bf16 pairs, fp32.
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = __bfloat1622float2(pa[i]), fb = __bfloat1622float2(pb[i]);
    s = fmaf(fa.x, fb.x, s);
    s = fmaf(fa.y, fb.y, s);
  }
  return s;
}

// An 8-byte weight load that does not allocate in L1 (FP8 codes).
__device__ __forceinline__ uint2 ld_weights8(const void* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// A weight row of the small-batch MoE with FP8 experts: bf16 (shared experts: `scale` null, p a bf16 row) or F8
// codes whose 16-byte vectors of 8 bf16 are made as dequant_experts makes them (code times its block's scale, rounded).
struct Fp8Row {
  const void* p;
  const float* scale;  // the row's block scales, one per vec_per_scale vectors (null: bf16)
  int vec_per_scale;
};
__device__ __forceinline__ uint4 load_vec(const uint4* row, int v) { return ld_weights(row + v); }
__device__ __forceinline__ uint4 load_vec(const Fp8Row& row, int v) {
  if (!row.scale) return ld_weights(static_cast<const uint4*>(row.p) + v);
  return fp8x8_to_bf16(ld_weights8(static_cast<const uint2*>(row.p) + v), row.scale[v / row.vec_per_scale]);
}

// FP8 experts on tensor cores (the small-batch MoE when the scale blocks are whole 64-column chunks). A warp
// multiplies 8 weight rows (mma m16n8k16's B: lane / 4 loads row lane / 4, 16 codes at column 16 (lane % 4) of each
// 64-column chunk) with the tokens (A's rows: lane / 4 < T loads its token's activations at the same columns; rows
// 8-15 are zero). Each code becomes the bf16 of exactly its value; each chunk's product is scaled by its rows' block
// scales in f32. So a product is the sum over chunks of scale * (codes . x): the dequantized model's product without
// rounding code * scale to bf16 first (close to it, not bit for bit).

// acc[j] += the products of this lane's token (A row lane / 4) with weight row 2 (lane % 4) + j of the warp's 8 (the C
// fragment's two columns). w: this lane's weight row at column 16 (lane % 4), nch chunks of 64 codes; x: its token's
// activations at the same column (null: zeros); s0 / s1: the block-scale rows of weight rows 2 (lane % 4) and
// 2 (lane % 4) + 1, one scale per 2^cps_shift chunks. U chunks of loads in flight, then computed (two sets, one
// loading while the other is computed, measured slower: docs/perf.md).
// R2: tokens in A's rows 8-15 too (x2: lane / 4 + 8's activations, null: zeros; acc[2] / acc[3] its products).
// A chunk's mma products d scaled by its rows' scales into the accumulators (d[2] / d[3]: A's rows 8-15 with R2).
template <bool R2>
__device__ __forceinline__ void scaled_add(float (&acc)[R2 ? 4 : 2], float sa, float sb, const float (&d)[4]) {
  acc[0] = fmaf(sa, d[0], acc[0]);
  acc[1] = fmaf(sb, d[1], acc[1]);
  if constexpr (R2) {
    acc[2] = fmaf(sa, d[2], acc[2]);
    acc[3] = fmaf(sb, d[3], acc[3]);
  }
}
// fp8_tile_load: chunks [c0, c0 + U) of w (zeros past nch), the loads fp8_tile issues; fp8_chunks computes chunks
// [c0, c0 + U) from b.
template <int U>
__device__ __forceinline__ void fp8_tile_load(uint4 (&b)[U], const uint8_t* w, int c0, int nch) {
#pragma unroll
  for (int u = 0; u < U; ++u)
    b[u] = c0 + u < nch ? ld_weights(w + static_cast<int64_t>(c0 + u) * 64) : make_uint4(0, 0, 0, 0);
}
template <int U, bool R2>
__device__ __forceinline__ void fp8_chunks(float (&acc)[R2 ? 4 : 2], const uint4 (&b)[U], int c0, const bf16* x,
                                           const float* s0, const float* s1, int nch, int cps_shift, const bf16* x2) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + u;
    if (c >= nch) break;
    const float sa = s0[c >> cps_shift], sb = s1[c >> cps_shift];
    uint4 xa = make_uint4(0, 0, 0, 0), xb = xa, ya = xa, yb = xa;
    if (x) {
      xa = ld_act(x + static_cast<int64_t>(c) * 64);
      xb = ld_act(x + static_cast<int64_t>(c) * 64 + 8);
    }
    if (R2 && x2) {
      ya = ld_act(x2 + static_cast<int64_t>(c) * 64);
      yb = ld_act(x2 + static_cast<int64_t>(c) * 64 + 8);
    }
    const uint32_t wq[4] = {b[u].x, b[u].y, b[u].z, b[u].w};
    const uint32_t xq[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    const uint32_t yq[8] = {ya.x, ya.y, ya.z, ya.w, yb.x, yb.y, yb.z, yb.w};
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // codes 4j..4j+3: k 2q, 2q+1 (a0 / b0) and 2q+8, 2q+9 (a2 / b1) of an mma
      uint32_t lo, hi;
      fp8x4_bf16(wq[j], lo, hi);
      const uint32_t af[4] = {xq[2 * j], R2 ? yq[2 * j] : 0u, xq[2 * j + 1], R2 ? yq[2 * j + 1] : 0u};
      mma_bf16(d, af, lo, hi);
    }
    scaled_add<R2>(acc, sa, sb, d);
  }
}
template <int U, bool R2 = false>
__device__ __forceinline__ void fp8_tile(float (&acc)[R2 ? 4 : 2], const uint8_t* w, const bf16* x, const float* s0,
                                         const float* s1, int nch, int cps_shift, const bf16* x2 = nullptr) {
  for (int c0 = 0; c0 < nch; c0 += U) {
    uint4 b[U];
    fp8_tile_load<U>(b, w, c0, nch);
    fp8_chunks<U, R2>(acc, b, c0, x, s0, s1, nch, cps_shift, x2);
  }
}
// The first U chunks already in b (fp8_tile_load at 0, e.g. before a kernel's wait); then as above (a separate loop:
// b live around one would cost registers where they are short).
template <int U, bool R2 = false>
__device__ __forceinline__ void fp8_tile(float (&acc)[R2 ? 4 : 2], const uint4 (&b)[U], const uint8_t* w,
                                         const bf16* x, const float* s0, const float* s1, int nch, int cps_shift,
                                         const bf16* x2 = nullptr) {
  fp8_chunks<U, R2>(acc, b, 0, x, s0, s1, nch, cps_shift, x2);
  for (int c0 = U; c0 < nch; c0 += U) {
    uint4 n[U];
    fp8_tile_load<U>(n, w, c0, nch);
    fp8_chunks<U, R2>(acc, n, c0, x, s0, s1, nch, cps_shift, x2);
  }
}

// INT4 experts on tensor cores, laid out as fp8_tile's: lane / 4 loads 16 codes (8 bytes, code pairs with column 2 j
// in the low nibble) at column 16 (lane % 4) of each 64-column chunk of its row. A code word's nibbles become bf16
// pairs (columns j, j + 4) as 128 + code (the code in the low mantissa bits of 128), minus 128 + its row's group zero
// point: code - zero exactly (zero points are integers in [0, 16], as every checkpoint format the loader reads gives
// them); the activations are paired the same way (byte permutes). Each chunk's product is scaled by its output rows'
// group scales in f32, so a product is the sum over chunks of scale * ((code - zero) . x): the dequantized model's
// without rounding (code - zero) * scale to bf16 first. zr: this lane's own row's zero points; s0 / s1, cps_shift, x,
// x2 and acc as fp8_tile's (groups of 2^cps_shift chunks).
__device__ __forceinline__ uint32_t int4_pair(uint32_t codes, int shift, uint32_t zero2) {
  uint32_t v;  // (codes >> shift) & 0x000f000f | 0x43004300: 128 + the nibbles at bits shift and 16 + shift
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(v) : "r"(codes >> shift), "r"(0x000f000fu), "r"(0x43004300u));
  __nv_bfloat162 d = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v),
                             *reinterpret_cast<const __nv_bfloat162*>(&zero2));
  return *reinterpret_cast<const uint32_t*>(&d);
}
// The activations of columns (j, j + 4) and (j + 1, j + 5) for j = 0, 2 of 8 bf16 (a: columns 0-3, b: columns 4-7).
__device__ __forceinline__ void int4_act_pairs(uint32_t* o, uint32_t a01, uint32_t a23, uint32_t a45, uint32_t a67) {
  o[0] = __byte_perm(a01, a45, 0x5410);
  o[1] = __byte_perm(a01, a45, 0x7632);
  o[2] = __byte_perm(a23, a67, 0x5410);
  o[3] = __byte_perm(a23, a67, 0x7632);
}
// int4_tile_load / int4_tile: as fp8_tile_load / fp8_tile; int4_chunks computes chunks [c0, c0 + U) from b.
template <int U>
__device__ __forceinline__ void int4_tile_load(uint2 (&b)[U], const uint8_t* w, int c0, int nch) {
#pragma unroll
  for (int u = 0; u < U; ++u)
    b[u] = c0 + u < nch ? ld_weights8(w + static_cast<int64_t>(c0 + u) * 32) : make_uint2(0, 0);
}
template <int U, bool R2>
__device__ __forceinline__ void int4_chunks(float (&acc)[R2 ? 4 : 2], const uint2 (&b)[U], int c0, const bf16* x,
                                            const float* s0, const float* s1, const float* zr, int nch, int cps_shift,
                                            const bf16* x2) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + u;
    if (c >= nch) break;
    const int grp = c >> cps_shift;
    const float sa = s0[grp], sb = s1[grp];
    const __nv_bfloat162 z2 = __float2bfloat162_rn(128.0f + zr[grp]);
    const uint32_t zero2 = *reinterpret_cast<const uint32_t*>(&z2);
    uint32_t xp[8] = {}, yp[8] = {};
    auto act = [&](uint32_t (&o)[8], const bf16* r) {
      const uint4 lo = ld_act(r + static_cast<int64_t>(c) * 64), hi = ld_act(r + static_cast<int64_t>(c) * 64 + 8);
      int4_act_pairs(o, lo.x, lo.y, lo.z, lo.w);
      int4_act_pairs(o + 4, hi.x, hi.y, hi.z, hi.w);
    };
    if (x) act(xp, x);
    if (R2 && x2) act(yp, x2);
    const uint32_t wq[2] = {b[u].x, b[u].y};
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // code word h: columns 8h..8h+7 as pairs (j, j + 4), j = 0..3
#pragma unroll
      for (int m = 0; m < 2; ++m) {  // an mma: pairs 2m (a0 / b0) and 2m + 1 (a2 / b1)
        const int j = 4 * h + 2 * m;
        const uint32_t af[4] = {xp[j], R2 ? yp[j] : 0u, xp[j + 1], R2 ? yp[j + 1] : 0u};
        mma_bf16(d, af, int4_pair(wq[h], 8 * m, zero2), int4_pair(wq[h], 8 * m + 4, zero2));
      }
    }
    scaled_add<R2>(acc, sa, sb, d);
  }
}
template <int U, bool R2 = false>
__device__ __forceinline__ void int4_tile(float (&acc)[R2 ? 4 : 2], const uint8_t* w, const bf16* x, const float* s0,
                                          const float* s1, const float* zr, int nch, int cps_shift,
                                          const bf16* x2 = nullptr) {
  for (int c0 = 0; c0 < nch; c0 += U) {
    uint2 b[U];
    int4_tile_load<U>(b, w, c0, nch);
    int4_chunks<U, R2>(acc, b, c0, x, s0, s1, zr, nch, cps_shift, x2);
  }
}
// The first U chunks already in b (int4_tile_load at 0), as fp8_tile's.
template <int U, bool R2 = false>
__device__ __forceinline__ void int4_tile(float (&acc)[R2 ? 4 : 2], const uint2 (&b)[U], const uint8_t* w,
                                          const bf16* x, const float* s0, const float* s1, const float* zr, int nch,
                                          int cps_shift, const bf16* x2 = nullptr) {
  int4_chunks<U, R2>(acc, b, 0, x, s0, s1, zr, nch, cps_shift, x2);
  for (int c0 = U; c0 < nch; c0 += U) {
    uint2 n[U];
    int4_tile_load<U>(n, w, c0, nch);
    int4_chunks<U, R2>(acc, n, c0, x, s0, s1, zr, nch, cps_shift, x2);
  }
}

// bf16 weights on tensor cores, as fp8_tile lays them out: a warp multiplies 8 weight rows (lane / 4 loads row
// lane / 4, 16 values at column 16 (lane % 4) of each 64-column chunk, two 16-byte loads) with the tokens (A's rows).
// b: U chunks of this lane's loads, the first group already issued (bf16_tile_load at c0); d: the mma accumulators
// (d[0] / d[1]: this lane's token with weight rows 2 (lane % 4) and 2 (lane % 4) + 1). Chunks [c0, c1); x as in
// fp8_tile.
template <int U>
__device__ __forceinline__ void bf16_tile_load(uint4 (&b)[2 * U], const bf16* w, int c, int c1) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool in = c + u < c1;
    b[2 * u] = in ? ld_weights(w + static_cast<int64_t>(c + u) * 64) : make_uint4(0, 0, 0, 0);
    b[2 * u + 1] = in ? ld_weights(w + static_cast<int64_t>(c + u) * 64 + 8) : make_uint4(0, 0, 0, 0);
  }
}
// R2 (as fp8_tile's): x2 the activations of token lane / 4 + 8, d[2] / d[3] its products.
template <int U, bool R2 = false>
__device__ __forceinline__ void bf16_tile(float (&d)[4], uint4 (&b)[2 * U], const bf16* w, const bf16* x, int c0,
                                          int c1, const bf16* x2 = nullptr) {
  for (int c = c0; c < c1;) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (c + u >= c1) break;
      uint4 xa = make_uint4(0, 0, 0, 0), xb = xa, ya = xa, yb = xa;
      if (x) {
        xa = ld_act(x + static_cast<int64_t>(c + u) * 64);
        xb = ld_act(x + static_cast<int64_t>(c + u) * 64 + 8);
      }
      if (R2 && x2) {
        ya = ld_act(x2 + static_cast<int64_t>(c + u) * 64);
        yb = ld_act(x2 + static_cast<int64_t>(c + u) * 64 + 8);
      }
      const uint32_t wq[8] = {b[2 * u].x,     b[2 * u].y,     b[2 * u].z,     b[2 * u].w,
                              b[2 * u + 1].x, b[2 * u + 1].y, b[2 * u + 1].z, b[2 * u + 1].w};
      const uint32_t xq[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
      const uint32_t yq[8] = {ya.x, ya.y, ya.z, ya.w, yb.x, yb.y, yb.z, yb.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // values 4j..4j+3: k 2q, 2q+1 (a0 / b0) and 2q+8, 2q+9 (a2 / b1)
        const uint32_t af[4] = {xq[2 * j], R2 ? yq[2 * j] : 0u, xq[2 * j + 1], R2 ? yq[2 * j + 1] : 0u};
        mma_bf16(d, af, wq[2 * j], wq[2 * j + 1]);
      }
    }
    c += U;
    if (c < c1) bf16_tile_load<U>(b, w, c, c1);
  }
}

template <int U, typename Row>
__device__ __forceinline__ void load_chunk(uint4 (&w)[U], const Row& row, int v, int end) {
#pragma unroll
  for (int u = 0; u < U; ++u) w[u] = v + u * 32 < end ? load_vec(row, v + u * 32) : make_uint4(0, 0, 0, 0);
}

// Token t's activation row: x + t * ldx (the x_row argument of chunk_dot / row_dot where rows are evenly spaced).
struct EvenRows {
  const bf16* x;
  int64_t ldx;
  __device__ __forceinline__ const bf16* operator()(int t) const { return x + t * ldx; }
};

// acc[t] += row . x_row(t) over this lane's 16-byte vectors [v, end) of one chunk; tokens >= T are skipped, as are
// tokens whose bit in `mask` is clear.
template <int TT, int U, typename XRow>
__device__ __forceinline__ void chunk_dot(float (&acc)[TT], const uint4 (&w)[U], int v, int end, XRow x_row,
                                          int T, unsigned mask) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int vi = v + u * 32;
    if (vi < end) {
#pragma unroll
      for (int t = 0; t < TT; ++t)
        if (t < T && (mask >> t & 1u)) acc[t] += dot8(w[u], ld_act(x_row(t) + static_cast<int64_t>(vi) * 8));
    }
  }
}

// acc[t] += row . x_row(t) over the vectors [begin, end) of a row, its first chunk already in w (load_chunk at lane).
template <int TT, int U, typename XRow, typename Row>
__device__ __forceinline__ void row_dot(float (&acc)[TT], uint4 (&w)[U], const Row& row, int begin, int end,
                                        XRow x_row, int T, unsigned mask) {
  const int lane = threadIdx.x & 31;
  for (int v = begin + lane;;) {
    chunk_dot<TT>(acc, w, v, end, x_row, T, mask);
    v += U * 32;
    if (v >= end) break;
    load_chunk(w, row, v, end);
  }
}

template <int TT>
__device__ __forceinline__ void warp_sum_all(float (&acc)[TT]) {
#pragma unroll
  for (int t = 0; t < TT; ++t) acc[t] = warp_sum(acc[t]);
}

// The norm's weights (D f32, D % 4 == 0) into shared memory: they are weights, so this may run before the PDL wait.
__device__ __forceinline__ void stage_norm_weights(const float* w, int D, float* ws) {
  for (int i = threadIdx.x; i < D / 4; i += blockDim.x)
    reinterpret_cast<float4*>(ws)[i] = reinterpret_cast<const float4*>(w)[i];
}

// One row of add_rmsnorm in a block, as rmsnorm_kernel<true> computes it with this block's threads: xs (shared, D
// bf16) = rmsnorm(bf16(n.residual + n.x)) * w with w staged in ws (shared, D f32); block 0 also writes the sums to
// n.residual_out. With `trigger`, lets the next kernel launch after its global reads. Ends with a block barrier. red: a
// float per warp.
__device__ __forceinline__ void block_add_rmsnorm(const AddNormIn& n, int D, const float* ws, bf16* xs, float* red,
                                                  bool trigger) {
  float ss = 0.0f;
  for (int i = threadIdx.x; i < D / 8; i += blockDim.x) {
    const uint4 r = add_residual8(ld_act(n.x + i * 8), ld_act(n.residual + i * 8), reinterpret_cast<uint4*>(xs) + i);
    if (blockIdx.x == 0) reinterpret_cast<uint4*>(n.residual_out)[i] = r;
    add_squares8(ss, r);
  }
  ss = block_sum(ss, red);
  if (trigger) pdl_trigger();
  const float inv = rms_inverse(ss, D, n.eps);
  // The vectors this thread wrote, a pair at a time (scale8's arithmetic in fewer registers: the pair kernel's
  // weights are held in 32 of its 64).
  for (int i = threadIdx.x; i < D / 8; i += blockDim.x) {
    __nv_bfloat162* v = reinterpret_cast<__nv_bfloat162*>(xs) + i * 4;
    const float2* wv = reinterpret_cast<const float2*>(ws) + i * 4;
#pragma unroll 1
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(v[j]), g = wv[j];
      v[j] = __halves2bfloat162(__float2bfloat16_rn(g.x * (f.x * inv)), __float2bfloat16_rn(g.y * (f.y * inv)));
    }
  }
  __syncthreads();
}

// ---- y = x W^T ----------------------------------------------------------------------------------------------
// Warp w of block b: row n = bx * (8 / ks) + w / ks, part w % ks of K; batch b.y. bx = b.x, except with PAIR (two
// problems of one batch, gemv_t_pair): blocks [0, split) compute a0, the rest a1 with bx = b.x - split. Without PAIR
// a1 and split are unused (no selection code in the single-problem kernels: it measured ~2% at batch 1).
// REG: the register cap (64: 4 blocks per SM, the one-row pair).
// NORM (one row, gemv_t_pair_norm): the input row is add_rmsnorm of nrm, computed by every block into shared memory
// (block_add_rmsnorm; K bf16 after K f32 of staged norm weights, dynamic), a.x unused.
template <int TT, bool PAIR, int REG = 128, bool NORM = false>
__global__ void __maxnreg__(REG) gemv_t_kernel(GemvArgs a0, GemvArgs a1, unsigned split, AddNormIn nrm) {
  __shared__ float red[kWarps][TT];
  const bool second = PAIR && blockIdx.x >= split;
  const GemvArgs a = second ? a1 : a0;
  const int bx = static_cast<int>(second ? blockIdx.x - split : blockIdx.x);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ks = a.ks, n = bx * (kWarps / ks) + warp / ks, part = warp % ks;
  const int nvec = a.K >> 3, vb = part * nvec / ks, ve = (part + 1) * nvec / ks;
  const bool active = n < a.N;
  const uint4* row = reinterpret_cast<const uint4*>(a.w + blockIdx.y * a.sw + static_cast<int64_t>(active ? n : 0) * a.ldw);
  uint4 w[kUnroll];
  load_chunk(w, row, vb + lane, active ? ve : 0);
  extern __shared__ __align__(16) uint8_t norm_smem[];
  float* ws = reinterpret_cast<float*>(norm_smem);
  bf16* xs = reinterpret_cast<bf16*>(norm_smem + a.K * sizeof(float));
  if constexpr (NORM) stage_norm_weights(nrm.w, a.K, ws);
  pdl_wait();
  if constexpr (NORM) block_add_rmsnorm(nrm, a.K, ws, xs, &red[0][0], true);
  else pdl_trigger();
  float acc[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
  const EvenRows x_row = NORM ? EvenRows{xs, 0} : EvenRows{a.x + blockIdx.y * a.sx, a.ldx};
  if (active) row_dot<TT>(acc, w, row, vb, ve, x_row, a.T, ~0u);
  warp_sum_all<TT>(acc);
  if (ks > 1) {
    if (lane == 0)
#pragma unroll
      for (int t = 0; t < TT; ++t) red[warp][t] = acc[t];
    __syncthreads();
    if (part == 0 && lane == 0)
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        float s = 0.0f;
        for (int p = 0; p < ks; ++p) s += red[warp + p][t];
        acc[t] = s;
      }
  }
  if (!active || part != 0 || lane != 0) return;
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t >= a.T) break;
    const int64_t o = blockIdx.y * a.sy + t * a.ldy + n;
    if (a.y_f32) static_cast<float*>(a.y)[o] = acc[t];
    else static_cast<bf16*>(a.y)[o] = __float2bfloat16_rn(acc[t]);
  }
}

// ---- W_UV at one token with the MLA decode combine folded in (mla_combine_uv) --------------------------------
// Block (b.x, h): rows [b.x * 8 * kUvRowsPerWarp, +8 * kUvRowsPerWarp) of head h's W_UV, a warp per kUvRowsPerWarp
// rows over all of K, the first kUvUnroll * 32 16-byte vectors of each row loaded before the PDL wait (a 512-wide row:
// all of it). After the wait the block sums its head's splits (combine_splits), or reads o_lat when the decode kernel
// wrote it (one split), into shared memory as bf16, rounded as mla_decode_combine rounds o_lat.
constexpr int kUvRowsPerWarp = 2, kUvUnroll = 2;
__global__ void __launch_bounds__(kWarps * 32) combine_uv_kernel(GemvArgs a, int32_t nh,
                                                                const MlaDecodeCombineItem* item,
                                                                const float* partial_o, const float* partial_lse) {
  __shared__ float red[32];
  __shared__ float wts[kWarps * 32];
  __shared__ __align__(16) bf16 xs[kCombineUvMaxK];
  const int h = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nvec = a.K >> 3, n0 = (blockIdx.x * kWarps + warp) * kUvRowsPerWarp;
  const uint4* rows[kUvRowsPerWarp];
  uint4 w[kUvRowsPerWarp][kUvUnroll];
#pragma unroll
  for (int r = 0; r < kUvRowsPerWarp; ++r) {
    const int n = n0 + r;
    rows[r] = reinterpret_cast<const uint4*>(a.w + h * a.sw + static_cast<int64_t>(n < a.N ? n : 0) * a.ldw);
    load_chunk(w[r], rows[r], lane, n < a.N ? nvec : 0);
  }
  pdl_wait();
  if (item) {
    constexpr int kCols = kCombineUvMaxK / (kWarps * 32);
    const MlaDecodeCombineItem it = *item;
    float acc[kCols], inv_total;
    combine_splits<kWarps * 32>(partial_o, partial_lse, it.first_partial, it.num_partials, nh, h, a.K, red, wts, acc,
                                inv_total);
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int c = tid + j * kWarps * 32;
      if (c < a.K) xs[c] = __float2bfloat16_rn(acc[j] * inv_total);
    }
  } else {
    for (int v = tid; v < nvec; v += kWarps * 32)
      reinterpret_cast<uint4*>(xs)[v] = ld_act(a.x + h * a.sx + static_cast<int64_t>(v) * 8);
  }
  __syncthreads();
  pdl_trigger();  // after this kernel's activation reads
#pragma unroll
  for (int r = 0; r < kUvRowsPerWarp; ++r) {
    const int n = n0 + r;
    if (n >= a.N) break;
    float acc[1] = {0.0f};
    row_dot<1>(acc, w[r], rows[r], 0, nvec, EvenRows{xs, 0}, 1, ~0u);
    acc[0] = warp_sum(acc[0]);
    if (lane != 0) continue;
    const int64_t o = h * a.sy + n;
    if (a.y_f32) static_cast<float*>(a.y)[o] = acc[0];
    else static_cast<bf16*>(a.y)[o] = __float2bfloat16_rn(acc[0]);
  }
}

// ---- y = x W^T on tensor cores (K % 32 == 0) ----------------------------------------------------------------
// A warp computes 16 rows for all (up to 8) tokens with mma.m16n8k16: the weights are the A operand and the tokens
// the 8 columns of B, so the activations are read once per 16 rows (the lane kernel above reads them once per row).
// Within each 32-wide chunk of K, lane (g, t4) loads 16 bytes at 8 * t4 of rows g and g + 8 and of token g; the
// first 8 bytes feed one mma and the last 8 the other. That assigns the MMA's k index 2t4 + {0, 1, 8, 9} to
// positions 8 t4 + {0, 1, 2, 3} (then + 4): a permutation of the chunk applied to both operands, so the sum is the
// same dot product. Warp w of block b: row group bx * (8 / ks) + w / ks, part w % ks of K; batch b.y; bx and PAIR
// as in gemv_t_kernel.
constexpr int kMmaUnroll = 8;  // 32-wide chunks per load batch (16 16-byte weight loads per lane in flight)
template <bool PAIR>
__global__ void __launch_bounds__(kWarps * 32) gemv_mma_kernel(GemvArgs a0, GemvArgs a1, unsigned split) {
  __shared__ float red[kWarps][32][4];
  const bool second = PAIR && blockIdx.x >= split;
  const GemvArgs a = second ? a1 : a0;
  const int bx = static_cast<int>(second ? blockIdx.x - split : blockIdx.x);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const int ks = a.ks, row0 = (bx * (kWarps / ks) + warp / ks) * 16, part = warp % ks;
  const int nch = a.K >> 5, cb = part * nch / ks, ce = (part + 1) * nch / ks;
  const bool has_lo = row0 + g < a.N, has_hi = row0 + g + 8 < a.N;
  const bf16* wb = a.w + blockIdx.y * a.sw + 8 * t4;
  const bf16* w_lo = wb + static_cast<int64_t>(has_lo ? row0 + g : 0) * a.ldw;
  const bf16* w_hi = wb + static_cast<int64_t>(has_hi ? row0 + g + 8 : 0) * a.ldw;
  uint4 lo[kMmaUnroll], hi[kMmaUnroll];
  auto load = [&](int c) {
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const bool in = c + u < ce;
      lo[u] = in && has_lo ? ld_weights(w_lo + (c + u) * 32) : make_uint4(0, 0, 0, 0);
      hi[u] = in && has_hi ? ld_weights(w_hi + (c + u) * 32) : make_uint4(0, 0, 0, 0);
    }
  };
  load(cb);
  pdl_wait();
  pdl_trigger();
  const bool tok = g < a.T;
  const bf16* xr = a.x + blockIdx.y * a.sx + static_cast<int64_t>(tok ? g : 0) * a.ldx + 8 * t4;
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int ch = cb; ch < ce; ch += kMmaUnroll) {
    if (ch != cb) load(ch);
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      if (ch + u >= ce) break;
      const uint4 xv = tok ? ld_act(xr + (ch + u) * 32) : make_uint4(0, 0, 0, 0);
      const uint32_t a1[4] = {lo[u].x, hi[u].x, lo[u].y, hi[u].y}, a2[4] = {lo[u].z, hi[u].z, lo[u].w, hi[u].w};
      mma_bf16(c, a1, xv.x, xv.y);
      mma_bf16(c, a2, xv.z, xv.w);
    }
  }
  if (ks > 1) {
#pragma unroll
    for (int j = 0; j < 4; ++j) red[warp][lane][j] = c[j];
    __syncthreads();
    if (part == 0)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float s = 0.0f;
        for (int p = 0; p < ks; ++p) s += red[warp + p][lane][j];
        c[j] = s;
      }
  }
  if (part != 0) return;
  // c0, c1: row row0 + g, tokens 2 t4 and 2 t4 + 1; c2, c3: row row0 + g + 8.
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int n = row0 + g + (j >= 2 ? 8 : 0), t = 2 * t4 + (j & 1);
    if (n >= a.N || t >= a.T) continue;
    const int64_t o = blockIdx.y * a.sy + t * a.ldy + n;
    if (a.y_f32) static_cast<float*>(a.y)[o] = c[j];
    else static_cast<bf16*>(a.y)[o] = __float2bfloat16_rn(c[j]);
  }
}

// ---- router + routing ---------------------------------------------------------------------------------------
// logits[t, e] = x[t] . router[e] (fp32, a warp per expert as in gemv_t_kernel), then one block routes the token(s)
// (route_block): with CLUSTER block 0 (below), else the block that finishes last, from the logits the others left in
// L2, resetting the counter for the next launch (graph replays included).
static_assert(kMoeGateMaxExperts <= kBlockRouteMax && kWarps * 32 >= kBlockRouteMax, "route_block: a thread per expert");
// NORM (one row, moe_gate_norm): the row is add_rmsnorm of nrm, computed by every block into shared memory as in
// gemv_t_kernel; block 0 also writes it to `normed` (the experts' input).
// CLUSTER (a grid of at most kGateClusterMax blocks launched as one thread-block cluster, at most as many tokens as
// blocks): the blocks put token t's logits straight into block t's shared memory and meet at a cluster barrier;
// block t routes token t from there (no arrival counter, no fences, no logits in global memory).
// TT: token rows held per warp (1 without CLUSTER).
template <int TT, bool NORM, bool CLUSTER>
__global__ void __launch_bounds__(kWarps * 32) moe_gate_kernel(GemvArgs g, const float* bias, RouteArgs r,
                                                             unsigned* counter, int32_t* ids, float* weights,
                                                             AddNormIn nrm, bf16* normed) {
  static_assert(TT == 1 || (CLUSTER && !NORM), "several tokens only through the cluster, without the norm");
  __shared__ bool last;
  __shared__ float red[kWarps];
  __shared__ float cluster_logits[CLUSTER ? kGateClusterMax * kWarps : 1];
  if constexpr (CLUSTER) cluster_arrive_relaxed();  // this block runs
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n = blockIdx.x * kWarps + warp, nvec = g.K >> 3;
  const bool active = n < g.N;
  const uint4* row = reinterpret_cast<const uint4*>(g.w + static_cast<int64_t>(active ? n : 0) * g.ldw);
  uint4 w[kUnroll];
  load_chunk(w, row, lane, active ? nvec : 0);
  extern __shared__ __align__(16) uint8_t gate_smem[];
  float* ws = reinterpret_cast<float*>(gate_smem);
  bf16* xs = reinterpret_cast<bf16*>(gate_smem + g.K * sizeof(float));
  if constexpr (NORM) stage_norm_weights(nrm.w, g.K, ws);
  pdl_wait();
  if constexpr (NORM) {
    block_add_rmsnorm(nrm, g.K, ws, xs, red, false);
    if (blockIdx.x == 0)
      for (int i = threadIdx.x; i < nvec; i += kWarps * 32)
        reinterpret_cast<uint4*>(normed)[i] = reinterpret_cast<const uint4*>(xs)[i];
  }
  float acc[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
  const EvenRows x_row = NORM ? EvenRows{xs, 0} : EvenRows{g.x, g.ldx};
  if (active) row_dot<TT>(acc, w, row, 0, nvec, x_row, g.T, ~0u);
  warp_sum_all<TT>(acc);
  if constexpr (CLUSTER) {
    cluster_wait();  // every block of the cluster runs
    if (active && lane == 0)
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t >= g.T) break;
        *in_block(cluster_logits + n, t) = acc[t];  // expert n's logit for token t, into block t
      }
    pdl_trigger();  // as below: the MoE kernel's loads start after these products
    cluster_sync();
    const int t = static_cast<int>(blockIdx.x);
    if (t >= g.T) return;
    route_block<true>(cluster_logits, g.N, 1, bias, g.N, r, ids + t * r.ids_per_token(),
                      weights + t * r.ids_per_token());
    return;
  }
  float* logits = static_cast<float*>(g.y);
  if (active && lane == 0)
#pragma unroll
    for (int t = 0; t < TT; ++t)
      if (t < g.T) logits[t * g.ldy + n] = acc[t];
  __threadfence();
  __syncthreads();
  // The MoE kernel's blocks start their weight loads only now: launched at the wait, their loads held up these
  // products' (measured: the products took 5 us instead of 2.8; the step -2% at one token, docs/perf.md).
  pdl_trigger();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
  __syncthreads();
  probe_mark(3);
  if (!last) return;
  __threadfence();
  route_block(logits, g.ldy, g.T, bias, g.N, r, ids, weights);
  if (threadIdx.x == 0) *counter = 0;
  probe_mark(2);
}

// ---- y = x W (W: [K, N] rows), bf16 out ------------------------------------------------------------------------
// Block (b.x, b.y): columns [kNCols b.x, kNCols (b.x + 1)) of batch b.y; warp w sums rows [w K / 8, (w + 1) K / 8).
// Within a warp, lane l takes the 8 columns (l % 8) and rows (l / 8) + 4 i of each group of kNRows rows, so a block
// holds only kNCols columns (W_UK of V2-Lite: 128 blocks of 16 KB, where 256-column blocks made 32 of 64 KB, each
// streaming its weights alone after the wide kernel before it let it in). Lanes of one column group add their sums
// (shuffles), the warps' meet in shared memory.
constexpr int kNRows = 16;             // rows per warp held in registers at once
constexpr int kNCols = 64;             // columns per block: 8 per lane, 8 lanes across
constexpr int kNLanesPerRow = kNCols / 8, kNRowGroups = 32 / kNLanesPerRow, kNRowsPerLane = kNRows / kNRowGroups;
// PREP: the last row of blocks (b.y == gridDim.y - 1) runs mla_prepare_block instead (gemv_n_prepare).
template <int TT, bool PREP>
__global__ void __launch_bounds__(kWarps * 32) gemv_n_kernel(GemvArgs a, MlaPrepArgs prep) {
  if (PREP && blockIdx.y == gridDim.y - 1) {
    pdl_wait();
    pdl_trigger();
    mla_prepare_block(prep, blockIdx.x, gridDim.x);
    return;
  }
  __shared__ float part[kWarps][kNCols];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int lc = lane % kNLanesPerRow, rg = lane / kNLanesPerRow;
  const int c0 = blockIdx.x * kNCols + lc * 8;
  const bool active = c0 < a.N;
  const int r0 = warp * a.K / kWarps, r1 = (warp + 1) * a.K / kWarps;
  const bf16* wb = a.w + blockIdx.y * a.sw + c0;
  auto load = [&](uint4 (&w)[kNRowsPerLane], int rb) {
#pragma unroll
    for (int i = 0; i < kNRowsPerLane; ++i) {
      const int r = rb + rg + kNRowGroups * i;
      w[i] = active && r < r1 ? ld_weights(wb + static_cast<int64_t>(r) * a.ldw) : make_uint4(0, 0, 0, 0);
    }
  };
  uint4 w[kNRowsPerLane];
  load(w, r0);
  pdl_wait();
  pdl_trigger();
  float acc[TT][8];
#pragma unroll
  for (int t = 0; t < TT; ++t)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[t][j] = 0.0f;
  const bf16* xb = a.x + blockIdx.y * a.sx;
  for (int rb = r0; rb < r1; rb += kNRows) {
    if (rb != r0) load(w, rb);
#pragma unroll
    for (int i = 0; i < kNRowsPerLane; ++i) {
      const int r = rb + rg + kNRowGroups * i;
      if (r >= r1) break;
      const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&w[i]);
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t >= a.T) break;
        const float xv = __bfloat162float(xb[t * a.ldx + r]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = __bfloat1622float2(wp[j]);
          acc[t][2 * j] = fmaf(xv, f.x, acc[t][2 * j]);
          acc[t][2 * j + 1] = fmaf(xv, f.y, acc[t][2 * j + 1]);
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < TT; ++t)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int o = kNLanesPerRow; o < 32; o <<= 1) acc[t][j] += __shfl_xor_sync(0xffffffffu, acc[t][j], o);
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t >= a.T) break;
    if (rg == 0)
#pragma unroll
      for (int j = 0; j < 8; ++j) part[warp][lc * 8 + j] = acc[t][j];
    __syncthreads();
    const int c = blockIdx.x * kNCols + threadIdx.x;
    if (threadIdx.x < kNCols && c < a.N) {
      float s = 0.0f;
      for (int q = 0; q < kWarps; ++q) s += part[q][threadIdx.x];
      static_cast<bf16*>(a.y)[blockIdx.y * a.sy + t * a.ldy + c] = __float2bfloat16_rn(s);
    }
    __syncthreads();
  }
}

// ---- MoE of a small batch ---------------------------------------------------------------------------------------
// The plan: the batch's distinct local experts in first-occurrence order over (token, slot), and for each of them
// the slot every token chose it in (-1: not chosen). Each block that needs it builds it in shared memory from the
// routing ids (at most kMaxPairs of them), so no kernel of its own sits between the router and the experts.
constexpr int kMaxPairs = kMoeSmallTcRows * kMoeSmallMaxK;  // (token, slot) pairs
struct MoePlan {
  int32_t n;
  int32_t uniq[kMaxPairs];
  int8_t slot[kMaxPairs][kMoeSmallTcRows];
};

// Thread i's routing pair (its local expert, -1 for none): read once the ids are final, ahead of build_plan.
__device__ __forceinline__ int plan_pair(const MoeSmallArgs& a) {
  const int i = threadIdx.x;
  if (i >= a.T * a.k || i % a.k >= a.k - a.n_fixed) return -1;  // the fixed experts: not in the plan
  const int e = a.ids[i] - a.expert_begin;
  return e >= 0 && e < a.E ? e : -1;
}

// Called by every thread of a block of >= kMaxPairs threads with its plan_pair; p is __shared__.
__device__ __forceinline__ void build_plan(const MoeSmallArgs& a, int e, MoePlan& p) {
  __shared__ int32_t ids[kMaxPairs], pos[kMaxPairs], warp_firsts[kMaxPairs / 32];
  const int i = threadIdx.x, lane = i & 31, warp = i >> 5;
  const bool mine = i < kMaxPairs;  // whole warps
  int first = -1;
  unsigned m = 0;
  if (mine) {
    ids[i] = e;
    for (int t = 0; t < kMoeSmallTcRows; ++t) p.slot[i][t] = -1;
  }
  __syncthreads();
  if (mine) {
    first = e >= 0 ? i : -1;  // the first pair that chose this expert
    for (int j = 0; j < i && first == i; ++j)
      if (ids[j] == e) first = j;
    m = __ballot_sync(0xffffffffu, first == i);
    if (lane == 0) warp_firsts[warp] = __popc(m);
  }
  __syncthreads();
  if (mine) {
    int before = __popc(m & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w) before += warp_firsts[w];
    if (first == i) {
      pos[i] = before;
      p.uniq[before] = e;
    }
    if (i == kMaxPairs - 1) p.n = before + (first == i ? 1 : 0);
  }
  __syncthreads();
  if (mine && first >= 0) p.slot[pos[first]][i / a.k] = static_cast<int8_t>(i % a.k);
  __syncthreads();
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// The small-batch MoE's gate / up rows: row r (of [0, 2I)) of local expert e, F8 with its block scales when FP8, or
// (e < 0) row r of the shared experts' gate_up (bf16).
template <bool FP8>
__device__ __forceinline__ std::conditional_t<FP8, Fp8Row, const uint4*> gate_up_row(const MoeSmallArgs& a, int e,
                                                                                      int64_t r) {
  const bf16* shared = a.shared_gate_up + r * a.H;
  if constexpr (FP8) {
    if (e < 0) return Fp8Row{shared, nullptr, 0};
    const int64_t sr = (2 * a.I + a.block_rows - 1) / a.block_rows, sc = (a.H + a.block_cols - 1) / a.block_cols;
    return Fp8Row{reinterpret_cast<const uint8_t*>(a.gate_up) + (static_cast<int64_t>(e) * 2 * a.I + r) * a.H,
                  a.gate_up_scale + (e * sr + r / a.block_rows) * sc, a.block_cols / 8};
  } else {
    return reinterpret_cast<const uint4*>(e < 0 ? shared : a.gate_up + (static_cast<int64_t>(e) * 2 * a.I + r) * a.H);
  }
}

// Work item it (< F + Is + n * I): at one token on tensor cores with fixed experts (MoeSmallArgs::n_fixed), first
// F = n_fixed * I / 4 fixed tiles (tile f: fixed expert f / (I / 4), its indices 4 (f % (I / 4))); then, j = it - F,
// shared-expert row j for j < Is, else routed row (plan entry r / I, row r % I) for r = j - Is; neither the fixed
// nor the shared items' weights depend on the routing. Warps take items it = global warp, + all warps, ...; a
// warp's first item, when fixed or shared, is loaded before the wait and computed before the plan is built (it needs
// none).
// act[t * k + slot, i] = silu(gate . x) * (up . x) from fp32 sums (the grouped kernel's epilogue); act_shared[t, i]
// the same from bf16-rounded sums (the shared MLP's linear + silu_mul). Persistent blocks (MINB per SM) build the
// plan once each (without the fixed experts); block 0 leaves a copy in plan_out (when given) for the down kernel.
// U: 16-byte loads per lane in flight; MINB: blocks per SM (the launch sizes the persistent grid to match).
// TC (FP8 experts in whole 64-column scale blocks): routed items are fp8_tile's 8 rows, the gate and up rows of 4
// intermediate indices (B column 2j gate row i0 + j, 2j + 1 its up row), so a lane holds both halves of its act.
// STC (TC at more than kMoeSmallRows tokens): the shared experts on tensor cores too, in bf16_tile's 8-row items laid
// out as the routed ones (4 intermediate indices each), the first item's first chunks loaded before the wait.
// INT4 (with TC): the routed experts are INT4 code pairs, int4_tile's, in groups of block_cols columns.
template <int TT, int U, int MINB, bool FP8 = false, bool TC = false, int UT = U, bool INT4 = false>
__global__ void __launch_bounds__(kWarps * 32, MINB) moe_small_gate_up_kernel(MoeSmallArgs a, MoePlan* plan_out) {
  constexpr bool STC = TC && TT > kMoeSmallRows, R2 = TT > 8;  // R2: tokens 8-15 in the mma's A rows 8-15
  constexpr int TU = INT4 ? 2 * UT : UT;                        // a TC tile's chunks in flight per lane
  constexpr bool FIX = TC && TT == 1;  // fixed tiles first at one token only (moe_small clears n_fixed elsewhere)
  __shared__ MoePlan plan;
  const int lane = threadIdx.x & 31;  // (lane / 4 and lane % 4 computed where used: fewer registers held)
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  const int nvec = a.H >> 3, quads = a.I / 4;
  const int64_t fixed_items = FIX ? static_cast<int64_t>(a.n_fixed) * quads : 0;
  const int64_t shared_items = STC ? a.Is / 4 : a.Is;
  [[maybe_unused]] uint4 wg[STC ? 1 : U], wu[STC ? 1 : U];
  [[maybe_unused]] uint4 sb[STC ? 2 * UT : 1];
  [[maybe_unused]] std::conditional_t<INT4, uint2, uint4> tb[TC ? TU : 1];  // a TC tile's chunks
  std::conditional_t<FP8, Fp8Row, const uint4*> gr{}, ur{};
  // An STC shared item j: this lane's row of the 8 (lane / 4: gate rows 4j.. at even, up rows at odd) at column
  // 16 (lane % 4).
  [[maybe_unused]] auto shared_tile_row = [&](int64_t j) {
    const int g = lane >> 2;
    return a.shared_gate_up + ((g & 1 ? a.Is : 0) + 4 * j + (g >> 1)) * a.H + 16 * (lane & 3);
  };
  // A TC tile, 4 intermediate indices [i0, i0 + 4) of local expert e: this lane's weight row (lane / 4: gate rows at
  // even, up rows at odd) and its codes at column 16 (lane % 4); tile_load issues the first chunks into tb.
  [[maybe_unused]] auto tile_row = [&](int e, int i0) {
    const int g = lane >> 2;
    return static_cast<int64_t>(e) * 2 * a.I + (g & 1 ? a.I : 0) + i0 + (g >> 1);
  };
  [[maybe_unused]] auto tile_codes = [&](int64_t row) {
    return reinterpret_cast<const uint8_t*>(a.gate_up) + row * (INT4 ? a.H / 2 : a.H) + (INT4 ? 8 : 16) * (lane & 3);
  };
  [[maybe_unused]] auto tile_load = [&](const uint8_t* w) {
    if constexpr (INT4)
      int4_tile_load<TU>(tb, w, 0, a.H >> 6);
    else if constexpr (TC)
      fp8_tile_load<TU>(tb, w, 0, a.H >> 6);
  };
  // The tile's products with token g (slot s) and g + 8 (slot s2; -1: none) into act; its first chunks in tb when
  // loaded.
  [[maybe_unused]] auto tile = [&](int e, int i0, int s, int s2, bool loaded) {
    if constexpr (TC) {
      const int g = lane >> 2, q = lane & 3;
      const int64_t row = tile_row(e, i0);
      const uint8_t* w = tile_codes(row);
      const int64_t sr = (2 * a.I + a.block_rows - 1) / a.block_rows, sc = (a.H + a.block_cols - 1) / a.block_cols;
      const float* s0 = a.gate_up_scale + (e * sr + (i0 + q) / a.block_rows) * sc;
      const float* s1 = a.gate_up_scale + (e * sr + (a.I + i0 + q) / a.block_rows) * sc;
      const bf16* x = s >= 0 ? a.x + g * a.ldx + 16 * q : nullptr;
      const bf16* x2 = s2 >= 0 ? a.x + (g + 8) * a.ldx + 16 * q : nullptr;
      const int shift = __ffs(a.block_cols >> 6) - 1;
      float acc[R2 ? 4 : 2] = {};
      const float* zr = INT4 ? a.gate_up_zero + row * sc : nullptr;
      if constexpr (INT4) {
        if (loaded)
          int4_tile<TU, R2>(acc, tb, w, x, s0, s1, zr, a.H >> 6, shift, x2);
        else
          int4_tile<TU, R2>(acc, w, x, s0, s1, zr, a.H >> 6, shift, x2);
      } else {
        if (loaded)
          fp8_tile<TU, R2>(acc, tb, w, x, s0, s1, a.H >> 6, shift, x2);
        else
          fp8_tile<TU, R2>(acc, w, x, s0, s1, a.H >> 6, shift, x2);
      }
      if (s >= 0)
        a.act[(static_cast<int64_t>(g) * a.k + s) * a.I + i0 + q] = __float2bfloat16_rn(silu(acc[0]) * acc[1]);
      if constexpr (R2)
        if (s2 >= 0)
          a.act[(static_cast<int64_t>(g + 8) * a.k + s2) * a.I + i0 + q] = __float2bfloat16_rn(silu(acc[2]) * acc[3]);
    }
  };
  // Fixed tile f: every token's slot k - n_fixed + f / quads.
  [[maybe_unused]] auto fixed_tile = [&](int64_t f, bool loaded) {
    const int j = static_cast<int>(f / quads), e = a.E - a.n_fixed + j, i0 = static_cast<int>(f % quads) * 4;
    const int s = a.k - a.n_fixed + j, g = lane >> 2;
    tile(e, i0, g < a.T ? s : -1, R2 && g + 8 < a.T ? s : -1, loaded);
  };
  const bool first_fixed = FIX && first < fixed_items;
  const int64_t first_j = first - fixed_items;  // past the fixed items
  const bool first_shared = !first_fixed && first_j < shared_items;
  if (first_fixed) {
    const int e = a.E - a.n_fixed + static_cast<int>(first / quads), i0 = static_cast<int>(first % quads) * 4;
    tile_load(tile_codes(tile_row(e, i0)));
  } else if (first_shared) {
    if constexpr (STC) {
      bf16_tile_load<UT>(sb, shared_tile_row(first_j), 0, a.H >> 6);
    } else {
      gr = gate_up_row<FP8>(a, -1, first_j);
      ur = gate_up_row<FP8>(a, -1, a.Is + first_j);
      load_chunk(wg, gr, lane, nvec);
      load_chunk(wu, ur, lane, nvec);
    }
  }
  pdl_wait();
  pdl_trigger();
  const int pair = plan_pair(a);  // in flight while the first item is computed
  // Item j (past the fixed ones), its first chunk already in wg / wu (gr / ur set).
  auto compute = [&](int64_t it) {
    const bool shared = it < a.Is;
    unsigned mask = (1u << a.T) - 1u;
    int slot[TT];
    int64_t i = it;
    if (!shared) {
      const int u = static_cast<int>((it - a.Is) / a.I);
      i = (it - a.Is) % a.I;
      mask = 0;
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        slot[t] = plan.slot[u][t];
        if (slot[t] >= 0) mask |= 1u << t;
      }
    }
    float ag[TT], au[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) ag[t] = au[t] = 0.0f;
    for (int v = lane;;) {
      chunk_dot<TT>(ag, wg, v, nvec, EvenRows{a.x, a.ldx}, a.T, mask);
      chunk_dot<TT>(au, wu, v, nvec, EvenRows{a.x, a.ldx}, a.T, mask);
      v += U * 32;
      if (v >= nvec) break;
      load_chunk(wg, gr, v, nvec);
      load_chunk(wu, ur, v, nvec);
    }
    warp_sum_all<TT>(ag);
    warp_sum_all<TT>(au);
    if (lane != 0) return;
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (!(mask >> t & 1u)) continue;
      if (shared) {
        const float gt = __bfloat162float(__float2bfloat16_rn(ag[t]));
        const float up = __bfloat162float(__float2bfloat16_rn(au[t]));
        a.act_shared[t * static_cast<int64_t>(a.Is) + i] = __float2bfloat16_rn(silu(gt) * up);
      } else {
        a.act[(static_cast<int64_t>(t) * a.k + slot[t]) * a.I + i] = __float2bfloat16_rn(silu(ag[t]) * au[t]);
      }
    }
  };
  // STC shared item j (its first chunks in sb when loaded): act_shared[t, 4 j + lane % 4] for tokens t = lane / 4 and
  // (R2) lane / 4 + 8, from bf16-rounded sums as compute's.
  [[maybe_unused]] auto shared_tile = [&](int64_t j, bool loaded) {
    if constexpr (STC) {  // made for STC only
      const int g = lane >> 2, q = lane & 3;
      const bf16* w = shared_tile_row(j);
      if (!loaded) bf16_tile_load<UT>(sb, w, 0, a.H >> 6);
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      bf16_tile<UT, R2>(d, sb, w, g < a.T ? a.x + g * a.ldx + 16 * q : nullptr, 0, a.H >> 6,
                        R2 && g + 8 < a.T ? a.x + (g + 8) * a.ldx + 16 * q : nullptr);
      auto put = [&](int t, float gs, float us) {
        const float gv = __bfloat162float(__float2bfloat16_rn(gs)), uv = __bfloat162float(__float2bfloat16_rn(us));
        a.act_shared[t * static_cast<int64_t>(a.Is) + 4 * j + q] = __float2bfloat16_rn(silu(gv) * uv);
      };
      if (g < a.T) put(g, d[0], d[1]);
      if (R2 && g + 8 < a.T) put(g + 8, d[2], d[3]);
    }
  };
  if (first_fixed) {
    fixed_tile(first, true);
  } else if (first_shared) {
    if constexpr (STC)
      shared_tile(first_j, true);
    else
      compute(first_j);
  }
  build_plan(a, pair, plan);
  probe_mark(2);
  if (plan_out && blockIdx.x == 0)
    for (int i = threadIdx.x; i < static_cast<int>(sizeof(MoePlan) / 4); i += blockDim.x)
      reinterpret_cast<int32_t*>(plan_out)[i] = reinterpret_cast<const int32_t*>(&plan)[i];
  // A routed TC item: 4 intermediate indices [i0, i0 + 4) of plan entry r / (I / 4).
  [[maybe_unused]] auto routed_tile = [&](int64_t r) {
    const int u = static_cast<int>(r / quads), i0 = static_cast<int>(r % quads) * 4, e = plan.uniq[u], g = lane >> 2;
    tile(e, i0, g < a.T ? plan.slot[u][g] : -1, R2 && g + 8 < a.T ? plan.slot[u][g + 8] : -1, false);
  };
  const int64_t items = fixed_items + shared_items + static_cast<int64_t>(plan.n) * (TC ? quads : a.I);
  for (int64_t it = first_fixed || first_shared ? first + stride : first; it < items; it += stride) {
    if (FIX && it < fixed_items) {
      fixed_tile(it, false);
      continue;
    }
    const int64_t j = it - fixed_items;
    if constexpr (TC) {
      if (j >= shared_items) {
        routed_tile(j - shared_items);
        continue;
      }
    }
    if constexpr (STC) {
      shared_tile(j, false);
    } else {
      if (j < a.Is) {
        gr = gate_up_row<FP8>(a, -1, j);
        ur = gate_up_row<FP8>(a, -1, a.Is + j);
      } else {
        const int64_t r = j - a.Is, i = r % a.I;
        const int e = plan.uniq[r / a.I];
        gr = gate_up_row<FP8>(a, e, i);
        ur = gate_up_row<FP8>(a, e, a.I + i);
      }
      load_chunk(wg, gr, lane, nvec);
      load_chunk(wu, ur, lane, nvec);
      compute(j);
    }
  }
  probe_mark(3);  // thread 0's warp is done
}

// Output column c of token t of a small-batch down kernel: the routed pairs' weighted products (part, per (token,
// slot)) summed in slot order and rounded (the grouped path's combine), plus the shared experts' slices (spart, the
// first nsh of them) summed and rounded (the model's add).
template <int COLS, int TT>
__device__ __forceinline__ bf16 down_output(const float (&part)[COLS][kMaxPairs],
                                            const float (&spart)[COLS][kWarps][TT], int c, int t, int k, int nsh) {
  float r = 0.0f;
  for (int j = 0; j < k; ++j) r += part[c][t * k + j];  // pairs of non-local experts stay 0
  float o = __bfloat162float(__float2bfloat16_rn(r));
  if (nsh > 0) {
    float sh = 0.0f;
    for (int q = 0; q < nsh; ++q) sh += spart[c][q][t];
    o += __bfloat162float(__float2bfloat16_rn(sh));
  }
  return __float2bfloat16_rn(o);
}

// Block b: output columns [COLS b, COLS (b + 1)) of every token. Its "segments" (a slice of the
// shared experts' rows, or one routed expert's rows) go to the warps in turn; a warp walks its segment's rows (one per
// column, consecutive in memory), loading the next row while it reduces the current one. Each routed segment
// leaves w * (row . act) per (column, token, slot) in shared memory, summed per token in slot order and rounded (the
// grouped path's combine), then the shared experts' output is rounded and added (the model's add).
// U: 16-byte loads per lane per chunk of a row; MINB: blocks per SM. (FP8 experts on tensor cores:
// moe_small_down_tc_kernel.)
template <int TT, int COLS, int U, int MINB, bool FP8 = false>
__global__ void __launch_bounds__(kWarps * 32, MINB) moe_small_down_kernel(MoeSmallArgs a, const MoePlan* gplan,
                                                                           int32_t shared_segs) {
  __shared__ MoePlan plan;
  __shared__ float part[COLS][kMaxPairs];
  __shared__ float spart[COLS][kWarps][TT];
  constexpr int cols = COLS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t h0 = static_cast<int64_t>(blockIdx.x) * cols;
  const int ncol = a.H - h0 < cols ? static_cast<int>(a.H - h0) : cols;
  const int nvec = a.I >> 3, nvec_s = a.Is >> 3;
  const MoePlan* P = gplan ? gplan : &plan;  // gate/up's copy is read where it lies (after the wait)
  // Segment s of this warp: rows [s0, s1) (16-byte vectors) of row `base + c * stride` for column c (FP8: of
  // row_at(c), local expert seg_e's or, seg_e < 0, the shared experts').
  int seg_e = -1;
  auto seg_rows = [&](int s, const uint4*& base, int64_t& stride, int& s0, int& s1) {
    if (s < shared_segs) {
      base = reinterpret_cast<const uint4*>(a.shared_down + h0 * a.Is);
      stride = nvec_s;
      s0 = s * nvec_s / shared_segs;
      s1 = (s + 1) * nvec_s / shared_segs;
      seg_e = -1;
    } else {
      seg_e = P->uniq[s - shared_segs];
      base = reinterpret_cast<const uint4*>(a.down + (static_cast<int64_t>(seg_e) * a.H + h0) * a.I);
      stride = nvec;
      s0 = 0;
      s1 = nvec;
    }
  };
  const uint4* base = nullptr;
  int64_t stride = 0;
  auto row_at = [&](int c) {
    if constexpr (FP8) {
      if (seg_e < 0) return Fp8Row{base + c * stride, nullptr, 0};
      const int64_t sr = (a.H + a.block_rows - 1) / a.block_rows, sc = (a.I + a.block_cols - 1) / a.block_cols;
      const int64_t h = h0 + c;
      return Fp8Row{reinterpret_cast<const uint8_t*>(a.down) + (static_cast<int64_t>(seg_e) * a.H + h) * a.I,
                    a.down_scale + (seg_e * sr + h / a.block_rows) * sc, a.block_cols / 8};
    } else {
      return base + c * stride;
    }
  };
  uint4 wa[U], wb[U];
  // Before the wait, without gplan: the plan and this warp's first row. The routing ids were written before the
  // gate/up kernel began (it waits for them), and that kernel lets this one start only after its own wait, so they
  // are final here; the activations (gate/up's output) are read after the wait only. With gplan (gate/up's copy of
  // the plan, read after the wait): the first row only when it is a shared slice.
  if (!gplan) build_plan(a, plan_pair(a), plan);
  for (int i = threadIdx.x; i < COLS * kMaxPairs; i += blockDim.x) (&part[0][0])[i] = 0.0f;
  const int first_segs = gplan ? shared_segs : shared_segs + plan.n;  // first rows loadable now
  int s0 = 0, s1 = 0;
  if (warp < first_segs) {
    seg_rows(warp, base, stride, s0, s1);
    load_chunk(wa, row_at(0), s0 + lane, s1);
  }
  pdl_wait();
  pdl_trigger();
  __syncthreads();
  const int nseg = shared_segs + P->n;
  const unsigned all = (1u << a.T) - 1u;
  for (int s = warp; s < nseg; s += kWarps) {
    const bool sh = s < shared_segs;
    unsigned mask = all;
    int slot[TT];
    if (!sh) {
      mask = 0;
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        slot[t] = P->slot[s - shared_segs][t];
        if (slot[t] >= 0) mask |= 1u << t;
      }
    }
    if (s != warp || s >= first_segs) {
      seg_rows(s, base, stride, s0, s1);
      load_chunk(wa, row_at(0), s0 + lane, s1);
    }
    // Token t's activation row: act_shared row t, or act row t * k + slot[t].
    const auto act_row = [&](int t) {
      return sh ? a.act_shared + static_cast<int64_t>(t) * a.Is
                : a.act + (static_cast<int64_t>(t) * a.k + slot[t]) * a.I;
    };
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
      if (c >= ncol) break;
      const auto row = row_at(c);
      uint4(&cur)[U] = c % 2 ? wb : wa;  // c is a constant here: no indexing of the buffers at run time
      uint4(&next)[U] = c % 2 ? wa : wb;
      if (c + 1 < ncol) load_chunk(next, row_at(c + 1), s0 + lane, s1);
      float acc[TT];
#pragma unroll
      for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
      row_dot<TT>(acc, cur, row, s0, s1, act_row, TT, mask);  // mask holds only tokens < T
      warp_sum_all<TT>(acc);
      if (lane == 0) {
        if (sh) {
#pragma unroll
          for (int t = 0; t < TT; ++t) spart[c][s][t] = acc[t];
        } else {
#pragma unroll
          for (int t = 0; t < TT; ++t)
            if (mask >> t & 1u) part[c][t * a.k + slot[t]] = a.weights[t * a.k + slot[t]] * acc[t];
        }
      }
    }
  }
  __syncthreads();
  probe_mark(3);
  const int c = threadIdx.x / TT, t = threadIdx.x % TT;
  if (c >= ncol || t >= a.T) return;
  a.out[t * a.ldo + h0 + c] = down_output(part, spart, c, t, a.k, shared_segs);
}

// The shared experts' chunks (64 columns of 8 rows) of warp w in the TC down kernel, [c0, c1) of nsc: split so that
// every warp streams about the same bytes, its routed tiles (u = w, w + kWarps, ... < n, 8 rows x I codes each)
// counted (a shared chunk: 8 x 64 bf16).
__device__ __forceinline__ void shared_share(int w, int n, int I, int nsc, int& c0, int& c1) {
  const int64_t total = static_cast<int64_t>(n) * 8 * I + static_cast<int64_t>(nsc) * 1024;
  int64_t before = 0, mine = 0, all = 0;
#pragma unroll
  for (int v = 0; v < kWarps; ++v) {
    const int64_t tiles = n > v ? (n - v + kWarps - 1) / kWarps : 0;
    const int64_t left = total - kWarps * tiles * 8 * I, need = left > 0 ? left : 0;  // kWarps x the deficit
    if (v < w) before += need;
    if (v == w) mine = need;
    all += need;
  }
  if (all == 0) {  // no shared chunks
    c0 = c1 = 0;
    return;
  }
  c0 = static_cast<int>(nsc * before / all);
  c1 = static_cast<int>(nsc * (before + mine) / all);
}

// The down kernel of FP8 experts on tensor cores (MoeSmallArgs with H, I and Is multiples of 64): block b computes
// output columns [8 b, 8 b + 8) of every token. Warp w takes the tiles u = w, w + kWarps, ... of the fixed experts
// (u < n_fixed: local expert E - n_fixed + u, every token's slot k - n_fixed + u) then the plan's (fp8_tile of local
// expert plan.uniq[u - n_fixed]'s rows h0..h0+7), and a slice of the shared experts' K (bf16_tile of shared_down's
// same rows; shared_share: about the same bytes per warp). Before the wait: the first of its shared chunks, and its
// first tile's first chunks when that tile is known (fixed, or the plan is built here). The sums: down_output's.
// INT4: the routed experts through int4_tile (as gate/up's).
template <int TT, int UT, int MINB, bool INT4 = false>
__global__ void __launch_bounds__(kWarps * 32, MINB) moe_small_down_tc_kernel(MoeSmallArgs a, const MoePlan* gplan) {
  constexpr int TU = INT4 ? 2 * UT : UT;  // a tile's chunks in flight per lane
  __shared__ MoePlan plan;
  __shared__ float part[8][kMaxPairs];
  __shared__ float spart[8][kWarps][TT];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int64_t h0 = static_cast<int64_t>(blockIdx.x) * 8;
  const MoePlan* P = gplan ? gplan : &plan;
  if (!gplan) build_plan(a, plan_pair(a), plan);  // the ids are final (see moe_small_down_kernel)
  for (int i = threadIdx.x; i < 8 * kMaxPairs; i += blockDim.x) (&part[0][0])[i] = 0.0f;
  const int nsc = a.Is / 64, nf = a.n_fixed;
  int sc0 = 0, sc1 = 0;  // gate/up's plan is read after the wait: balanced for the most experts the batch can use
  shared_share(warp, gplan ? min(a.T * a.k, a.E) : plan.n + nf, a.I, nsc, sc0, sc1);
  const bf16* sw = a.shared_down + (h0 + g) * a.Is + 16 * q;
  uint4 sb[2 * kSmallMoeUnroll];
  bf16_tile_load<kSmallMoeUnroll>(sb, sw, sc0, sc1);
  // Tile u's local expert and this lane's codes (row h0 + lane / 4 at column 16 (lane % 4)).
  auto tile_e = [&](int u) { return u < nf ? a.E - nf + u : P->uniq[u - nf]; };
  auto tile_codes = [&](int e) {
    const int64_t row = static_cast<int64_t>(e) * a.H + h0 + g;
    return reinterpret_cast<const uint8_t*>(a.down) + row * (INT4 ? a.I / 2 : a.I) + (INT4 ? 8 : 16) * q;
  };
  std::conditional_t<INT4, uint2, uint4> tb[TU];
  auto tile_load = [&](int e) {
    if constexpr (INT4)
      int4_tile_load<TU>(tb, tile_codes(e), 0, a.I >> 6);
    else
      fp8_tile_load<TU>(tb, tile_codes(e), 0, a.I >> 6);
  };
  // At one token (the plan built above) the first tile's chunks are loaded before the wait; elsewhere none (registers).
  const bool first_loaded = TT == 1 && warp < nf + plan.n;
  if (first_loaded) tile_load(tile_e(warp));
  pdl_wait();
  pdl_trigger();
  __syncthreads();
  constexpr bool R2 = TT > 8;  // tokens 8-15 in the mma's A rows 8-15
  if (nsc > 0) {
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const bf16* xs = a.act_shared + 16 * q;
    bf16_tile<kSmallMoeUnroll, R2>(d, sb, sw, g < a.T ? xs + g * static_cast<int64_t>(a.Is) : nullptr, sc0, sc1,
                                   R2 && g + 8 < a.T ? xs + (g + 8) * static_cast<int64_t>(a.Is) : nullptr);
    if (g < TT) {
      spart[2 * q][warp][g] = d[0];
      spart[2 * q + 1][warp][g] = d[1];
    }
    if constexpr (R2) {
      spart[2 * q][warp][g + 8] = d[2];
      spart[2 * q + 1][warp][g + 8] = d[3];
    }
  }
  // Tile u (its first chunks in tb when loaded).
  auto run_tile = [&](int u, bool loaded) {
    const int e = tile_e(u);
    auto slot_of = [&](int t) { return t >= a.T ? -1 : u < nf ? a.k - nf + u : P->slot[u - nf][t]; };
    const int sl = slot_of(g), sl2 = R2 ? slot_of(g + 8) : -1;
    const int64_t sr = (a.H + a.block_rows - 1) / a.block_rows, sc = (a.I + a.block_cols - 1) / a.block_cols;
    const float* s0 = a.down_scale + (e * sr + (h0 + 2 * q) / a.block_rows) * sc;
    const float* s1 = a.down_scale + (e * sr + (h0 + 2 * q + 1) / a.block_rows) * sc;
    float acc[R2 ? 4 : 2] = {};
    const bf16* x = sl >= 0 ? a.act + (static_cast<int64_t>(g) * a.k + sl) * a.I + 16 * q : nullptr;
    const bf16* x2 = sl2 >= 0 ? a.act + (static_cast<int64_t>(g + 8) * a.k + sl2) * a.I + 16 * q : nullptr;
    const int shift = __ffs(a.block_cols >> 6) - 1;
    const float* zr = INT4 ? a.down_zero + (static_cast<int64_t>(e) * a.H + h0 + g) * sc : nullptr;
    if constexpr (INT4) {
      if (loaded)
        int4_tile<TU, R2>(acc, tb, tile_codes(e), x, s0, s1, zr, a.I >> 6, shift, x2);
      else
        int4_tile<TU, R2>(acc, tile_codes(e), x, s0, s1, zr, a.I >> 6, shift, x2);
    } else {
      if (loaded)
        fp8_tile<TU, R2>(acc, tb, tile_codes(e), x, s0, s1, a.I >> 6, shift, x2);
      else
        fp8_tile<TU, R2>(acc, tile_codes(e), x, s0, s1, a.I >> 6, shift, x2);
    }
    if (sl >= 0) {
      const int p = g * a.k + sl;
      part[2 * q][p] = a.weights[p] * acc[0];
      part[2 * q + 1][p] = a.weights[p] * acc[1];
    }
    if constexpr (R2) {
      if (sl2 >= 0) {
        const int p = (g + 8) * a.k + sl2;
        part[2 * q][p] = a.weights[p] * acc[2];
        part[2 * q + 1][p] = a.weights[p] * acc[3];
      }
    }
  };
  const int n = nf + P->n;
  int u0 = warp;
  if (first_loaded) {  // apart from the loop: tb is not live around it
    run_tile(warp, true);
    u0 += kWarps;
  }
  for (int u = u0; u < n; u += kWarps) run_tile(u, false);
  __syncthreads();
  probe_mark(3);
  const int c = threadIdx.x / TT, t = threadIdx.x % TT;
  if (c >= 8 || t >= a.T) return;
  a.out[t * a.ldo + h0 + c] = down_output(part, spart, c, t, a.k, nsc > 0 ? kWarps : 0);
}

int rows_bucket(int T) { return T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : 8; }

}  // namespace

bool gemv_fits(int64_t T, int64_t K, const void* x, int64_t ldx, const void* w, int64_t ldw) {
  return T >= 1 && T <= kGemvMaxRows && K % 8 == 0 && ldx % 8 == 0 && ldw % 8 == 0 && aligned16(x) && aligned16(w);
}

namespace {

// Blocks of the lane kernel for a.N rows at K split a.ks (kWarps / ks rows per block).
unsigned lane_blocks(const GemvArgs& a) { return static_cast<unsigned>((a.N + kWarps / a.ks - 1) / (kWarps / a.ks)); }

// The K split (a.ks) and the blocks of one problem: K is split over up to 8 warps while the rows alone leave the GPU
// short of ~16 warps per SM. mma: the tensor-core kernel (16 rows per warp, >= 2 chunks of 32 per part).
unsigned cut_gemv_t(GemvArgs& a, int32_t batch, int32_t num_sms, bool mma) {
  const int64_t target = static_cast<int64_t>(num_sms) * 16;
  int ks = 1;
  if (mma) {
    const int64_t groups = (a.N + 15) / 16, nch = a.K / 32;
    while (ks < kWarps && groups * batch * ks < target && nch / (ks * 2) >= 2) ks *= 2;
    a.ks = ks;
    return static_cast<unsigned>((groups + kWarps / ks - 1) / (kWarps / ks));
  }
  const int64_t nvec = a.K / 8;
  while (ks < kWarps && static_cast<int64_t>(a.N) * batch * ks < target && nvec / (ks * 2) >= 32) ks *= 2;
  a.ks = ks;
  return lane_blocks(a);
}

// One row of gemv_t_pair: the grid is made to fit at once (kPairBlocksPerSm per SM), so every warp loads its weights
// before the PDL wait: the wider K split of the two is halved until it fits (measured on H200, docs/perf.md: q_proj +
// kv_a of V2-Lite, 528 blocks instead of two waves of 672 at 3 blocks per SM, -1.7% per step).
void fit_one_row_pair(GemvArgs& a, GemvArgs& b, unsigned& ba, unsigned& bb, int32_t num_sms) {
  const int64_t fit = static_cast<int64_t>(kPairBlocksPerSm) * std::max(num_sms, 1);
  while (static_cast<int64_t>(ba) + bb > fit && (a.ks > 1 || b.ks > 1)) {
    if (a.ks >= b.ks) {
      a.ks /= 2;
      ba = lane_blocks(a);
    } else {
      b.ks /= 2;
      bb = lane_blocks(b);
    }
  }
}

// T >= 2 and K % 32 == 0: the tensor-core kernel.
bool use_mma(const GemvArgs& a) { return a.K % 32 == 0 && a.T > 1; }

}  // namespace

cudaError_t gemv_t(GemvArgs a, int32_t batch, int32_t num_sms, cudaStream_t stream) {
  if (a.N == 0 || batch == 0 || a.T == 0) return cudaSuccess;
  if (!gemv_fits(a.T, a.K, a.x, a.ldx, a.w, a.ldw) || a.K == 0) return cudaErrorInvalidValue;
  const bool mma = use_mma(a);
  const unsigned blocks = cut_gemv_t(a, batch, num_sms, mma);
  const dim3 grid(blocks, static_cast<unsigned>(batch));
  if (mma) return launch(gemv_mma_kernel<false>, grid, kWarps * 32, 0, stream, a, a, blocks);
  switch (rows_bucket(a.T)) {
    case 1: return launch(gemv_t_kernel<1, false>, grid, kWarps * 32, 0, stream, a, a, blocks, AddNormIn{});
    case 2: return launch(gemv_t_kernel<2, false>, grid, kWarps * 32, 0, stream, a, a, blocks, AddNormIn{});
    case 4: return launch(gemv_t_kernel<4, false>, grid, kWarps * 32, 0, stream, a, a, blocks, AddNormIn{});
    default: return launch(gemv_t_kernel<8, false>, grid, kWarps * 32, 0, stream, a, a, blocks, AddNormIn{});
  }
}

cudaError_t mla_combine_uv(GemvArgs a, int32_t nh, const MlaDecodeCombineItem* item, const float* partial_o,
                           const float* partial_lse, cudaStream_t stream) {
  if (a.N == 0 || nh == 0) return cudaSuccess;
  if (a.T != 1 || a.K == 0 || a.K > kCombineUvMaxK || !gemv_fits(a.T, a.K, a.x, a.ldx, a.w, a.ldw) || a.sw % 8 != 0 ||
      a.sx % 8 != 0)
    return cudaErrorInvalidValue;
  constexpr int rows = kWarps * kUvRowsPerWarp;
  const dim3 grid(static_cast<unsigned>((a.N + rows - 1) / rows), static_cast<unsigned>(nh));
  return launch(combine_uv_kernel, grid, kWarps * 32, 0, stream, a, nh, item, partial_o, partial_lse);
}

cudaError_t gemv_t_pair(GemvArgs a, GemvArgs b, int32_t num_sms, cudaStream_t stream) {
  if (a.T != b.T || a.K != b.K) return cudaErrorInvalidValue;
  // One launch on tensor cores or at one row (the lane kernel at 2-8 rows only when K % 32 != 0: not paired).
  const bool mma = use_mma(a);
  if (a.T == 0 || a.N == 0 || b.N == 0 || (!mma && a.T != 1)) {
    const cudaError_t e = gemv_t(a, 1, num_sms, stream);
    return e != cudaSuccess ? e : gemv_t(b, 1, num_sms, stream);
  }
  if (!gemv_fits(a.T, a.K, a.x, a.ldx, a.w, a.ldw) || !gemv_fits(b.T, b.K, b.x, b.ldx, b.w, b.ldw))
    return cudaErrorInvalidValue;
  // On tensor cores each problem gets the cut it would get alone, so its rows are computed exactly as gemv_t computes
  // them.
  unsigned ba = cut_gemv_t(a, 1, num_sms, mma), bb = cut_gemv_t(b, 1, num_sms, mma);
  if (mma) return launch(gemv_mma_kernel<true>, dim3(ba + bb, 1), kWarps * 32, 0, stream, a, b, ba);
  fit_one_row_pair(a, b, ba, bb, num_sms);
  return launch(gemv_t_kernel<1, true, 64>, dim3(ba + bb, 1), kWarps * 32, 0, stream, a, b, ba, AddNormIn{});
}

cudaError_t gemv_t_pair_norm(GemvArgs a, GemvArgs b, const AddNormIn& n, int32_t num_sms, cudaStream_t stream) {
  if (a.T != 1 || b.T != 1 || a.K != b.K || a.K % 8 != 0 || a.K > kPairNormMaxK || a.N == 0 || b.N == 0 ||
      a.ldw % 8 != 0 || b.ldw % 8 != 0 || !aligned16(a.w) || !aligned16(b.w) || !aligned16(n.x) ||
      !aligned16(n.residual) || !aligned16(n.residual_out) || !aligned16(n.w))
    return cudaErrorInvalidValue;
  unsigned ba = cut_gemv_t(a, 1, num_sms, false), bb = cut_gemv_t(b, 1, num_sms, false);
  fit_one_row_pair(a, b, ba, bb, num_sms);
  const size_t smem = static_cast<size_t>(a.K) * (sizeof(float) + sizeof(bf16));
  return launch(gemv_t_kernel<1, true, 64, true>, dim3(ba + bb, 1), kWarps * 32, smem, stream, a, b, ba, n);
}

bool moe_gate_fits(int64_t T, int64_t E) {
  const int64_t grid = (E + kWarps - 1) / kWarps;
  // Two tokens through the cluster (measured on H200, docs/perf.md: batch 2 -3%, while 4 and 8 tokens per warp lost
  // to gemv_t + moe_route by 1% / 3-5%); 2 is its own graph bucket, so a padded graph step takes the same path.
  return E >= 1 && E <= kMoeGateMaxExperts && (T == 1 || (T == kMoeGateClusterRows && grid <= kGateClusterMax &&
                                                           grid >= kMoeGateClusterRows));
}

cudaError_t moe_gate(GemvArgs a, const float* bias, const RouteArgs& r, unsigned* counter, int32_t* ids,
                     float* weights, cudaStream_t stream) {
  if (a.T == 0) return cudaSuccess;
  if (!moe_gate_fits(a.T, a.N) || !gemv_fits(a.T, a.K, a.x, a.ldx, a.w, a.ldw) || a.K == 0 || r.ids_per_token() > 32 ||
      r.top_k > a.N || a.ldy != a.N)
    return cudaErrorInvalidValue;
  const unsigned grid = static_cast<unsigned>((a.N + kWarps - 1) / kWarps);
  if (grid <= kGateClusterMax) {
    auto go = [&](auto kernel) {
      return launch_clustered(grid, kernel, grid, kWarps * 32, 0, stream, a, bias, r, counter, ids, weights,
                              AddNormIn{}, nullptr);
    };
    static_assert(kMoeGateClusterRows == 2, "moe_gate instantiates 1 and 2 rows");
    return a.T == 1 ? go(moe_gate_kernel<1, false, true>) : go(moe_gate_kernel<2, false, true>);
  }
  return launch(moe_gate_kernel<1, false, false>, grid, kWarps * 32, 0, stream, a, bias, r, counter, ids, weights,
                AddNormIn{}, nullptr);
}

cudaError_t moe_gate_norm(GemvArgs a, const float* bias, const RouteArgs& r, const AddNormIn& n, bf16* normed,
                          unsigned* counter, int32_t* ids, float* weights, cudaStream_t stream) {
  if (a.T != 1 || a.K == 0 || a.K % 8 != 0 || a.K > kPairNormMaxK || a.ldw % 8 != 0 || !aligned16(a.w) || a.N == 0 ||
      r.ids_per_token() > 32 || r.top_k > a.N || a.N > kMoeGateMaxExperts || a.ldy != a.N || !aligned16(n.x) ||
      !aligned16(n.residual) || !aligned16(n.residual_out) || !aligned16(n.w) || !aligned16(normed))
    return cudaErrorInvalidValue;
  const unsigned grid = static_cast<unsigned>((a.N + kWarps - 1) / kWarps);
  const size_t smem = static_cast<size_t>(a.K) * (sizeof(float) + sizeof(bf16));
  if (grid <= kGateClusterMax)
    return launch_clustered(grid, moe_gate_kernel<1, true, true>, grid, kWarps * 32, smem, stream, a, bias, r,
                            counter, ids, weights, n, normed);
  return launch(moe_gate_kernel<1, true, false>, grid, kWarps * 32, smem, stream, a, bias, r, counter, ids, weights, n,
                normed);
}

namespace {

bool gemv_n_fits(const GemvArgs& a) {
  return a.T <= kFewRows && a.N % 8 == 0 && a.ldw % 8 == 0 && aligned16(a.w) && !a.y_f32;
}

}  // namespace

cudaError_t gemv_n(GemvArgs a, int32_t batch, cudaStream_t stream) {
  if (a.N == 0 || batch == 0 || a.T == 0) return cudaSuccess;
  if (!gemv_n_fits(a)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((a.N + kNCols - 1) / kNCols), static_cast<unsigned>(batch));
  static_assert(kFewRows == 2, "gemv_n instantiates 1 and 2 rows");
  const MlaPrepArgs none{};
  return a.T == 1 ? launch(gemv_n_kernel<1, false>, grid, kWarps * 32, 0, stream, a, none)
                  : launch(gemv_n_kernel<2, false>, grid, kWarps * 32, 0, stream, a, none);
}

cudaError_t gemv_n_prepare(GemvArgs a, int32_t batch, const MlaPrepArgs& prep, cudaStream_t stream) {
  if (a.T == 0) return cudaSuccess;
  if (!gemv_n_fits(a) || prep.T != a.T || a.N == 0 || batch == 0) return cudaErrorInvalidValue;
  // The preparation's row needs T + 1 blocks (T latent rows, at least one for q's RoPE); product blocks past N
  // compute nothing.
  const unsigned nx = static_cast<unsigned>(std::max<int64_t>((a.N + kNCols - 1) / kNCols, a.T + 1));
  const dim3 grid(nx, static_cast<unsigned>(batch) + 1);
  return a.T == 1 ? launch(gemv_n_kernel<1, true>, grid, kWarps * 32, 0, stream, a, prep)
                  : launch(gemv_n_kernel<2, true>, grid, kWarps * 32, 0, stream, a, prep);
}

namespace {

// TC: FP8 experts through fp8_tile, 8 chunks of loads per lane at one token (2 gate/up blocks per SM), 4 at 2-4
// tokens (measured on H200, docs/perf.md); INT4 (with TC) through int4_tile, twice the chunks (8-byte loads).
template <bool FP8, bool TC, bool INT4, typename Grid>
cudaError_t moe_small_launch(const MoeSmallArgs& a, MoePlan* plan, int shared_segs, Grid gate_up_grid,
                             cudaStream_t stream) {
  constexpr int U = kSmallMoeUnroll;
  // Down: rows of COLS columns per block, MINB blocks per SM.
  auto down = [&](auto kernel, int cols, const MoePlan* p) {
    return launch(kernel, static_cast<unsigned>((a.H + cols - 1) / cols), kWarps * 32, 0, stream, a, p, shared_segs);
  };
  constexpr int GB1 = TC ? 2 : 4, UT1 = TC ? 8 : U;  // gate/up blocks per SM, fp8_tile's chunks at one token
  // TC down: 8 columns per block, 2 blocks per SM.
  auto down_tc = [&](auto kernel, const MoePlan* p) {
    return launch(kernel, static_cast<unsigned>(a.H / 8), kWarps * 32, 0, stream, a, p);
  };
  const MoePlan* none = nullptr;
  cudaError_t e;
  if (a.T == 1) {
    e = launch(moe_small_gate_up_kernel<1, U, GB1, FP8, TC, UT1, INT4>, gate_up_grid(GB1), kWarps * 32, 0, stream, a,
               static_cast<MoePlan*>(nullptr));
    if (e != cudaSuccess) return e;
    if constexpr (TC) return down_tc(moe_small_down_tc_kernel<1, UT1, 2, INT4>, none);
    return down(moe_small_down_kernel<1, 4, U, 4, FP8>, 4, none);
  }
  if (a.T > kMoeSmallRows) {  // FP8 experts on tensor cores only (moe_small checks)
    if constexpr (TC) {
      static_assert(kMoeSmallTcRows == 16, "moe_small instantiates 8 and 16 rows on tensor cores");
      if (a.T > 8) {
        e = launch(moe_small_gate_up_kernel<16, U, 3, FP8, TC, U, INT4>, gate_up_grid(3), kWarps * 32, 0, stream, a,
                   plan);
        if (e != cudaSuccess) return e;
        return down_tc(moe_small_down_tc_kernel<16, U, 2, INT4>, plan);
      }
      e = launch(moe_small_gate_up_kernel<8, U, 3, FP8, TC, U, INT4>, gate_up_grid(3), kWarps * 32, 0, stream, a, plan);
      if (e != cudaSuccess) return e;
      return down_tc(moe_small_down_tc_kernel<8, U, 2, INT4>, plan);
    }
    return cudaErrorInvalidValue;
  }
  if (a.T > 2) {
    e = launch(moe_small_gate_up_kernel<4, U, 3, FP8, TC, U, INT4>, gate_up_grid(3), kWarps * 32, 0, stream, a, plan);
    if (e != cudaSuccess) return e;
    if constexpr (TC) return down_tc(moe_small_down_tc_kernel<4, U, 2, INT4>, plan);
    return down(moe_small_down_kernel<4, 1, U, 5, FP8>, 1, plan);
  }
  e = launch(moe_small_gate_up_kernel<2, U, 3, FP8, TC, U, INT4>, gate_up_grid(3), kWarps * 32, 0, stream, a, plan);
  if (e != cudaSuccess) return e;
  if constexpr (TC) return down_tc(moe_small_down_tc_kernel<2, U, 2, INT4>, plan);
  return down(moe_small_down_kernel<2, 1, U, 6, FP8>, 1, plan);
}

}  // namespace

size_t moe_small_plan_bytes() { return sizeof(MoePlan); }

bool moe_small_tc_fits(int64_t H, int64_t I, int64_t Is, int64_t block_cols) {
  return H % 64 == 0 && I % 64 == 0 && Is % 64 == 0 && block_cols > 0 && block_cols % 64 == 0 &&
         ((block_cols / 64) & (block_cols / 64 - 1)) == 0;
}

cudaError_t moe_small(MoeSmallArgs a, void* plan_buf, int32_t num_sms, cudaStream_t stream) {
  if (a.T == 0) return cudaSuccess;
  // FP8 experts in whole 64-column scale blocks (a power of two of chunks) go to the tensor cores (fp8_tile; the
  // down kernel's shared experts through bf16_tile, in 64-column chunks; past kMoeSmallRows tokens gate/up's too), as
  // do INT4 experts in such groups (int4_tile; only there).
  const bool tc = a.gate_up_scale && moe_small_tc_fits(a.H, a.I, a.Is, a.block_cols);
  if (a.T > (tc ? kMoeSmallTcRows : kMoeSmallRows) || a.k > kMoeSmallMaxK || a.k < 1 || a.H % 8 != 0 ||
      a.I % 8 != 0 || a.Is % 8 != 0 || a.ldx % 8 != 0 || (reinterpret_cast<uintptr_t>(plan_buf) & 15) != 0)
    return cudaErrorInvalidValue;
  if (a.n_fixed < 0 || (a.n_fixed > 0 && (a.n_fixed >= a.k || a.n_fixed > a.E))) return cudaErrorInvalidValue;
  // Fixed experts first on tensor cores at one token (where the kernels have the registers to load them before the
  // wait; the kernels of 2-4 tokens spilled holding them); else they go with the routed ones, through the plan.
  if (!tc || a.T > 1) a.n_fixed = 0;
  MoePlan* plan = static_cast<MoePlan*>(plan_buf);
  const int max_unique = std::min(a.T * a.k, a.E);
  // The shared experts' row in slices of about one routed row each (at most one slice per warp).
  const int shared_segs = a.Is == 0 ? 0 : std::min(kWarps, std::max(1, (a.Is + a.I / 2) / a.I));
  const int64_t gate_up_items = static_cast<int64_t>(max_unique) * (tc ? a.I / 4 : a.I) +
                                (tc && a.T > kMoeSmallRows ? a.Is / 4 : a.Is);
  // Gate/up: persistent blocks, as many as fit at once, or fewer when there are fewer items (a warp each).
  auto gate_up_grid = [&](int per_sm) {
    return static_cast<unsigned>(std::min<int64_t>((gate_up_items + kWarps - 1) / kWarps,
                                                   per_sm * static_cast<int64_t>(std::max(num_sms, 1))));
  };
  // Measured on H200 (docs/perf.md), all with kSmallMoeUnroll loads per lane: gate/up with 4 / 3 / 3 blocks per SM at
  // one / two / 3-4 tokens (64 / 72 / 78 registers). Down at one token: 4 columns per block (each warp walks 4 rows of
  // its segment), 4 blocks per SM, the plan built before the wait; at 2-4 tokens, up to 4 times the segments, so one
  // column per block (many short blocks, 6 / 5 per SM, 40 / 48 registers) reading gate/up's copy of the plan. FP8 on
  // tensor cores at 5-16 tokens: 3 gate/up and 2 down blocks per SM (as at 3-4 tokens; not tuned further).
  static_assert(kMoeSmallRows == 4, "moe_small instantiates 1, 2 and 4 rows (and kMoeSmallTcRows on tensor cores)");
  if (a.gate_up_zero) {  // INT4 experts: on tensor cores only
    if (!tc || !a.down_scale || !a.down_zero || a.block_rows != 1) return cudaErrorInvalidValue;
    return moe_small_launch<true, true, true>(a, plan, shared_segs, gate_up_grid, stream);
  }
  if (a.gate_up_scale) {
    if (!a.down_scale || a.block_rows <= 0 || a.block_cols <= 0 || a.block_cols % 8 != 0) return cudaErrorInvalidValue;
    return tc ? moe_small_launch<true, true, false>(a, plan, shared_segs, gate_up_grid, stream)
              : moe_small_launch<true, false, false>(a, plan, shared_segs, gate_up_grid, stream);
  }
  return moe_small_launch<false, false, false>(a, plan, shared_segs, gate_up_grid, stream);
}

}  // namespace mlaserve::cuda
