// MLA prefill attention, expanded form: causal multi-head attention of q [T, nh, nope + rope] over keys
// [k_nope (from kv_b_proj(c_kv)) | k_pe (shared, from the cache)] and values v (from kv_b_proj(c_kv)), for a ragged
// batch whose prefix may already be in the paged cache (the context rows are gathered first). CPU reference:
// cpu::mla_attention (expanded branch).
//
// Fast path (nope 128, rope 64, v 128), Hopper warpgroup MMAs (wgmma.cuh), FlashAttention-3 style: a block takes 128
// queries of one head as two consumer warpgroups of 64 query rows, plus a producer warpgroup whose one thread copies Q
// and K / V tiles of 128 keys with TMA (tensor maps made per call, 128-byte swizzle: the layout wgmma reads) into two
// K and two V stages, each stage's readiness and release on mbarriers, and gives its registers to the consumers
// (setmaxnreg). Per tile a warpgroup issues S = Q K^T (12 k-steps of m64n128k16 from shared memory) together with the
// previous tile's P V (8 k-steps with P, bf16, from registers and V read MN-major), runs the online softmax (log2
// space) on S while P V is on the tensor cores, then rescales O. K / V tiles are each read once per 128 queries; at
// 32K tokens the attention is about as fast as the tiles' L2 traffic alone (docs/perf.md, forty-third session).
// Items come longest first (the backend sorts them). Other dims, no tensor maps, or the fast path off: a simple
// kernel.

#include <cmath>

#include <cuda_fp8.h>

#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/tma.cuh"
#include "backend/cuda/wgmma.cuh"

namespace mlaserve::cuda {

namespace {

__global__ void gather_context_kernel(const bf16* cache, const uint8_t* cache_f8, bool e5m2, int32_t width,
                                      const int32_t* page_table, int32_t page_size, int32_t max_pages,
                                      const int32_t* row_seq, const int32_t* row_pos, bf16* ctx) {
  const int64_t r = blockIdx.x;
  const int32_t seq = row_seq[r], pos = row_pos[r];
  const int64_t slot = static_cast<int64_t>(page_table[static_cast<int64_t>(seq) * max_pages + pos / page_size]) *
                           page_size + pos % page_size;
  bf16* dst = ctx + r * width;
  if (cache_f8) {  // an FP8 cache: its codes' values (exact in bf16)
    const uint8_t* src = cache_f8 + slot * width;
    const CacheCodes codes = cache_codes(cache_f8, e5m2);
    if ((width & 3) == 0) {
      for (int i = threadIdx.x; i < width / 4; i += blockDim.x) {
        uint32_t lo, hi;
        cache_codes4_bf16(reinterpret_cast<const uint32_t*>(src)[i], lo, hi, codes);
        reinterpret_cast<uint2*>(dst)[i] = make_uint2(lo, hi);
      }
    } else {
      for (int i = threadIdx.x; i < width; i += blockDim.x)
        dst[i] = __float2bfloat16_rn(cache_code_value(src[i], codes));
    }
    return;
  }
  const bf16* src = cache + slot * width;
  if ((width & 7) == 0) {
    for (int i = threadIdx.x; i < width / 8; i += blockDim.x)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
  }
}

namespace wg {
constexpr int NOPE = 128, ROPE = 64, DQK = 192, DV = 128, KVR = 512;
constexpr int BM = kPrefillBlockQ, BN = 128, NC = 256, NT = NC + 128;  // 2 consumer warpgroups + the producer
constexpr int PART = 128;                                 // bytes of a row in a part (64 bf16)
constexpr int Q_BYTES = BM * DQK * 2, K_BYTES = BN * DQK * 2, V_BYTES = BN * DV * 2;
constexpr int BAR_BYTES = 64;                             // 8 mbarriers
constexpr size_t smem_bytes = 1024 + Q_BYTES + 2 * K_BYTES + 2 * V_BYTES + BAR_BYTES;  // + alignment to 1,024
static_assert(BM == 128, "two warpgroups of 64 queries");
}  // namespace wg

struct PrefillMaps {  // TMA descriptors: q [T, nh, 192], kv [L, nh, 256], ctx_latent [L, 576]; boxes of 64 x 128 rows
  CUtensorMap q, kv, pe;
};

__global__ void __launch_bounds__(wg::NT, 1)
    mla_prefill_wgmma_kernel(const MlaPrefillParams p, const __grid_constant__ PrefillMaps maps) {
  using namespace wg;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  uint8_t* sQ = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  uint8_t* sK = sQ + Q_BYTES;      // [2][3 parts][BN][128 B]
  uint8_t* sV = sK + 2 * K_BYTES;  // [2][2 parts][BN][128 B]
  uint64_t* full_k = reinterpret_cast<uint64_t*>(sV + 2 * V_BYTES);  // [2] K (with Q the first) landed
  uint64_t* full_v = full_k + 2;                                      // [2] V landed
  uint64_t* empty_k = full_k + 4;                                     // [2] K read (8 consumer warps)
  uint64_t* empty_v = full_k + 6;                                     // [2] V read

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const MlaPrefillItem it = p.items[blockIdx.x];
  const int h = blockIdx.y;
  const int kmax = it.pos_begin + it.num_tokens;  // keys [0, kmax)
  const int n_tiles = (kmax + BN - 1) / BN;
  if (tid == 0) {
    for (int i = 0; i < 4; ++i) mbar_init(&full_k[i], 1);
    for (int i = 4; i < 8; ++i) mbar_init(&full_k[i], 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp >= 8) {  // the producer: K kt, then V kt, each once the tile two before it in that stage was read
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");  // (its warpgroup's registers to the others)
    if (warp == 8 && lane == 0) {
      for (int kt = 0; kt < n_tiles; ++kt) {
        const int stage = kt & 1, row = it.kv_begin + kt * BN;
        if (kt >= 2) mbar_wait(&empty_k[stage], ((kt >> 1) - 1) & 1);
        mbar_expect_tx(&full_k[stage], K_BYTES + (kt == 0 ? Q_BYTES : 0));
        if (kt == 0)
          for (int part = 0; part < 3; ++part)
            tma_load(sQ + part * (BM * PART), &maps.q, part * 64, h, it.token_begin, &full_k[0]);
        uint8_t* k = sK + stage * K_BYTES;
        tma_load(k, &maps.kv, 0, h, row, &full_k[stage]);
        tma_load(k + BN * PART, &maps.kv, 64, h, row, &full_k[stage]);
        tma_load(k + 2 * BN * PART, &maps.pe, KVR, row, 0, &full_k[stage]);
        mbar_arrive(&full_k[stage]);
        if (kt >= 2) mbar_wait(&empty_v[stage], ((kt >> 1) - 1) & 1);
        mbar_expect_tx(&full_v[stage], V_BYTES);
        uint8_t* v = sV + stage * V_BYTES;
        tma_load(v, &maps.kv, NOPE, h, row, &full_v[stage]);
        tma_load(v + BN * PART, &maps.kv, NOPE + 64, h, row, &full_v[stage]);
        mbar_arrive(&full_v[stage]);
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const int grp = warp >> 2, g = lane >> 2, t4 = lane & 3;
  const int r0 = grp * 64 + (warp & 3) * 16 + g, r1 = r0 + 8;
  const int first_pos = it.pos_begin + grp * 64;
  const int last_pos = it.pos_begin + min(grp * 64 + 63, it.num_tokens - 1);
  const int pos0 = it.pos_begin + min(r0, it.num_tokens - 1);
  const int pos1 = it.pos_begin + min(r1, it.num_tokens - 1);
  const float scale = p.softmax_scale * kLog2e;
  const uint32_t q_base = smem_addr(sQ) + grp * 64 * PART;
  // This warpgroup's tiles: up to its last query's (a group past the item's tokens has none).
  const int n_my = grp * 64 < it.num_tokens ? min(n_tiles, last_pos / BN + 1) : 0;
  auto release = [&](uint64_t* bars, int kt) {
    __syncwarp();
    if (lane == 0) mbar_arrive(&bars[kt & 1]);
  };

  float o[64], s[64];
  uint32_t pa[BN / 16][4];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = s[i] = 0.0f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;  // running maxima of the scaled scores, sums
  float a0 = 0.0f, a1 = 0.0f;                                   // the last softmax's rescale of o

  auto issue_s = [&](int kt) {
    const uint32_t k_base = smem_addr(sK + (kt & 1) * K_BYTES);
#pragma unroll
    for (int ks = 0; ks < DQK / 16; ++ks) {
      const uint32_t off = (ks & 3) * 32;
      wgmma_m64n128k16_ss(s, wgmma_desc(q_base + (ks >> 2) * (BM * PART) + off, 16),
                          wgmma_desc(k_base + (ks >> 2) * (BN * PART) + off, 16), ks > 0);
    }
  };
  auto issue_pv = [&](int kt) {
    const uint32_t v_base = smem_addr(sV + (kt & 1) * V_BYTES);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wgmma_m64n128k16_rs_mn(o, pa[kk], wgmma_desc(v_base + kk * 16 * PART, BN * PART), 1);
  };
  auto softmax = [&](int kt) {  // s -> probabilities in place; m, l updated; a0 / a1 the rescale of o
    const int key0 = kt * BN;
    const bool need_mask = key0 + BN - 1 > first_pos;
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        float* e = s + 4 * nt;
        const int k = key0 + nt * 8 + 2 * t4;
        if (k > pos0) e[0] = -INFINITY;
        if (k + 1 > pos0) e[1] = -INFINITY;
        if (k > pos1) e[2] = -INFINITY;
        if (k + 1 > pos1) e[3] = -INFINITY;
      }
    }
    wgmma_online_softmax<BN>(s, scale, m0, m1, l0, l1, a0, a1);
  };
  auto rescale_and_pack = [&]() {
    wgmma_scale_rows(o, a0, a1);
    wgmma_pack_a<BN>(s, pa);
  };

  if (n_my > 0) {
    mbar_wait(&full_k[0], 0);
    wgmma_run(s, [&] { issue_s(0); });
    release(empty_k, 0);
    softmax(0);
    rescale_and_pack();
    for (int kt = 1; kt < n_my; ++kt) {
      mbar_wait(&full_k[kt & 1], (kt >> 1) & 1);
      mbar_wait(&full_v[(kt - 1) & 1], ((kt - 1) >> 1) & 1);
      wgmma_pin(s);
      wgmma_pin(o);
      wgmma_fence();
      issue_s(kt);
      wgmma_commit();
      issue_pv(kt - 1);
      wgmma_commit();
      wgmma_wait<1>();  // S of tile kt
      wgmma_pin(s);
      release(empty_k, kt);
      softmax(kt);
      wgmma_wait<0>();  // P V of tile kt - 1
      wgmma_pin(o);
      release(empty_v, kt - 1);
      rescale_and_pack();
    }
    mbar_wait(&full_v[(n_my - 1) & 1], ((n_my - 1) >> 1) & 1);
    wgmma_run(o, [&] { issue_pv(n_my - 1); });
    release(empty_v, n_my - 1);
  }
  for (int kt = n_my; kt < n_tiles; ++kt) {  // tiles after this group's last query: released unread, in order
    mbar_wait(&full_k[kt & 1], (kt >> 1) & 1);
    release(empty_k, kt);
    mbar_wait(&full_v[kt & 1], (kt >> 1) & 1);
    release(empty_v, kt);
  }

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
  bf16* out0 = p.out + (static_cast<int64_t>(it.token_begin + r0) * p.num_heads + h) * DV + 2 * t4;
  bf16* out1 = p.out + (static_cast<int64_t>(it.token_begin + r1) * p.num_heads + h) * DV + 2 * t4;
#pragma unroll
  for (int i = 0; i < DV / 8; ++i) {
    if (r0 < it.num_tokens)
      *reinterpret_cast<uint32_t*>(out0 + i * 8) = pack_bf16x2(o[4 * i] * inv0, o[4 * i + 1] * inv0);
    if (r1 < it.num_tokens)
      *reinterpret_cast<uint32_t*>(out1 + i * 8) = pack_bf16x2(o[4 * i + 2] * inv1, o[4 * i + 3] * inv1);
  }
}

// Simple path for any dims: one block per (token, head), keys in chunks of blockDim, fp32 throughout.
constexpr int kSimpleThreads = 128;
constexpr int kSimpleMaxCols = 8;  // v <= 1024

__global__ void __launch_bounds__(kSimpleThreads) mla_prefill_simple_kernel(const MlaPrefillParams p) {
  extern __shared__ float sq[];  // [nope + rope] query, then [kSimpleThreads] probabilities
  __shared__ float red[32];
  const MlaPrefillItem it = p.items[blockIdx.x / kPrefillBlockQ];
  const int r = blockIdx.x % kPrefillBlockQ;
  if (r >= it.num_tokens) return;
  const int h = blockIdx.y, nh = p.num_heads, hd = p.nope + p.rope, kvw = p.nope + p.v, latw = p.kvr + p.rope;
  const int64_t th = static_cast<int64_t>(it.token_begin + r) * nh + h;
  const int pos = it.pos_begin + r;
  float* sp = sq + hd;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) sq[i] = __bfloat162float(p.q[th * hd + i]);
  __syncthreads();
  const float scale = p.softmax_scale * kLog2e;
  float m = -INFINITY, l = 0.0f;
  float o[kSimpleMaxCols];
#pragma unroll
  for (int i = 0; i < kSimpleMaxCols; ++i) o[i] = 0.0f;
  const int nkeys = pos + 1;
  for (int k0 = 0; k0 < nkeys; k0 += kSimpleThreads) {
    const int key = k0 + threadIdx.x;
    float s = -INFINITY;
    if (key < nkeys) {
      const int64_t row = it.kv_begin + key;
      const bf16* kn = p.kv + (row * nh + h) * kvw;
      const bf16* kp = p.ctx_latent + row * latw + p.kvr;
      float acc = 0.0f;
      for (int d = 0; d < p.nope; ++d) acc += sq[d] * __bfloat162float(kn[d]);
      for (int d = 0; d < p.rope; ++d) acc += sq[p.nope + d] * __bfloat162float(kp[d]);
      s = acc * scale;
    }
    const float m_new = fmaxf(m, block_max(s, red));
    const float e = key < nkeys ? exp2f(s - m_new) : 0.0f;
    const float sum = block_sum(e, red);
    const float alpha = exp2f(m - m_new);
    l = l * alpha + sum;
    m = m_new;
    sp[threadIdx.x] = e;
    __syncthreads();
    const int n = min(kSimpleThreads, nkeys - k0);
#pragma unroll
    for (int i = 0; i < kSimpleMaxCols; ++i) o[i] *= alpha;
    for (int j = 0; j < n; ++j) {
      const bf16* v = p.kv + ((it.kv_begin + k0 + j) * static_cast<int64_t>(nh) + h) * kvw + p.nope;
      const float pj = sp[j];
#pragma unroll
      for (int i = 0; i < kSimpleMaxCols; ++i) {
        const int c = threadIdx.x + i * kSimpleThreads;
        if (c < p.v) o[i] += pj * __bfloat162float(v[c]);
      }
    }
    __syncthreads();
  }
  const float inv = 1.0f / l;
#pragma unroll
  for (int i = 0; i < kSimpleMaxCols; ++i) {
    const int c = threadIdx.x + i * kSimpleThreads;
    if (c < p.v) p.out[th * p.v + c] = __float2bfloat16_rn(o[i] * inv);
  }
}

}  // namespace

cudaError_t mla_gather_context(const bf16* cache, const uint8_t* cache_f8, bool e5m2, int32_t width,
                               const int32_t* page_table, int32_t page_size, int32_t max_pages,
                               const int32_t* row_seq, const int32_t* row_pos, int64_t L, bf16* ctx_latent,
                               cudaStream_t stream) {
  if (L == 0) return cudaSuccess;
  gather_context_kernel<<<static_cast<unsigned>(L), 64, 0, stream>>>(cache, cache_f8, e5m2, width, page_table,
                                                                      page_size, max_pages, row_seq, row_pos,
                                                                      ctx_latent);
  return cudaGetLastError();
}

namespace {
cudaError_t configure_prefill_fast() {
  static std::atomic<uint64_t> configured{0};  // one bit per device
  return set_max_dynamic_smem_once(mla_prefill_wgmma_kernel, static_cast<int>(wg::smem_bytes), configured);
}

cudaError_t prefill_maps(const MlaPrefillParams& p, PrefillMaps& m) {
  using namespace wg;
  const uint64_t nh = static_cast<uint64_t>(p.num_heads), T = static_cast<uint64_t>(p.num_q_rows);
  const uint64_t L = static_cast<uint64_t>(p.num_ctx_rows);
  if (cudaError_t e = encode_map<3>(m.q, p.q, {DQK, nh, T}, {DQK * 2, nh * DQK * 2}, {64, 1, BM}); e != cudaSuccess)
    return e;
  if (cudaError_t e =
          encode_map<3>(m.kv, p.kv, {NOPE + DV, nh, L}, {(NOPE + DV) * 2, nh * (NOPE + DV) * 2}, {64, 1, BN});
      e != cudaSuccess)
    return e;
  return encode_map<3>(m.pe, p.ctx_latent, {KVR + ROPE, L, 1}, {(KVR + ROPE) * 2, L * (KVR + ROPE) * 2}, {64, BN, 1});
}
}  // namespace

cudaError_t mla_prefill_prepare() { return configure_prefill_fast(); }

cudaError_t mla_prefill(const MlaPrefillParams& p, bool allow_fast, cudaStream_t stream) {
  if (p.num_items == 0 || p.num_heads == 0) return cudaSuccess;
  PrefillMaps maps{};
  if (allow_fast && p.nope == wg::NOPE && p.rope == wg::ROPE && p.v == wg::DV && p.kvr == wg::KVR &&
      prefill_maps(p, maps) == cudaSuccess) {
    if (cudaError_t e = configure_prefill_fast(); e != cudaSuccess) return e;
    dim3 grid(static_cast<unsigned>(p.num_items), static_cast<unsigned>(p.num_heads));
    mla_prefill_wgmma_kernel<<<grid, wg::NT, wg::smem_bytes, stream>>>(p, maps);
    return cudaGetLastError();
  }
  if (p.v > kSimpleThreads * kSimpleMaxCols) return cudaErrorInvalidValue;
  dim3 grid(static_cast<unsigned>(p.num_items * kPrefillBlockQ), static_cast<unsigned>(p.num_heads));
  const size_t smem = sizeof(float) * (p.nope + p.rope + kSimpleThreads);
  mla_prefill_simple_kernel<<<grid, kSimpleThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlaserve::cuda
