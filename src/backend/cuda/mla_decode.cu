// MLA decode attention, absorbed form: per token, heads attend with 576-wide queries [q_lat (512) | q_pe (64)] over
// the paged latent cache rows [c_kv (512) | k_pe (64)] (one KV head), values = c_kv. CPU reference:
// cpu::mla_attention (absorbed_token_head).
//
// Work: one block per (item, head group); an item is one token's keys [key_begin, key_end) (a split of its context).
// Fast paths (kvr 512, rope 64): tensor cores (mma.sync m16n8k16 bf16), online softmax in log2 space, rows past the
// split zero-filled (unused pages are never read, so NaN there cannot leak). Splits write normalised partial outputs +
// log2-sum-exp; mla_decode_combine merges.
//  - mla_decode_ws_kernel (variants 5..8; 7 is the default, kMlaDecodeDefaultVariant): warp-specialised. A producer
//    warp streams cache tiles into a ring of shared-memory stages with bulk copies (cp.async.bulk, one 1152-byte row
//    per lane, mbarrier full/empty handshake), the consumer warps keep Q in registers and pass one named barrier per
//    tile (the split S exchange); each consumer warp redoes the tile's softmax into its own P fragments. Variant 7
//    (4 consumer warps, 32-key tiles, 2 stages, 2 blocks/SM) measured 3.77-3.83 TB/s of latent cache on one H200
//    (batch 128 x 4096, 16 heads, page 64), against 2.68-2.83 for variant 4 (docs/perf.md).
//  - mla_decode_fast_kernel (variants 0..4, and 64-head groups): every warp loads tiles with cp.async, S and P go
//    through shared memory, three block barriers per tile.
//  - An FP8 cache (kMlaDecodeFp8Variant; cache_f8): the warp-specialised kernel in variant 7's shape whose producer
//    streams the 576-byte code rows (E4M3 or E5M2) into a ring of FP8 stages; the consumers make each tile into one
//    bf16 tile in shared memory (the codes' exact values), hand the stage back, and go on as above (two more named
//    barriers per tile: the bf16 tile is free, it is made). Other dims: the simple kernel, reading codes.
// Multiples of 64 heads go first to the warpgroup-MMA kernel (mla_decode_wgmma.cu; bf16 or FP8 caches); these
// kernels take what it declines.
#include <algorithm>
#include <cmath>

#include <cuda_fp8.h>

#include "backend/cuda/combine.cuh"
#include "backend/cuda/common.cuh"
#include "backend/cuda/decode_out.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/kernels.h"

namespace mlaserve::cuda {

namespace {

// O += P V for one 16-key step of a warp: `a` the 16 x 16 P fragment, `vbase` this lane's ldmatrix address of the
// first 16 x 16 V block of the warp's columns; o holds NTO n8 tiles. All B fragments of a
// group are issued back to back, then the MMAs.
template <int NTO>
__device__ __forceinline__ void mma_pv_step(float (&o)[NTO][4], const uint32_t (&a)[4], const bf16* vbase) {
  constexpr int NB = NTO / 2 < 8 ? NTO / 2 : 8;
#pragma unroll
  for (int n0 = 0; n0 < NTO / 2; n0 += NB) {
    uint32_t b[NB][4];
#pragma unroll
    for (int j = 0; j < NB; ++j) ldmatrix_x4_trans(b[j], vbase + (n0 + j) * 16);
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      mma_bf16(o[2 * (n0 + j)], a, b[j][0], b[j][1]);
      mma_bf16(o[2 * (n0 + j) + 1], a, b[j][2], b[j][3]);
    }
  }
}

template <int HB, int NW, int STAGES, int BN_, int KSPLIT_ = 1>
struct DecodeCfg {
  static constexpr int KSPLIT = KSPLIT_;    // warps sharing one S tile, each over a slice of the 576 dims
  static constexpr int D = 576, KVR = 512, ROPE = 64;
  static constexpr int BN = BN_;            // keys per tile
  static constexpr int LDS = D + 8;         // smem row stride (elements): 1168 B, conflict-free ldmatrix
  static constexpr int MT = HB / 16;        // 16-head row tiles
  static constexpr int NTS = BN / 8;        // n8 tiles of S
  static constexpr int UPW = MT * NTS * KSPLIT / NW;  // S units (16 heads x 8 keys x a dim slice) per warp
  static constexpr int KSTEPS = D / 16 / KSPLIT;       // 16-wide k steps per unit
  static constexpr int CG = NW / MT;        // warps sharing a row tile in P @ V (split over dv)
  static constexpr int DVW = KVR / CG;      // dv columns per warp
  static constexpr int NTO = DVW / 8;       // O n8 tiles per warp
  static constexpr int TPR = NW * 32 / HB;  // softmax threads per row
  static constexpr int KPT = BN / TPR;      // keys per softmax thread
  static constexpr int LDP = BN + 8;        // P row stride (elements)
  static constexpr int LDSS = BN + 1;       // S row stride (floats)
  static constexpr size_t smem_bytes =
      sizeof(bf16) * (static_cast<size_t>(HB) * LDS + static_cast<size_t>(STAGES) * BN * LDS + HB * LDP) +
      sizeof(float) * (KSPLIT * HB * LDSS + 3 * HB);
  static_assert(MT * NTS * KSPLIT % NW == 0, "S units must split evenly over warps");
  static_assert(KSTEPS % 2 == 0, "k steps come in pairs");
  static_assert(NW % MT == 0, "warps must split evenly over row tiles");
  static_assert(NTO % 2 == 0, "O tiles come in pairs");
  static_assert(KPT >= 1 && TPR <= 32, "softmax mapping");
};

template <int HB, int NW, int STAGES, int BN_, int KSPLIT_>
__global__ void __launch_bounds__(NW * 32) mla_decode_fast_kernel(const MlaDecodeParams p) {
  using C = DecodeCfg<HB, NW, STAGES, BN_, KSPLIT_>;
  constexpr int D = C::D, KVR = C::KVR, BN = C::BN, LDS = C::LDS;
  constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
  extern __shared__ __align__(128) uint8_t smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK = sQ + HB * LDS;
  bf16* sP = sK + STAGES * BN * LDS;
  float* sS = reinterpret_cast<float*>(sP + HB * C::LDP);
  float* sAlpha = sS + C::KSPLIT * HB * C::LDSS;
  float* sM = sAlpha + HB;
  float* sL = sM + HB;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const MlaDecodeItem it = p.items[blockIdx.x];
  const int h0 = blockIdx.y * HB;
  const int nh = p.num_heads;
  const int rows_valid = min(HB, nh - h0);
  if (empty_split(p, it, h0, rows_valid)) return;
  const int32_t* ptab = p.page_table + static_cast<int64_t>(it.seq) * p.max_pages;
  const float scale = p.softmax_scale * kLog2e;
  const int num_keys = it.key_end - it.key_begin;
  const int n_tiles = (num_keys + BN - 1) / BN;

  // Q: rows = heads, [q_lat (512) | q_pe (64)]; one warp per row, 72 chunks of 16 bytes over its lanes.
  for (int r = warp; r < HB; r += NW) {
    const bool ok = r < rows_valid;
    const int64_t th = static_cast<int64_t>(it.token) * nh + h0 + (ok ? r : 0);
    for (int c = lane; c < CHUNKS; c += 32) {
      const int col = c * 8;
      const bf16* src = col < KVR ? p.q_lat + th * KVR + col : p.q + th * (p.nope + C::ROPE) + p.nope + (col - KVR);
      cp_async16(sQ + r * LDS + col, src, ok);
    }
  }
  // A tile of cache rows: one warp per row (the page-table lookup once per row), rows past the split zero-filled.
  auto load_tile = [&](int kt, int stage) {
    bf16* dst = sK + stage * BN * LDS;
    const int key0 = it.key_begin + kt * BN;
    for (int r = warp; r < BN; r += NW) {
      const int key = key0 + r;
      const bool ok = key < it.key_end;
      int64_t slot = 0;
      if (ok) slot = static_cast<int64_t>(ptab[key / p.page_size]) * p.page_size + key % p.page_size;
      const bf16* src = p.cache + slot * D;
      for (int c = lane; c < CHUNKS; c += 32) cp_async16(dst + r * LDS + c * 8, src + c * 8, ok);
    }
  };
  load_tile(0, 0);
  cp_async_commit();
#pragma unroll
  for (int s = 1; s < STAGES - 1; ++s) {
    if (s < n_tiles) load_tile(s, s);
    cp_async_commit();
  }
  if (tid < HB) {
    sM[tid] = -INFINITY;
    sL[tid] = 0.0f;
  }

  float o[C::NTO][4];
#pragma unroll
  for (int i = 0; i < C::NTO; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  const int pv_mt = warp / C::CG, pv_cg = warp % C::CG;

  for (int kt = 0; kt < n_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    if (kt + STAGES - 1 < n_tiles) load_tile(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
    cp_async_commit();
    const bf16* K = sK + (kt % STAGES) * BN * LDS;
    const int key0 = it.key_begin + kt * BN;

    // S = Q K^T for this warp's units (16 heads x 8 keys x a slice of the dims), written scaled to sS (one buffer
    // per dim slice). Fragments for the next k-step pair are loaded before the current pair's MMAs issue.
#pragma unroll
    for (int u = 0; u < C::UPW; ++u) {
      const int unit = warp * C::UPW + u;
      const int kh = unit % C::KSPLIT, tile = unit / C::KSPLIT;
      const int mt = tile / C::NTS, nt = tile % C::NTS;
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      const bf16* qrow = sQ + (mt * 16 + (lane & 15)) * LDS + (lane >> 4) * 8 + kh * C::KSTEPS * 16;
      const bf16* krow = K + (nt * 8 + (lane & 7)) * LDS + (lane >> 3) * 8 + kh * C::KSTEPS * 16;
      uint32_t a0[4], a1[4], b[4];
      ldmatrix_x4(a0, qrow);
      ldmatrix_x4(a1, qrow + 16);
      ldmatrix_x4(b, krow);
#pragma unroll
      for (int ks = 0; ks < C::KSTEPS; ks += 2) {
        uint32_t na0[4], na1[4], nb[4];
        if (ks + 2 < C::KSTEPS) {
          ldmatrix_x4(na0, qrow + (ks + 2) * 16);
          ldmatrix_x4(na1, qrow + (ks + 3) * 16);
          ldmatrix_x4(nb, krow + (ks + 2) * 16);
        }
        mma_bf16(acc[0], a0, b[0], b[1]);
        mma_bf16(acc[1], a1, b[2], b[3]);
        if (ks + 2 < C::KSTEPS) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            a0[i] = na0[i];
            a1[i] = na1[i];
            b[i] = nb[i];
          }
        }
      }
      const int kc = nt * 8 + 2 * t4;
      const bool v0 = key0 + kc < it.key_end, v1 = key0 + kc + 1 < it.key_end;
      float* s0 = sS + kh * HB * C::LDSS + (mt * 16 + g) * C::LDSS + kc;
      float* s1 = s0 + 8 * C::LDSS;
      s0[0] = v0 ? (acc[0][0] + acc[1][0]) * scale : -INFINITY;
      s0[1] = v1 ? (acc[0][1] + acc[1][1]) * scale : -INFINITY;
      s1[0] = v0 ? (acc[0][2] + acc[1][2]) * scale : -INFINITY;
      s1[1] = v1 ? (acc[0][3] + acc[1][3]) * scale : -INFINITY;
    }
    __syncthreads();

    // Online softmax: TPR consecutive lanes per row.
    {
      const int row = tid / C::TPR, sub = tid % C::TPR;
      const float* srow = sS + row * C::LDSS + sub * C::KPT;
      float sv[C::KPT];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < C::KPT; ++j) {
        sv[j] = srow[j];
#pragma unroll
        for (int q = 1; q < C::KSPLIT; ++q) sv[j] += srow[q * HB * C::LDSS + j];
        mx = fmaxf(mx, sv[j]);
      }
#pragma unroll
      for (int o2 = C::TPR / 2; o2 > 0; o2 >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o2));
      const float m_old = sM[row];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.0f;
      bf16* prow = sP + row * C::LDP + sub * C::KPT;
#pragma unroll
      for (int j = 0; j < C::KPT; ++j) {
        const float e = exp2f(sv[j] - m_new);
        sum += e;
        prow[j] = __float2bfloat16_rn(e);
      }
#pragma unroll
      for (int o2 = C::TPR / 2; o2 > 0; o2 >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o2);
      if (sub == 0) {
        const float alpha = exp2f(m_old - m_new);
        sAlpha[row] = alpha;
        sL[row] = sL[row] * alpha + sum;
        sM[row] = m_new;
      }
    }
    __syncthreads();

    // O = alpha * O + P V   (V = the first 512 columns of the cache tile)
    {
      const float al0 = sAlpha[pv_mt * 16 + g], al1 = sAlpha[pv_mt * 16 + g + 8];
#pragma unroll
      for (int i = 0; i < C::NTO; ++i) {
        o[i][0] *= al0;
        o[i][1] *= al0;
        o[i][2] *= al1;
        o[i][3] *= al1;
      }
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) {
        uint32_t a[4];
        ldmatrix_x4(a, sP + (pv_mt * 16 + (lane & 15)) * C::LDP + ks * 16 + (lane >> 4) * 8);
        mma_pv_step(o, a, K + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + pv_cg * C::DVW + (lane >> 4) * 8);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  const int r0 = pv_mt * 16 + g;
  store_output(p, it, h0, r0, pv_cg * C::DVW + 2 * t4, rows_valid, o, 1.0f / sL[r0], 1.0f / sL[r0 + 8]);
  if (it.partial >= 0 && tid < rows_valid)
    p.partial_lse[static_cast<int64_t>(it.partial) * nh + h0 + tid] = sM[tid] + log2f(sL[tid]);
}

// ---------------------------------------------------------------------------------------------------------------
// Warp-specialised path (variants 5..8, 16-head groups): one producer warp streams 32- or 64-key cache tiles into a
// ring of STAGES shared-memory buffers with bulk copies (cp.async.bulk, one 1152-byte row per lane, completing on a
// "full" mbarrier per stage); NW consumer warps compute on them and hand each buffer back through an "empty" mbarrier.
// Consumers keep their Q fragments in registers (loaded once), split QK^T over (8-key n-tiles x KSPLIT dim slices),
// exchange the partial scores through a double-buffered shared S tile (the only block-level barrier per tile: a named
// barrier among the consumers), and then every consumer warp redoes the online softmax of the whole 16 x BN tile
// itself, straight into its P @ V A-fragments: no P tile in shared memory, no second barrier. Row max / sum / rescale
// are the same arithmetic in every warp, so the warps agree bit for bit. Rows past the split are zero-filled by the
// producer (generic stores + a proxy fence): unused pages are never read.
template <int NW, int STAGES, int BN, int KSPLIT, int MINB, bool FP8 = false>
struct WsCfg {
  static constexpr int HB = 16, D = 576, KVR = 512, ROPE = 64, KEYS = BN;
  static constexpr int LDS = D + 8;                  // smem row stride (elements): 1168 B, conflict-free ldmatrix
  static constexpr int ROW_BYTES = FP8 ? D : D * 2;  // one cache row in global memory
  static constexpr int NT = BN / 8;                  // 8-key n-tiles of S
  static constexpr int NPW = NT * KSPLIT / NW;       // n-tiles per consumer warp (all in one dim slice)
  static constexpr int KSTEPS = D / 16 / KSPLIT;     // 16-deep k steps per dim slice
  static constexpr int DVW = KVR / NW, NTO = DVW / 8;  // P @ V: dv columns per warp, n8 tiles
  static constexpr int LDSS = BN + 8;                // S row stride (floats): float2 accesses conflict-free
  static constexpr int THREADS = (NW + 1) * 32;
  static constexpr int NLOAD = NPW == 1 ? (KSTEPS + 1) / 2 : KSTEPS * NPW / 2;  // ldmatrix.x4 per tile for QK^T
  // K fragments in flight: all of them when registers allow (ptxas: no spills in 5 and 6, 4 and 12 bytes in 7 and 8)
  static constexpr int PF = MINB > 1 || NLOAD > 9 ? 4 : NLOAD;
  // bf16 tiles: the ring's stages, or (FP8) the one tile the consumers make from an FP8 stage of the ring after it
  static constexpr size_t k_bytes = sizeof(bf16) * static_cast<size_t>(FP8 ? 1 : STAGES) * BN * LDS;
  static constexpr size_t f8_bytes = FP8 ? static_cast<size_t>(STAGES) * BN * D : 0;
  static constexpr size_t s_bytes = sizeof(float) * 2 * KSPLIT * HB * LDSS;
  static constexpr size_t smem_bytes = k_bytes + f8_bytes + s_bytes + 2 * STAGES * sizeof(uint64_t);
  static_assert(k_bytes % 16 == 0 && f8_bytes % 16 == 0, "bulk copies land on 16-byte boundaries");
  static_assert(NW % KSPLIT == 0 && (NT * KSPLIT) % NW == 0 && NPW >= 1, "S units must split evenly over warps");
  static_assert(NPW == 1 || NPW % 2 == 0, "n-tiles per warp: one or pairs");
  static_assert(BN % 32 == 0 && BN <= 64, "the producer moves one row per lane per 32 keys");
  static_assert(NTO % 2 == 0, "O tiles come in pairs");
};

// FP8 stage -> bf16 tile (BN rows of D codes -> rows of LDS elements), by the NW consumer warps (thread i of them).
template <class C>
__device__ __forceinline__ void fp8_tile_to_bf16(const uint8_t* src, bf16* dst, int i, int threads, CacheCodes codes) {
  constexpr int CPR = C::D / 16;  // 16-byte chunks of codes per row
  for (int c = i; c < C::KEYS * CPR; c += threads) {
    const int r = c / CPR, cc = c % CPR;
    const uint4 q = *reinterpret_cast<const uint4*>(src + r * C::D + cc * 16);
    uint32_t w[8];
    cache_codes4_bf16(q.x, w[0], w[1], codes);
    cache_codes4_bf16(q.y, w[2], w[3], codes);
    cache_codes4_bf16(q.z, w[4], w[5], codes);
    cache_codes4_bf16(q.w, w[6], w[7], codes);
    uint4* d = reinterpret_cast<uint4*>(dst + r * C::LDS + cc * 16);
    d[0] = make_uint4(w[0], w[1], w[2], w[3]);
    d[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
}

// CODES: an FP8 cache's code type (FP8), fixed per instantiation so the tile conversion has no branch.
template <int NW, int STAGES, int BN, int KSPLIT, int MINB, bool FP8, CacheCodes CODES>
__global__ void __launch_bounds__((NW + 1) * 32, MINB) mla_decode_ws_kernel(const MlaDecodeParams p) {
  using C = WsCfg<NW, STAGES, BN, KSPLIT, MINB, FP8>;
  constexpr int HB = C::HB, KVR = C::KVR, LDS = C::LDS, LDSS = C::LDSS, KSTEPS = C::KSTEPS, NPW = C::NPW;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);
  uint8_t* sF8 = smem_raw + C::k_bytes;
  float* sS = reinterpret_cast<float*>(smem_raw + C::k_bytes + C::f8_bytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw + C::k_bytes + C::f8_bytes + C::s_bytes);
  uint64_t* empty = full + STAGES;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  // The item and the page table were uploaded before the step, and cache rows below it.cached_end were written by
  // earlier steps: the producer loads the first stages of those before the PDL wait (the newest rows are written by
  // the kernel before this one). Everything else waits.
  const MlaDecodeItem it = p.items[blockIdx.x];
  const int h0 = blockIdx.y * HB;
  const int nh = p.num_heads;
  const int rows_valid = min(HB, nh - h0);
  const int n_tiles = (it.key_end - it.key_begin + BN - 1) / BN;
  if (tid == 0 && n_tiles > 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + s, 32);  // every producer lane arrives once per fill
      mbar_init(empty + s, NW);  // one arrival per consumer warp per use
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // Producer: fill stage kt % STAGES with tile kt once its previous use has been handed back.
  const int32_t* ptab = p.page_table + static_cast<int64_t>(it.seq) * p.max_pages;
  auto produce = [&](int kt) {
    const int s = kt % STAGES;
    const int key0 = it.key_begin + kt * BN;
    int64_t slot[BN / 32];
#pragma unroll
    for (int i = 0; i < BN / 32; ++i) {
      const int key = key0 + lane + 32 * i;
      slot[i] = key < it.key_end ? static_cast<int64_t>(ptab[key / p.page_size]) * p.page_size + key % p.page_size
                                 : 0;
    }
    if (kt >= STAGES) mbar_wait(empty + s, ((kt / STAGES) - 1) & 1);
    if (lane == 0) mbar_expect_tx(full + s, static_cast<uint32_t>(min(BN, it.key_end - key0) * C::ROW_BYTES));
    __syncwarp();
#pragma unroll
    for (int i = 0; i < BN / 32; ++i) {
      const int r = lane + 32 * i;
      // Row r of the stage: LDS bf16 elements apart, or (FP8) D codes.
      uint8_t* row = FP8 ? sF8 + (s * BN + r) * C::D : reinterpret_cast<uint8_t*>(sK + (s * BN + r) * LDS);
      if (key0 + r < it.key_end) {
        const void* src = FP8 ? static_cast<const void*>(p.cache_f8 + slot[i] * C::D)
                              : static_cast<const void*>(p.cache + slot[i] * C::D);
        bulk_copy_g2s(row, src, C::ROW_BYTES, full + s);
      } else {
        uint4* z = reinterpret_cast<uint4*>(row);
        for (int c = 0; c < C::ROW_BYTES / 16; ++c) z[c] = make_uint4(0, 0, 0, 0);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // before later bulk writes to this row
      }
    }
    mbar_arrive(full + s);
  };
  int early = 0;  // tiles produced before the wait: whole tiles of earlier steps' rows, up to the ring's size
  if (warp == NW)
    while (early < n_tiles && early < STAGES && min(it.key_begin + (early + 1) * BN, it.key_end) <= it.cached_end)
      produce(early++);
  pdl_wait();
  pdl_trigger();
  if (empty_split(p, it, h0, rows_valid)) return;
  if (warp == NW) {
    for (int kt = early; kt < n_tiles; ++kt) produce(kt);
    return;
  }

  // Consumers. This warp's S units: dim slice kh, n-tiles nt0 + j * (NW / KSPLIT).
  const int kh = warp % KSPLIT, nt0 = warp / KSPLIT;
  const float scale = p.softmax_scale * kLog2e;

  // Q fragments (A layout, rows = heads) for this warp's dim slice, straight from global memory, once.
  uint32_t qa[KSTEPS][4];
  {
    auto qword = [&](int row, int d) -> uint32_t {
      if (row >= rows_valid) return 0u;
      const int64_t th = static_cast<int64_t>(it.token) * nh + h0 + row;
      const bf16* src = d < KVR ? p.q_lat + th * KVR + d : p.q + th * (p.nope + C::ROPE) + p.nope + (d - KVR);
      return *reinterpret_cast<const uint32_t*>(src);
    };
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
      const int d = (kh * KSTEPS + ks) * 16 + 2 * t4;
      qa[ks][0] = qword(g, d);
      qa[ks][1] = qword(g + 8, d);
      qa[ks][2] = qword(g, d + 8);
      qa[ks][3] = qword(g + 8, d + 8);
    }
  }

  float o[C::NTO][4];
#pragma unroll
  for (int i = 0; i < C::NTO; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};  // rows g, g + 8; l: this lane's keys only

  for (int kt = 0; kt < n_tiles; ++kt) {
    const int s = kt % STAGES;
    mbar_wait(full + s, (kt / STAGES) & 1);
    const bf16* K = sK + (FP8 ? 0 : s * BN * LDS);
    if constexpr (FP8) {
      named_bar_sync(2, NW * 32);  // every consumer is done with the previous tile's bf16 copy
      fp8_tile_to_bf16<C>(sF8 + s * BN * C::D, sK, tid, NW * 32, CODES);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + s);  // this warp has read its part of the FP8 stage
      named_bar_sync(3, NW * 32);  // the bf16 tile is whole
    }
    const int key0 = it.key_begin + kt * BN;
    float* sSb = sS + (kt & 1) * KSPLIT * HB * LDSS;

    // S = Q K^T over this warp's units; even / odd k steps in separate accumulators (shorter MMA chains).
    {
      float acc[NPW][2][4];
#pragma unroll
      for (int j = 0; j < NPW; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) acc[j][e][0] = acc[j][e][1] = acc[j][e][2] = acc[j][e][3] = 0.0f;
      auto frag_addr = [&](int i) -> const bf16* {
        if constexpr (NPW == 1) {
          // x4 = k steps 2i, 2i+1 of one n-tile
          return K + (nt0 * 8 + (lane & 7)) * LDS + (kh * KSTEPS + 2 * i) * 16 + (lane >> 3) * 8;
        } else {
          // x4 = one k step of n-tiles 2pp, 2pp+1
          const int ks = i / (NPW / 2), pp = i % (NPW / 2);
          const int nt = nt0 + (2 * pp + (lane >> 4)) * (NW / KSPLIT);
          return K + (nt * 8 + (lane & 7)) * LDS + (kh * KSTEPS + ks) * 16 + ((lane >> 3) & 1) * 8;
        }
      };
      constexpr int PF = C::PF < C::NLOAD ? C::PF : C::NLOAD;
      uint32_t bfr[PF][4];
#pragma unroll
      for (int i = 0; i < PF; ++i) {
        if constexpr (NPW == 1) {
          if (2 * i + 1 < KSTEPS) ldmatrix_x4(bfr[i], frag_addr(i));
          else {
            uint32_t h[2];
            ldmatrix_x2(h, frag_addr(i));
            bfr[i][0] = h[0], bfr[i][1] = h[1], bfr[i][2] = bfr[i][3] = 0u;
          }
        } else {
          ldmatrix_x4(bfr[i], frag_addr(i));
        }
      }
#pragma unroll
      for (int i = 0; i < C::NLOAD; ++i) {
        uint32_t b[4] = {bfr[i % PF][0], bfr[i % PF][1], bfr[i % PF][2], bfr[i % PF][3]};
        if (i + PF < C::NLOAD) {
          const int ni = i + PF;
          if constexpr (NPW == 1) {
            if (2 * ni + 1 < KSTEPS) ldmatrix_x4(bfr[i % PF], frag_addr(ni));
            else {
              uint32_t h[2];
              ldmatrix_x2(h, frag_addr(ni));
              bfr[i % PF][0] = h[0], bfr[i % PF][1] = h[1];
            }
          } else {
            ldmatrix_x4(bfr[i % PF], frag_addr(ni));
          }
        }
        if constexpr (NPW == 1) {
          mma_bf16(acc[0][0], qa[2 * i], b[0], b[1]);
          if (2 * i + 1 < KSTEPS) mma_bf16(acc[0][1], qa[2 * i + 1], b[2], b[3]);
        } else {
          const int ks = i / (NPW / 2), pp = i % (NPW / 2);
          mma_bf16(acc[2 * pp][ks & 1], qa[ks], b[0], b[1]);
          mma_bf16(acc[2 * pp + 1][ks & 1], qa[ks], b[2], b[3]);
        }
      }
#pragma unroll
      for (int j = 0; j < NPW; ++j) {
        const int kc = (nt0 + j * (NW / KSPLIT)) * 8 + 2 * t4;
        const bool v0 = key0 + kc < it.key_end, v1 = key0 + kc + 1 < it.key_end;
        float* s0 = sSb + kh * HB * LDSS + g * LDSS + kc;
        *reinterpret_cast<float2*>(s0) = make_float2(v0 ? (acc[j][0][0] + acc[j][1][0]) * scale : -INFINITY,
                                                     v1 ? (acc[j][0][1] + acc[j][1][1]) * scale : -INFINITY);
        *reinterpret_cast<float2*>(s0 + 8 * LDSS) =
            make_float2(v0 ? (acc[j][0][2] + acc[j][1][2]) * scale : -INFINITY,
                        v1 ? (acc[j][0][3] + acc[j][1][3]) * scale : -INFINITY);
      }
    }
    named_bar_sync(1, NW * 32);

    // Online softmax of the whole tile in every warp, in P @ V A-fragment order: [k step][row g / g+8][4 keys].
    constexpr int PK = BN / 16;
    uint32_t pa[PK][4];
    {
      float sv[PK][2][4];
#pragma unroll
      for (int j = 0; j < PK; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float* src = sSb + (g + 8 * r) * LDSS + j * 16 + h * 8 + 2 * t4;
            float2 v = *reinterpret_cast<const float2*>(src);
#pragma unroll
            for (int q = 1; q < KSPLIT; ++q) {
              const float2 w = *reinterpret_cast<const float2*>(src + q * HB * LDSS);
              v.x += w.x;
              v.y += w.y;
            }
            sv[j][r][2 * h] = v.x;
            sv[j][r][2 * h + 1] = v.y;
          }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < PK; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) mx = fmaxf(mx, sv[j][r][c]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_r[r], mx);
        const float mb = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = exp2f(m_r[r] - mb);
        m_r[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < PK; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            sv[j][r][c] = exp2f(sv[j][r][c] - mb);
            sum += sv[j][r][c];
          }
        l_r[r] = l_r[r] * alpha + sum;
#pragma unroll
        for (int i = 0; i < C::NTO; ++i) {
          o[i][2 * r] *= alpha;
          o[i][2 * r + 1] *= alpha;
        }
      }
#pragma unroll
      for (int j = 0; j < PK; ++j) {
        pa[j][0] = pack_bf16x2(sv[j][0][0], sv[j][0][1]);
        pa[j][1] = pack_bf16x2(sv[j][1][0], sv[j][1][1]);
        pa[j][2] = pack_bf16x2(sv[j][0][2], sv[j][0][3]);
        pa[j][3] = pack_bf16x2(sv[j][1][2], sv[j][1][3]);
      }
    }

    // O += P V  (V = the first 512 columns of the cache tile; this warp's DVW columns)
#pragma unroll
    for (int j = 0; j < PK; ++j) {
      mma_pv_step(o, pa[j], K + (j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + warp * C::DVW + (lane >> 4) * 8);
    }
    if constexpr (!FP8) {
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + s);
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
    l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
  }
  const int r0 = g, r1 = g + 8;
  store_output(p, it, h0, r0, warp * C::DVW + 2 * t4, rows_valid, o, 1.0f / l_r[0], 1.0f / l_r[1]);
  if (it.partial >= 0 && warp == 0 && t4 == 0) {
    float* lse = p.partial_lse + static_cast<int64_t>(it.partial) * nh + h0;
    if (r0 < rows_valid) lse[r0] = m_r[0] + log2f(l_r[0]);
    if (r1 < rows_valid) lse[r1] = m_r[1] + log2f(l_r[1]);
  }
}

// Simple path for any kvr / rope: one block per (item, head); keys in chunks of blockDim, fp32 throughout.
constexpr int kSimpleThreads = 128;
constexpr int kSimpleMaxCols = 8;  // kvr <= 1024

// Element i of the cache (bf16, or the value of an FP8 code).
__device__ __forceinline__ float cache_at(const MlaDecodeParams& p, int64_t i) {
  if (p.cache_f8) return cache_code_value(p.cache_f8[i], cache_codes(p.cache_f8, p.cache_e5m2));
  return __bfloat162float(p.cache[i]);
}

__global__ void __launch_bounds__(kSimpleThreads) mla_decode_simple_kernel(const MlaDecodeParams p) {
  extern __shared__ float sq[];  // [kvr + rope] query, then [kSimpleThreads] probabilities
  __shared__ float red[32];
  const MlaDecodeItem it = p.items[blockIdx.x];
  const int h = blockIdx.y, nh = p.num_heads, kvr = p.kvr, W = p.kvr + p.rope;
  float* sp = sq + W;
  const int64_t th = static_cast<int64_t>(it.token) * nh + h;
  if (it.key_end <= it.key_begin) {
    if (it.partial >= 0 && threadIdx.x == 0) p.partial_lse[static_cast<int64_t>(it.partial) * nh + h] = -INFINITY;
    return;
  }
  for (int i = threadIdx.x; i < W; i += blockDim.x)
    sq[i] = i < kvr ? __bfloat162float(p.q_lat[th * kvr + i])
                    : __bfloat162float(p.q[th * (p.nope + p.rope) + p.nope + (i - kvr)]);
  __syncthreads();
  const int32_t* ptab = p.page_table + static_cast<int64_t>(it.seq) * p.max_pages;
  const float scale = p.softmax_scale * kLog2e;
  float m = -INFINITY, l = 0.0f;
  float o[kSimpleMaxCols];
#pragma unroll
  for (int i = 0; i < kSimpleMaxCols; ++i) o[i] = 0.0f;
  for (int k0 = it.key_begin; k0 < it.key_end; k0 += kSimpleThreads) {
    const int key = k0 + threadIdx.x;
    float s = -INFINITY;
    if (key < it.key_end) {
      const int64_t slot = static_cast<int64_t>(ptab[key / p.page_size]) * p.page_size + key % p.page_size;
      float acc = 0.0f;
      for (int d = 0; d < W; ++d) acc += sq[d] * cache_at(p, slot * W + d);
      s = acc * scale;
    }
    const float m_new = fmaxf(m, block_max(s, red));
    const float e = key < it.key_end ? exp2f(s - m_new) : 0.0f;
    const float sum = block_sum(e, red);
    const float alpha = exp2f(m - m_new);
    l = l * alpha + sum;
    m = m_new;
    sp[threadIdx.x] = e;
    __syncthreads();
    const int n = min(kSimpleThreads, it.key_end - k0);
#pragma unroll
    for (int i = 0; i < kSimpleMaxCols; ++i) o[i] *= alpha;
    for (int j = 0; j < n; ++j) {
      const int kj = k0 + j;
      const int64_t slot = static_cast<int64_t>(ptab[kj / p.page_size]) * p.page_size + kj % p.page_size;
      const float pj = sp[j];
#pragma unroll
      for (int i = 0; i < kSimpleMaxCols; ++i) {
        const int c = threadIdx.x + i * kSimpleThreads;
        if (c < kvr) o[i] += pj * cache_at(p, slot * W + c);
      }
    }
    __syncthreads();
  }
  const float inv = 1.0f / l;
#pragma unroll
  for (int i = 0; i < kSimpleMaxCols; ++i) {
    const int c = threadIdx.x + i * kSimpleThreads;
    if (c >= kvr) continue;
    if (it.partial < 0) p.out_lat[th * kvr + c] = __float2bfloat16_rn(o[i] * inv);
    else p.partial_o[(static_cast<int64_t>(it.partial) * nh + h) * kvr + c] = o[i] * inv;
  }
  if (it.partial >= 0 && threadIdx.x == 0) p.partial_lse[static_cast<int64_t>(it.partial) * nh + h] = m + log2f(l);
}

constexpr int kCombineThreads = 128, kCombineMaxCols = 8;  // kvr <= 1024

// One block per (token, head): combine_splits (combine.cuh).
__global__ void __launch_bounds__(kCombineThreads) mla_decode_combine_kernel(const MlaDecodeCombineItem* items,
                                                                            const float* partial_o,
                                                                            const float* partial_lse, int32_t nh,
                                                                            int32_t kvr, bf16* out_lat) {
  pdl_wait();
  __shared__ float red[32];
  __shared__ float wts[kCombineThreads];
  const MlaDecodeCombineItem it = items[blockIdx.x];
  const int h = blockIdx.y, tid = threadIdx.x;
  float acc[kCombineMaxCols], inv_total;
  combine_splits<kCombineThreads>(partial_o, partial_lse, it.first_partial, it.num_partials, nh, h, kvr, red, wts, acc,
                                  inv_total);
  pdl_trigger();  // after this kernel's reads: the next kernel's early weight loads would hold them up
#pragma unroll
  for (int j = 0; j < kCombineMaxCols; ++j) {
    const int c = tid + j * kCombineThreads;
    if (c < kvr) out_lat[(static_cast<int64_t>(it.token) * nh + h) * kvr + c] = __float2bfloat16_rn(acc[j] * inv_total);
  }
}

template <int HB, int NW, int STAGES, int BN, int KSPLIT = 1>
cudaError_t configure_fast() {
  using C = DecodeCfg<HB, NW, STAGES, BN, KSPLIT>;
  static std::atomic<uint64_t> configured{0};  // per instantiation, one bit per device
  return set_max_dynamic_smem_once(mla_decode_fast_kernel<HB, NW, STAGES, BN, KSPLIT>, static_cast<int>(C::smem_bytes),
                                   configured);
}

template <int HB, int NW, int STAGES, int BN, int KSPLIT = 1>
cudaError_t launch_fast(const MlaDecodeParams& p, cudaStream_t stream) {
  using C = DecodeCfg<HB, NW, STAGES, BN, KSPLIT>;
  auto kernel = mla_decode_fast_kernel<HB, NW, STAGES, BN, KSPLIT>;
  if (cudaError_t e = configure_fast<HB, NW, STAGES, BN, KSPLIT>(); e != cudaSuccess) return e;
  dim3 grid(static_cast<unsigned>(p.num_items), static_cast<unsigned>((p.num_heads + HB - 1) / HB));
  kernel<<<grid, NW * 32, C::smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

template <int NW, int STAGES, int BN, int KSPLIT, int MINB, bool FP8 = false, CacheCodes CODES = CacheCodes::None>
cudaError_t configure_ws() {
  using C = WsCfg<NW, STAGES, BN, KSPLIT, MINB, FP8>;
  static std::atomic<uint64_t> configured{0};
  return set_max_dynamic_smem_once(mla_decode_ws_kernel<NW, STAGES, BN, KSPLIT, MINB, FP8, CODES>,
                                   static_cast<int>(C::smem_bytes), configured);
}

template <int NW, int STAGES, int BN, int KSPLIT, int MINB, bool FP8 = false, CacheCodes CODES = CacheCodes::None>
cudaError_t launch_ws(const MlaDecodeParams& p, cudaStream_t stream) {
  using C = WsCfg<NW, STAGES, BN, KSPLIT, MINB, FP8>;
  if (cudaError_t e = configure_ws<NW, STAGES, BN, KSPLIT, MINB, FP8, CODES>(); e != cudaSuccess) return e;
  dim3 grid(static_cast<unsigned>(p.num_items), static_cast<unsigned>((p.num_heads + C::HB - 1) / C::HB));
  return launch(mla_decode_ws_kernel<NW, STAGES, BN, KSPLIT, MINB, FP8, CODES>, grid, C::THREADS, C::smem_bytes,
                stream, p);
}

// The FP8-cache kernel: variant 7's shape (4 consumer warps, 32-key tiles, dims over 4 warps, 2 blocks per SM) with
// a ring of 3 FP8 stages (their 54 KB and the one bf16 tile fit two blocks on an SM); one instantiation per code type.
// (2 FP8 stages measured 1.75x slower in isolation, 2% slower per step: docs/perf.md.)
cudaError_t configure_fp8() {
  if (cudaError_t e = configure_ws<4, 3, 32, 4, 2, true, CacheCodes::E4M3>(); e != cudaSuccess) return e;
  return configure_ws<4, 3, 32, 4, 2, true, CacheCodes::E5M2>();
}
cudaError_t launch_fp8(const MlaDecodeParams& p, cudaStream_t stream) {
  if (p.cache_e5m2) return launch_ws<4, 3, 32, 4, 2, true, CacheCodes::E5M2>(p, stream);
  return launch_ws<4, 3, 32, 4, 2, true, CacheCodes::E4M3>(p, stream);
}

bool fast_dims(int32_t kvr, int32_t rope) { return kvr == 512 && rope == 64; }

// Resident blocks per SM of a 16-head-group variant (the planner sizes splits for one wave of them).
int64_t blocks_per_sm_16(int32_t variant) { return variant == 5 || variant == 6 || variant == 8 ? 1 : 2; }  // FP8: 2

// Blocks of the decode kernel resident at once, and blocks per item (head groups), for these dims.
void decode_occupancy(int32_t num_heads, int32_t kvr, int32_t rope, int32_t num_sms, int32_t variant, int64_t& slots,
                      int64_t& groups) {
  if (fast_dims(kvr, rope) && num_heads % 64 == 0) {  // one block per SM: mla_decode_wgmma (bf16 or FP8 cache)
    slots = num_sms;
    groups = num_heads / 64;
  } else if (fast_dims(kvr, rope)) {
    slots = blocks_per_sm_16(variant) * num_sms;
    groups = (num_heads + 15) / 16;
  } else {
    slots = 8LL * num_sms;
    groups = num_heads;
  }
}

}  // namespace

int32_t mla_decode_split_keys(int64_t total_keys, int64_t num_tokens, int64_t max_ctx, int32_t num_heads, int32_t kvr,
                              int32_t rope, int32_t num_sms, int32_t variant) {
  int64_t slots, groups;
  decode_occupancy(num_heads, kvr, rope, num_sms, variant, slots, groups);
  // No split when the unsplit blocks already fill about one wave (no combine pass then); otherwise splits sized
  // for about one wave of blocks, at least 256 keys, in whole 64-key steps.
  if (num_tokens * groups * 4 >= slots * 3) return static_cast<int32_t>(std::min<int64_t>(max_ctx, 1 << 30));
  int64_t chunk = (total_keys * groups + slots - 1) / slots;
  chunk = (chunk + 63) / 64 * 64;
  if (chunk < 256) chunk = 256;
  if (chunk > (1 << 30)) chunk = 1 << 30;
  return static_cast<int32_t>(chunk);
}

int32_t mla_decode_fixed_splits(int64_t num_tokens, int32_t num_heads, int32_t kvr, int32_t rope, int32_t num_sms,
                                int32_t variant) {
  int64_t slots, groups;
  decode_occupancy(num_heads, kvr, rope, num_sms, variant, slots, groups);
  const int64_t blocks = std::max<int64_t>(1, num_tokens * groups);
  if (blocks * 4 >= slots * 3) return 1;
  return static_cast<int32_t>(std::min<int64_t>(kMaxFixedSplits, (slots + blocks - 1) / blocks));
}

cudaError_t mla_decode_prepare() {
  for (cudaError_t e : {configure_fast<64, 8, 3, 32>(), configure_fast<64, 8, 2, 32>(), configure_fast<16, 4, 3, 32>(),
                        configure_fast<16, 4, 4, 32>(), configure_fast<16, 8, 2, 64>(), configure_fast<16, 8, 2, 32, 2>(),
                        configure_fast<16, 4, 2, 32>(), configure_ws<8, 5, 32, 2, 1>(), configure_ws<8, 5, 32, 4, 1>(),
                        configure_ws<4, 2, 32, 4, 2>(), configure_ws<8, 2, 64, 2, 1>(), configure_fp8(),
                        mla_decode_wgmma_prepare()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

cudaError_t mla_decode(const MlaDecodeParams& p, bool allow_fast, cudaStream_t stream) {
  if (p.num_items == 0 || p.num_heads == 0) return cudaSuccess;
  if (allow_fast && fast_dims(p.kvr, p.rope) && p.num_heads % 64 == 0) {
    bool launched = false;  // the warpgroup-MMA kernel (mla_decode_wgmma.cu) where it applies
    if (cudaError_t e = mla_decode_wgmma(p, stream, launched); e != cudaSuccess || launched) return e;
  }
  if (p.cache_f8 && allow_fast && fast_dims(p.kvr, p.rope)) return launch_fp8(p, stream);
  if (allow_fast && fast_dims(p.kvr, p.rope) && !p.cache_f8) {
    if (p.num_heads % 64 == 0) {
      if (p.variant == 1) return launch_fast<64, 8, 3, 32>(p, stream);
      return launch_fast<64, 8, 2, 32>(p, stream);
    }
    switch (p.variant) {
      case 1: return launch_fast<16, 4, 3, 32>(p, stream);
      case 2: return launch_fast<16, 4, 4, 32>(p, stream);
      case 3: return launch_fast<16, 8, 2, 64>(p, stream);
      case 4: return launch_fast<16, 8, 2, 32, 2>(p, stream);
      case 5: return launch_ws<8, 5, 32, 2, 1>(p, stream);
      case 6: return launch_ws<8, 5, 32, 4, 1>(p, stream);
      case 7: return launch_ws<4, 2, 32, 4, 2>(p, stream);
      case 8: return launch_ws<8, 2, 64, 2, 1>(p, stream);
      default: return launch_fast<16, 4, 2, 32>(p, stream);
    }
  }
  if (p.kvr > kSimpleThreads * kSimpleMaxCols) return cudaErrorInvalidValue;
  dim3 grid(static_cast<unsigned>(p.num_items), static_cast<unsigned>(p.num_heads));
  const size_t smem = sizeof(float) * (p.kvr + p.rope + kSimpleThreads);
  mla_decode_simple_kernel<<<grid, kSimpleThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t mla_decode_combine(const MlaDecodeCombineItem* items, int32_t num_items, const float* partial_o,
                               const float* partial_lse, int32_t num_heads, int32_t kvr, bf16* out_lat,
                               cudaStream_t stream) {
  if (num_items == 0 || num_heads == 0) return cudaSuccess;
  if (kvr > kCombineThreads * kCombineMaxCols) return cudaErrorInvalidValue;
  dim3 grid(static_cast<unsigned>(num_items), static_cast<unsigned>(num_heads));
  return launch(mla_decode_combine_kernel, grid, kCombineThreads, 0, stream, items, partial_o, partial_lse, num_heads,
                kvr, out_lat);
}

}  // namespace mlaserve::cuda
